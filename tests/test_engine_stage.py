"""The opd stage's rollout engine as the stage wires it (``ars_opd.rollouts.stage``), without a real engine.

- **One engine for the run.** A started engine (bundled, vllm) lives in the process that starts it; under an
  outside launcher with several processes each would start its own, and only rank 0's would get the
  weights. What decides is the launcher's world (``WORLD_SIZE``), not ``ddp.workers``: torchrun with
  ``ddp.workers: 1`` and four processes is refused before anything starts; an engine's URL is shared.
- **Where versions are written.** ``opd.engine.sync_dir`` as given, by default ``<opd checkpoints>/engine-sync``
  (never a temporary directory, which an engine in another container cannot read); the versions are removed
  at the stage's end.
- **Seed scenarios reach the engine.** A worker's requests are seeded from its rank's seed under
  ``ddp.scenario``, as the trainer's own rollouts are: S1-1 (every rank the stage's seed) leaves them as they
  were, S1-2 changes rank 0's, S1-3 every rank's.
- **The engine is released on every way out of the run** (a return, an error, Ctrl-C): ``EngineRollouts.close``,
  which ends the request thread and rank 0's transport (for nccl, the group and the engine's weight-transfer
  side), is called once in each; stage runs on one in-process worker against ``fake_engine.FakeEngine``.
- **A resume survives a restarted engine.** After the engine dies mid-run, a rerun against a new engine on
  another port (and with longer timeouts, more attempts, other concurrency) resumes from the checkpoint; a
  change that can change the numbers (the learning rate) still starts afresh. What may change is one list
  (``ars_opd.training.worker.RESUMABLE_KEYS``), each key of which names a real parameter.
- **Refusals are messages, not crashes.** vLLM's known answers to a weight load it cannot do, as recorded from
  vLLM CPU 0.32 (no worker extension; no ``/collective_rpc`` route without dev mode; another model's shapes,
  with a cause and with an empty one), become one line naming the engine's URL, the model it serves and its
  directory, and what to start instead; an unknown refusal keeps its own message. The stage prints such a
  line alone and exits 4, also when the refusal reaches two workers (rank 0 broadcasts it); the stale engine's
  against the bundled server is in tests/test_engine_rollouts.py.
  Marked ``vllm``: a real vLLM started without the extension gives the first.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from ars_opd.config import ConfigError, OPDConfig, ParallelConfig, PathsConfig, RolloutEngineConfig
from ars_opd.rollouts import stage
from ars_opd.training.opd.stage import run_opd
from ars_opd.training.worker import TrainingJob
from micro import load_committed_params

URL = "http://127.0.0.1:9/v1"  # nothing listens: the tests that name it never reach an engine
REPO = Path(__file__).resolve().parents[1]
RUN = {"rollouts": "engine", "steps": 4, "checkpoint_every": 2, "snapshot_every": 0, "max_new_tokens": 4}
PER_STEP = 8  # rollout requests a step (micro global batch 8, one worker)


def _torchrun(monkeypatch, world: int) -> None:
    """This process as one of ``world`` processes of torchrun (what it sets in each)."""
    for key, value in {"WORLD_SIZE": world, "RANK": 1 % world, "LOCAL_RANK": 1 % world}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


def _job(server: str, workers: int = 1) -> TrainingJob:
    """An opd job on an engine, its paths the defaults (relative: run it in an empty directory)."""
    cfg = OPDConfig(rollouts="engine", engine=RolloutEngineConfig(server=server))
    return TrainingJob("opd", cfg, ParallelConfig(workers=workers), PathsConfig(), progress=False)


def test_under_torchrun_with_ddp_workers_1_a_started_engine_is_refused_before_it_starts(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(stage, "rollout_endpoint", lambda *args: started.append(args))
    monkeypatch.chdir(tmp_path)
    _torchrun(monkeypatch, 4)
    for server in ("bundled", "vllm"):
        with pytest.raises(ConfigError, match=r"opd.engine.server: .*runs in 4 processes.*set opd.engine.server to"):
            run_opd(_job(server, workers=1))
    assert started == []  # refused before any engine started (and before the models were read)


def test_an_engines_url_is_shared_by_every_rank_and_a_world_of_one_may_start_its_own(tmp_path, monkeypatch):
    _torchrun(monkeypatch, 4)
    with stage.stage_engine(_job(URL).cfg, str(tmp_path / "models"), str(tmp_path / "ckpt")) as endpoint:
        assert endpoint.url == URL
    _torchrun(monkeypatch, 1)
    assert stage.launcher_world_size() == 1
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key)
    assert stage.launcher_world_size() == 1  # launch() starts the workers: one process runs the stage


def test_versions_go_to_the_checkpoint_directory_or_the_given_sync_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _job(URL).cfg
    checkpoints = "data/checkpoints/opd"  # relative, as in params.yaml
    with stage.stage_engine(cfg, "data/models", checkpoints) as endpoint:
        assert endpoint.sync_dir == str(tmp_path / checkpoints / "engine-sync")
        version = Path(endpoint.sync_dir) / "policy-v0000003.safetensors"  # what rank 0 would have written
        version.parent.mkdir(parents=True)
        version.write_bytes(b"weights")
    assert not version.exists() and version.parent.is_dir()  # removed at the end; the directory stays
    shared = tmp_path / "shared" / "sync"  # e.g. a volume the engine's container mounts at the same path
    explicit = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, sync_dir=str(shared)))
    with stage.stage_engine(explicit, "data/models", checkpoints) as endpoint:
        assert endpoint.sync_dir == str(shared)


class _Recorder:
    """An engine client that records each generate's seeds and answers one token per prompt."""

    def __init__(self):
        self.seeds: list[list[int]] = []

    def generate(self, prompts, spec, seeds):
        from ars_opd.rollouts.engine_api import Rollout

        self.seeds.append(list(seeds))
        return [Rollout([2], [-0.5], "stop") for _ in prompts]


