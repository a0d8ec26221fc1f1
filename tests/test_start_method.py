"""Workers forked from the forkserver (the default on CPU) are the workers ``spawn`` would start: the same
gradients bit for bit, and the launching process's environment and directory as they are at each launch.
A training stage starts that forkserver before its own imports."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from ars_opd.training import distributed
from ddp_probe import start_probe

REPO = Path(__file__).resolve().parents[1]


def _batch(n=8, vocab=40, seed=3):
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    completions = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 6))] for _ in range(n)]
    return {"prompts": prompts, "completions": completions, "micro": 2}


def _same(a: dict, b: dict) -> None:
    assert a["loss"] == b["loss"] and a["tokens"] == b["tokens"]
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    for key in ("mark", "hub_offline", "threads", "cwd"):
        assert a[key] == b[key], key


@pytest.mark.ddp
def test_forkserver_workers_equal_spawned_workers_and_see_each_launchs_environment(tmp_path, monkeypatch):
    assert distributed.default_start_method() == "forkserver"  # CPU only here: the path every other test takes
    job = _batch()
    first = distributed.launch(start_probe, job, 2, start_method="forkserver")
    # a variable set after the forkserver started, one that huggingface_hub reads only at import, and the
    # directory: a spawned worker sees them as they are now, and so must a forked one
    offline = os.environ.get("HF_HUB_OFFLINE", "")
    monkeypatch.setenv("ARS_OPD_TEST_MARK", "second launch")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if offline == "1" else "1")
    monkeypatch.chdir(tmp_path)
    forked = distributed.launch(start_probe, job, 2, start_method="forkserver")
    spawned = distributed.launch(start_probe, job, 2, start_method="spawn")
    _same(forked, spawned)
    assert forked["mark"] == "second launch" and forked["cwd"] == str(tmp_path)
    assert forked["hub_offline"] != first["hub_offline"]
    assert first["mark"] is None and forked["threads"] == 1
    # the same computation either way, before and after the change
    assert first["loss"] == forked["loss"]
    for name in first["grads"]:
        assert torch.equal(first["grads"][name], forked["grads"][name]), name


def test_an_unknown_start_method_is_refused():
    with pytest.raises(ValueError, match="forkserver"):
        distributed.launch(start_probe, {}, 2, start_method="fork")


def _started_early(root, stage: str, ddp: dict) -> dict:
    """Import ``stages`` and run a stage's ``main`` (here one that does nothing) as ``python -m <stage>``
    would in a workspace with these ddp params: whether the forkserver is running afterwards, and whether
    torch was imported on the way. Importing ``stages`` alone must start nothing."""
    import json
    import subprocess
    import sys

    import yaml

    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump({"ddp": ddp}))
    probe = (
        "import sys, json; sys.orig_argv[:] = [sys.executable, '-m', %r]; import stages; "
        "from multiprocessing import forkserver as f; "
        "assert f._forkserver._forkserver_pid is None, 'importing stages started a forkserver'; "
        "stages.run_stage(lambda: None); "
        "print(json.dumps({'running': f._forkserver._forkserver_pid is not None, "
        "'torch': 'torch' in sys.modules}))" % stage
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="CUDA in sight: workers are spawned, nothing to start")
def test_a_training_stage_with_local_cpu_workers_starts_their_forkserver_before_importing_torch(tmp_path):
    assert _started_early(tmp_path / "sft", "stages.sft", {"workers": 2, "device": "cpu"}) == {
        "running": True,
        "torch": False,
    }
    # one worker trains in the stage's process; evaluate never launches workers
    assert not _started_early(tmp_path / "one", "stages.opd", {"workers": 1, "device": "cpu"})["running"]
    assert not _started_early(tmp_path / "eval", "stages.evaluate", {"workers": 2, "device": "cpu"})["running"]
    # a bad params file is left for the stage to report
    assert not _started_early(tmp_path / "bad", "stages.sft", {"workers": "two"})["running"]


def test_a_new_forkserver_does_not_wait_for_a_child_of_the_old_one_still_running():
    """A changed environment restarts the forkserver; a child the old one forked that is still running (a
    worker left over from an earlier launch) holds the old one's "alive" pipe, and multiprocessing's own stop
    waits for that child to exit. The restart must not: here the child sleeps 60 s."""
    import subprocess
    import sys

    script = (
        "import multiprocessing as mp, os, time\n"
        "from ars_opd.training import forkserver\n"
        "forkserver.WORKER_PRELOAD = ()\n"  # nothing to import: the test is about stopping, not preloading
        "forkserver.use_forkserver()\n"
        "child = mp.get_context('forkserver').Process(target=time.sleep, args=(60,))\n"
        "child.start()\n"
        "os.environ['ARS_OPD_TEST_MARK'] = 'changed'\n"
        "t = time.monotonic()\n"
        "kept = forkserver.use_forkserver()\n"
        "took = time.monotonic() - t\n"
        "os.kill(child.pid, 9)\n"
        "print(kept, took)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    kept, took = out.stdout.split()
    assert kept == "False"  # the environment changed: a new forkserver
    assert float(took) < 30  # not the child's 60 s (before the fix it waited for the child)


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="CUDA in sight: workers are spawned, nothing to start")
def test_importing_stages_starts_nothing(monkeypatch, tmp_path):
    """``import stages`` as a training stage's ``python -m`` has no side effect: the forkserver head start
    waits for ``run_stage``."""
    import importlib
    import sys
    import types

    import stages
    from ars_opd import config
    from ars_opd.training import forkserver

    calls = []
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "stages.sft"])
    monkeypatch.setattr(forkserver, "start_early", lambda *a, **k: calls.append(a))
    ddp = config.ParallelConfig(workers=2, device="cpu")
    monkeypatch.setattr(config, "load_params", lambda *a, **k: types.SimpleNamespace(ddp=ddp))
    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    importlib.reload(stages)
    assert calls == []
    monkeypatch.chdir(tmp_path)  # run_stage records the run under paths.stage_runs, relative to the workspace
    (tmp_path / "params.yaml").write_text("base:\n  seed: 0\n")  # run_stage reads it once (load_params is faked)
    stages.run_stage(lambda: None)  # where the head start is taken
    assert calls == [(ddp.threads_per_worker,)]
