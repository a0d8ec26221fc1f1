"""The opd stage with ``opd.rollouts: engine``, end to end on the bundled engine and on a real vLLM.

- **Lag 0 is the synchronous path.** With greedy rollouts the engine and the trainer's own generate must
  produce the same completions from the same weights, so the two runs' per-step losses are identical (two
  workers: both ask the engine; rank 0 syncs and every worker waits for the verified version). The probe
  after each sync is within its bound, and the engine's log p of each trained token equals the trainer's.
- **Lag 1** trains on rollouts of the previous version: step 0 is the same as at lag 0 (nothing to lag yet),
  every later rollout is one version old, and the engine's log p now differs from the trainer's (the policy
  moved); ``sampled_token`` logs its truncated importance weights.
- **A stale engine is refused:** a bundled server that answers weight loads and keeps its weights (its fault
  option) stops the stage at the first sync whose weights differ from what it serves, naming the version.
- **Resume:** kill -9 mid-run, rerun: the run resumes from its checkpoint, re-syncs the engine before its
  first rollout, and with lag 0 the result is bit-identical to an uninterrupted run (the bundled engine with
  one request per batch, so that no batch composition enters the logits).
- **vLLM** (marked ``vllm``): a few steps at lag 1 through a vLLM the stage starts, the probe within its
  bound at every sync.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from micro import distill_workspace, run_stage_here

REPO = Path(__file__).resolve().parents[1]
VLLM_STUDENT = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 128}


def _steps(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "data/opd/log/steps.jsonl").read_text().splitlines()]


def _run(root: Path, opd: dict, workers: int = 2, models: dict | None = None) -> list[dict]:
    distill_workspace(REPO, root, opd, workers=workers, models=models)
    run_stage_here(root, "opd")
    return _steps(root)


def _weights(root: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(root / "data/opd/model/model.safetensors"))


@pytest.mark.slow
@pytest.mark.ddp
def test_lag_0_equals_the_trainers_rollouts_and_lag_1_trains_one_version_behind(tmp_path):
    greedy = {"steps": 4, "sample_temperature": 0.0, "snapshot_every": 0}
    trainer = _run(tmp_path / "trainer", greedy)
    engine = _run(tmp_path / "engine", {**greedy, "rollouts": "engine"})
    assert [r["loss"] for r in engine] == [r["loss"] for r in trainer]  # the same rollouts, the same training
    assert [r["task/response_length"] for r in engine] == [r["task/response_length"] for r in trainer]
    for r in engine:
        assert r["task/rollout_lag"] == 0
        assert r["task/probe_max_abs_diff"] <= r["task/probe_bound"]
        # the engine served exactly the weights that train: its log p of each trained token is the trainer's up
        # to the rounding of two fp32 forwards (the probe's bound is that rounding, on the same model)
        assert r["task/engine_abs_dlogp"] <= r["task/probe_bound"]
    # every update moved the probe by more than twice the bound: a stale engine would have been caught
    assert all(r["task/probe_separation"] > 2 * r["task/probe_bound"] for r in engine[1:])

    sampled = {"steps": 4, "loss": "sampled_token", "snapshot_every": 0, "rollouts": "engine"}
    lag0 = _run(tmp_path / "lag0", sampled)
    lag1 = _run(tmp_path / "lag1", {**sampled, "engine": {"max_lag": 1}})
    assert [r["task/rollout_lag"] for r in lag1] == [0, 1, 1, 1]
    # step 0: version 0 sampled both, so both trained on the same rollouts with the same weights. The loss at lag 1
    # carries importance weights exp(log q_now - log q_engine), which at step 0 are 1 only up to the rounding of
    # the engine's and the trainer's fp32 forwards (a CPU where the two round alike gives equal losses, another
    # does not); the per-token divergences the step log records before any weight must be equal exactly
    for key in ("task/response_length", "task/divergence_first_half", "task/divergence_second_half"):
        assert lag1[0][key] == lag0[0][key], key
    assert lag1[0]["task/engine_abs_dlogp"] <= lag1[0]["task/probe_bound"]  # the engine served version 0
    assert math.isnan(lag0[0]["task/importance_weight"])  # no weights without a lag
    bound = lag1[0]["task/probe_bound"]  # the last step syncs nothing (NaN there)
    for r in lag1[1:]:
        # one version old: the engine's log p differs from the trainer's by the last update, far above rounding
        assert r["task/engine_abs_dlogp"] > 10 * bound
        assert 0 < r["task/importance_weight"] <= 2.0
    assert lag1[0]["task/engine_abs_dlogp"] <= lag1[0]["task/probe_bound"]


@pytest.mark.slow
def test_an_engine_that_keeps_its_old_weights_is_refused_at_the_first_update(tmp_path, capsys):
    """The refusal is the stage's one line and exit 4, as an endpoint's errors are, not a traceback."""
    import stages.opd
    from ars_opd.config import TeacherServerConfig, load_params
    from ars_opd.models.loading import model_path
    from ars_opd.serving.local_server import local_server
    from stages import EXIT_ENDPOINT, run_stage

    root = tmp_path / "w"
    distill_workspace(REPO, root, {"steps": 3}, workers=1)
    student = model_path(str(root / load_params(root / "params.yaml").paths.models_dir), "student")
    stale = ("--weight-updates", "--ignore-weight-updates")
    with local_server(student, TeacherServerConfig(threads=1), model_name="student", extra_args=stale) as url:
        distill_workspace(REPO, root, {"steps": 3, "rollouts": "engine", "engine": {"server": url}}, workers=1)
        capsys.readouterr()
        cwd = os.getcwd()
        os.chdir(root)
        try:
            with pytest.raises(SystemExit) as exit_:
                run_stage(stages.opd.main)
        finally:
            os.chdir(cwd)
    err = capsys.readouterr().err
    assert exit_.value.code == EXIT_ENDPOINT and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    # the micro workspace's SFT student is the base student the engine serves, so version 0 is right by
    # accident; the first update (version 1) is what the stale engine does not take
    refused = f"ars-opd opd: the rollout engine at {url} (serving student) does not serve policy version 1"
    assert line.startswith(refused)
    assert "It matches the previous version" in line and "No rollout of this version is used" in line


def _stage(root: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "stages.opd"],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.ddp
def test_kill_9_then_resume_resyncs_the_engine_and_continues_bit_identically(tmp_path):
    opd = {
        "steps": 12,
        "checkpoint_every": 2,
        "snapshot_every": 0,
        "rollouts": "engine",
        "engine": {"bundled": {"max_batch_size": 1}},
    }
    straight = tmp_path / "straight"
    full = _run(straight, opd)
    killed = tmp_path / "killed"
    distill_workspace(REPO, killed, opd, workers=2)
    latest = killed / "data/checkpoints/opd/latest.json"
    proc = _stage(killed)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.exists() and json.loads(latest.read_text())["step"] >= 4:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the stage, its workers and the engine it started
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < 12, "the run finished before it could be killed"
    run_stage_here(killed, "opd")
    resumed = _steps(killed)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full]
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((killed / "data/opd/log/manifest.json").read_text())
    assert manifest["resumed_from"] >= killed_at
    # the resumed run synced its engine before its first rollout (a fresh engine serves the base student)
    first = next(r for r in resumed if r["step"] == manifest["resumed_from"])
    assert first["task/probe_max_abs_diff"] <= first["task/probe_bound"]


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_engine_rollouts_at_lag_1_with_a_verified_version_at_every_sync(tmp_path):
    opd = {"steps": 4, "snapshot_every": 0, "rollouts": "engine", "engine": {"server": "vllm", "max_lag": 1}}
    steps = _run(tmp_path / "w", opd, models={"student_arch": VLLM_STUDENT})
    assert [r["task/rollout_lag"] for r in steps] == [0, 1, 1, 1]
    synced = [r for r in steps if not math.isnan(r["task/probe_max_abs_diff"])]
    assert len(synced) == 3  # versions 0, 1 and 2 (step 3 asks nothing ahead)
    for r in synced:
        assert r["task/probe_max_abs_diff"] <= r["task/probe_bound"]
    assert steps[0]["task/engine_abs_dlogp"] <= steps[0]["task/probe_bound"]