def _engine_seeds(scenario: str, rank: int, world: int = 2) -> list[int]:
    """The seeds worker ``rank`` sends for step 3's four prompts under ``scenario``: its setup built as
    ``run_worker`` builds it, its rollouts as ``prepare_opd`` builds them, the requests as the schedule asks."""
    import torch

    from ars_opd.rollouts.engines import RolloutEndpoint
    from ars_opd.seeding import derive_seed, scenario_seeds
    from ars_opd.teacher.client.endpoint import ClientSettings
    from ars_opd.training.distributed import WorkerContext
    from ars_opd.training.opd.stage import engine_rollouts
    from ars_opd.training.worker import WorkerSetup

    job = dataclasses.replace(
        _job(URL), rollout_engine=RolloutEndpoint(URL, "student", ClientSettings(URL), "/nonexistent")
    )
    stage_seed = derive_seed(job.ddp.seed, "opd")
    sampler_seed, rng_seed = scenario_seeds(scenario, stage_seed, rank)
    ctx = WorkerContext(rank, world, rank, torch.device("cpu"), "gloo")
    from ars_opd.data import synthetic
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    tokenizer = build_char_word_tokenizer(synthetic.instruction_words())  # its ids: the probe's (no sync here)
    setup = WorkerSetup(ctx, tokenizer, None, sampler_seed, stage_seed, None, rng_seed=rng_seed)
    rollouts = engine_rollouts(job, setup, (2,))
    recorder = rollouts.client = _Recorder()
    rollouts.version = 3  # the engine holds this step's version: no sync (a collective) before the requests
    try:
        rollouts.prepare(3, None, ctx.device, lambda t: [[5, 6]] * 4 if t == 3 else None)
        rollouts.take(3, [[5, 6]] * 4)
    finally:
        rollouts.close()
    return recorder.seeds[0]


