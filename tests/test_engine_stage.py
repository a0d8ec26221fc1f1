"""The opd stage's rollout engine as the stage wires it (``ars_opd.rollouts.stage``), without a real engine.

- **One engine for the run.** A started engine (bundled, vllm) lives in the process that starts it; under an
  outside launcher with several processes each would start its own, and only rank 0's would get the
  weights. What decides is the launcher's world (``WORLD_SIZE``), not ``ddp.workers``: torchrun with
  ``ddp.workers: 1`` and four processes is refused before anything starts; an engine's URL is shared.
- **Where versions are written.** ``opd.engine.sync_dir`` as given, by default ``<opd checkpoints>/engine-sync``
  (never a temporary directory, which an engine in another container cannot read); the versions are removed
  at the stage's end.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ars_opd.config import ConfigError, OPDConfig, ParallelConfig, PathsConfig, RolloutEngineConfig
from ars_opd.rollouts import stage
from ars_opd.training.opd import run_opd
from ars_opd.training.worker import TrainingJob

URL = "http://127.0.0.1:9/v1"  # nothing listens: these tests never reach an engine


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