def test_engine_request_seeds_follow_the_ranks_scenario_seed():
    from ars_opd.seeding import derive_seed

    stage_seed = derive_seed(_job(URL).ddp.seed, "opd")
    # S1-1: the stage's seed on every rank, the seeds the engine always had
    strict = {r: [derive_seed(stage_seed, f"engine-rollout-3-{r}-{j}") for j in range(4)] for r in (0, 1)}
    assert {r: _engine_seeds("S1-1", r) for r in (0, 1)} == strict
    significant = {r: _engine_seeds("S1-3", r) for r in (0, 1)}
    for r in (0, 1):  # every rank's seeds are its own, new ones
        assert not set(significant[r]) & (set(strict[0]) | set(strict[1])), r
    assert not set(significant[0]) & set(significant[1])
    assert _engine_seeds("S1-2", 0) != strict[0] and _engine_seeds("S1-2", 1) == strict[1]  # rank 0 differs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A micro workspace (models, teacher rows, the SFT student) that each run copies."""
    from micro import distill_workspace

    root = tmp_path_factory.mktemp("engine_stage") / "base"
    distill_workspace(REPO, root, {}, workers=1)
    return root


def _student(root: Path) -> str:
    from ars_opd.config import load_params
    from ars_opd.models.loading import model_path

    return model_path(str(root / load_params(root / "params.yaml").paths.models_dir), "student")


def _run(root: Path, url: str, opd: dict | None = None) -> dict:
    """Run the opd stage in ``root`` on the engine at ``url`` (one worker, in this process); its manifest."""
    import json

    from micro import run_stage_here, write_micro_params

    extra = {"opd": {**RUN, **(opd or {})}, "ddp": {"workers": 1, "threads_per_worker": 1}}
    extra["opd"]["engine"] = {"server": url, **extra["opd"].get("engine", {})}
    write_micro_params(REPO, root / "params.yaml", extra)
    run_stage_here(root, "opd")
    return json.loads((root / "data/opd/log/manifest.json").read_text())


def _copy(base: Path, dest: Path) -> Path:
    shutil.copytree(base, dest)
    return dest


def test_the_engine_is_released_on_every_way_out_of_the_run(base, tmp_path, monkeypatch):
    from ars_opd.rollouts.engine_api import EngineDeadError
    from ars_opd.rollouts.schedule import EngineRollouts
    from ars_opd.training.opd.task import OPDTask
    from fake_engine import FakeEngine

    closed = []
    close = EngineRollouts.close
    monkeypatch.setattr(EngineRollouts, "close", lambda self: (closed.append(self), close(self))[1])
    root = _copy(base, tmp_path / "returns")
    with FakeEngine(_student(base)) as engine:
        assert _run(root, engine.url)["steps"] == RUN["steps"]
    assert len(closed) == 1
    # the versions went to <opd checkpoints>/engine-sync (removed at the end)
    assert {Path(p).parent for p in engine.loaded} == {root / "data/checkpoints/opd/engine-sync"}
    assert not any(Path(p).exists() for p in engine.loaded)

    with FakeEngine(_student(base), die_after=PER_STEP) as engine:  # dies after step 0's rollouts
        with pytest.raises(EngineDeadError, match=f"{engine.server.url} is dead.*rerun the stage, which resumes"):
            _run(_copy(base, tmp_path / "fails"), engine.url)
    assert len(closed) == 2

    micro_batches = OPDTask.micro_batches

    def interrupted(self, step, model):
        if step == 1:
            raise KeyboardInterrupt
        return micro_batches(self, step, model)

    monkeypatch.setattr(OPDTask, "micro_batches", interrupted)
    with FakeEngine(_student(base)) as engine:
        with pytest.raises(KeyboardInterrupt):
            _run(_copy(base, tmp_path / "ctrl-c"), engine.url)
    assert len(closed) == 3


def test_a_resume_against_a_restarted_engine_on_another_port_continues_from_its_checkpoint(base, tmp_path):
    from fake_engine import FakeEngine

    root = _copy(base, tmp_path / "w")
    checkpoints = root / "data/checkpoints/opd"
    with FakeEngine(_student(base), die_after=3 * PER_STEP) as first:  # dies at step 3, after the step-2 save
        with pytest.raises(Exception, match="is dead"):
            _run(root, first.url)
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_0000002"]
    patient = {"engine": {"request_timeout_s": 900.0, "max_attempts": 5, "concurrency": 4}}
    with FakeEngine(_student(base)) as second:
        assert second.url != first.url
        manifest = _run(root, second.url, patient)
    assert manifest["resumed_from"] == 2 and manifest["steps"] == RUN["steps"]
    assert len((root / "data/opd/log/steps.jsonl").read_text().splitlines()) == RUN["steps"]
    with FakeEngine(_student(base)) as third:  # another learning rate is another run
        manifest = _run(root, third.url, {**patient, "lr": 0.002})
    assert manifest["resumed_from"] is None


def test_what_a_resume_may_change_names_real_parameters():
    from ars_opd.config import to_dict
    from ars_opd.training.worker import ADDRESS_KINDS, RESUMABLE_KEYS, resumable_view

    params = load_committed_params()
    config = {"opd": to_dict(params.opd), "ddp": to_dict(params.ddp)}
    for key in (*RESUMABLE_KEYS, *ADDRESS_KINDS):
        node = config
        for name in key.split("."):
            assert isinstance(node, dict) and name in node, key
            node = node[name]

    def view(**engine):
        opd = dataclasses.replace(params.opd, engine=dataclasses.replace(params.opd.engine, **engine))
        return resumable_view({"opd": to_dict(opd), "ddp": to_dict(params.ddp)})

    assert view(server="http://127.0.0.1:8001/v1") == view(server="http://127.0.0.1:8002/v1", request_timeout_s=9.0)
    assert view(server="bundled") != view(server="vllm") != view(server="http://127.0.0.1:8001/v1")
    assert view(max_lag=1) != view(max_lag=0)


# vLLM CPU 0.32's answers to POST /collective_rpc ars_opd_load_weights (recorded against real servers)
NO_EXTENSION = {
    "error": {
        "message": "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no "
        "attribute 'ars_opd_load_weights'', please check the stack trace above for the root cause",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
NO_DEV_MODE = {"detail": "Not Found"}  # a 404: the route exists only with VLLM_SERVER_DEV_MODE=1


def _worker_failed(cause: str) -> dict:
    """A load that failed in vLLM's worker: a model of other shapes (hidden sizes differ: an empty cause)."""
    message = f"Call to collective_rpc method failed: Worker failed with error '{cause}', please check the stack trace"
    return {"error": {"message": message + " above for the root cause", "type": "InternalServerError", "code": 500}}


@pytest.mark.parametrize(
    "status, body, says",
    [
        (
            500,
            NO_EXTENSION,
            r"has no ars_opd worker extension.*--worker-extension-cls ars_opd_vllm_ext.ArsOpdWeightSync",
        ),
        (404, NO_DEV_MODE, r"has no POST /collective_rpc route \(404\).*VLLM_SERVER_DEV_MODE=1"),
        (500, _worker_failed(""), r"failed to load the student's weights \(no cause given.*same architecture"),
        (
            500,
            _worker_failed("start (0) + length (128) exceeds dimension size (96)."),
            r"weights \(start \(0\) \+ length \(128\) exceeds dimension size \(96\).\).*restart it",
        ),
    ],
)
def test_vllms_load_refusals_name_the_engine_its_model_and_the_fix(base, tmp_path, status, body, says):
    from ars_opd.rollouts.engine_api import EngineClient, EngineSetupError
    from fake_engine import FakeEngine

    with FakeEngine(_student(base), load_error=(status, body)) as engine:
        with pytest.raises(EngineSetupError) as err:
            EngineClient(engine.url, "student").load_weights(str(tmp_path / "policy-v0000000.safetensors"))
    message = str(err.value)
    assert message.startswith(f"the rollout engine at {engine.server.url} (serving student from {_student(base)})")
    assert re.search(says, message) and "\n" not in message


def test_an_unknown_refusal_keeps_its_own_message(base, tmp_path):
    from ars_opd.rollouts.engine_api import EngineClient, EngineRequestError, EngineSetupError
    from fake_engine import FakeEngine

    with FakeEngine(_student(base), load_error=(400, {"error": {"message": "no such file"}})) as engine:
        with pytest.raises(EngineRequestError, match="http_400.*no such file") as err:
            EngineClient(engine.url, "student").load_weights(str(tmp_path / "missing.safetensors"))
    assert not isinstance(err.value, EngineSetupError)


def test_an_engine_without_the_extension_stops_the_stage_with_one_line_and_exit_4(base, tmp_path, capsys):
    import os

    import stages.opd
    from fake_engine import FakeEngine
    from micro import write_micro_params
    from stages import EXIT_ENDPOINT, run_stage

    root = _copy(base, tmp_path / "w")
    with FakeEngine(_student(base), load_error=(500, NO_EXTENSION)) as engine:
        write_micro_params(REPO, root / "params.yaml", {"opd": {**RUN, "engine": {"server": engine.url}}})
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
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"ars-opd opd: the rollout engine at {engine.server.url} (serving student from {_student(base)}) has no "
            "ars_opd worker extension"
        )
    )


@pytest.mark.parametrize("stale_sampling", [False, True])
def test_an_engine_that_samples_with_other_weights_than_it_was_verified_with_is_refused_at_lag_0(
    base, tmp_path, capsys, stale_sampling
):
    """The probe and the fingerprint see the loaded weights; the rollouts come from the weights the engine started
    with (the base student, as an engine restarted at the same URL serves). Version 0 is that base student, so
    step 0 passes; at step 1 the engine's log-probabilities of its own samples are a step's drift from the
    trainer's, where at lag 0 they are rounding: refused there, one line, exit 4, before the step's update. A
    healthy engine runs through, every step's engine_abs_dlogp held to the tolerance."""
    import json
    import os

    import stages.opd
    from fake_engine import FakeEngine
    from micro import write_micro_params
    from stages import EXIT_ENDPOINT, run_stage

    root = _copy(base, tmp_path / "w")
    with FakeEngine(_student(base), stale_sampling=stale_sampling) as engine:
        write_micro_params(REPO, root / "params.yaml", {"opd": {**RUN, "engine": {"server": engine.url}}})
        capsys.readouterr()
        cwd = os.getcwd()
        os.chdir(root)
        try:
            if stale_sampling:
                with pytest.raises(SystemExit) as exit_:
                    run_stage(stages.opd.main)
            else:
                run_stage(stages.opd.main)
        finally:
            os.chdir(cwd)
    if not stale_sampling:
        steps = [json.loads(x) for x in (root / "data/opd/log/steps.jsonl").read_text().splitlines()]
        assert len(steps) == RUN["steps"]
        for r in steps:
            assert r["task/rollout_lag"] == 0 and r["task/engine_abs_dlogp"] <= r["task/engine_dlogp_tolerance"]
            assert r["task/engine_dlogp_tolerance"] == r["task/probe_tolerance"]
        return
    err = capsys.readouterr().err
    assert exit_.value.code == EXIT_ENDPOINT and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"ars-opd opd: at step 1 the rollout engine at {engine.server.url}/v1 (serving student)")
    assert "No update is made from these rollouts" in line


@pytest.mark.slow
@pytest.mark.vllm
def test_a_real_vllm_without_the_extension_is_named_and_the_flag_given(tmp_path, char_tokenizer, monkeypatch):
    """A vLLM started as a user might, with dev mode (so the load reaches its worker) but without our extension."""
    from ars_opd.config import ArchConfig
    from ars_opd.models.builtin import build_causal_lm
    from ars_opd.rollouts.engine_api import EngineClient, EngineSetupError
    from ars_opd.rollouts.weights import engine_state_dict, write_version
    from ars_opd.serving.vllm_server import VLLMOptions, vllm_server
    from conftest import VLLM_STUDENT_ARCH
    from test_engine_server import save_student

    model_dir = save_student(tmp_path / "student", char_tokenizer, ArchConfig(**VLLM_STUDENT_ARCH))
    version = write_version(
        engine_state_dict(build_causal_lm(ArchConfig(**VLLM_STUDENT_ARCH), char_tokenizer, seed=1)), tmp_path, 0
    )
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    opts = VLLMOptions(served_model_name="student", one_process=True)
    with vllm_server(model_dir, opts, log_path=tmp_path / "vllm.log") as url:
        client = EngineClient(url, "student")
        with pytest.raises(EngineSetupError) as err:
            client.load_weights(str(version.path))
    message = str(err.value)
    assert message.startswith(f"the rollout engine at {client.root} (serving student from {model_dir})")
    assert "has no ars_opd worker extension" in message and "--worker-extension-cls" in message
