"""The opd stage's rollout engine (``opd.rollouts: engine``): one engine for the stage, one ``EngineRollouts``
per worker.

``stage_engine`` runs in the process that launches the workers, for the stage's duration: it starts the engine
that ``opd.engine.server`` names (``ars_opd.rollouts.engines``: the bundled server or vLLM, serving the
models-stage student; the first sync loads the run's starting weights into it), or names the one the user
started, and yields how the workers reach it (``RolloutEndpoint``). That is run-time only: a started engine's
port changes every run, so it stays outside the checkpoint fingerprint.

``worker_rollouts`` builds one worker's side of it (``ars_opd.rollouts.schedule.EngineRollouts``): the plan
(steps, lag, sync cadence, where versions are written, the seeds), the sampling parameters and the client.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, NamedTuple

from ars_opd.config import ConfigError, OPDConfig, launched_externally
from ars_opd.models.loading import model_path
from ars_opd.rollouts.engine_api import EngineClient, SamplingSpec
from ars_opd.rollouts.engines import BUNDLED, VLLM, RolloutEndpoint, rollout_endpoint, stage_context
from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan
from ars_opd.rollouts.version_check import CheckSettings


@contextlib.contextmanager
def stage_engine(cfg: OPDConfig, models_dir: str, checkpoints: str) -> Iterator[RolloutEndpoint]:
    """The rollout engine for the stage, serving the models-stage student of ``models_dir``.

    One engine serves every worker: rank 0 publishes each version into it and checks the probe, and every rank
    waits for that outcome before it asks for rollouts (``ars_opd.rollouts.schedule``). An engine started here
    lives in this process, so it is that one engine only when this process is the only one running the stage:
    ``launch`` starting the workers itself (any ``ddp.workers``), or an outside launcher's world of one. Under
    torchrun with several processes (whatever ``ddp.workers`` says: the launcher's world is the run's), each
    would start its own engine and all but rank 0's would serve the base student for the whole run, unsynced
    and unchecked; that is refused before anything starts: start the engine once and give its URL."""
    engine = cfg.engine
    processes = launcher_world_size()
    if engine.server in (BUNDLED, VLLM) and processes > 1:
        raise ConfigError(
            "opd.engine.server",
            f"{engine.server} starts an engine in each process, and this stage runs in {processes} processes "
            "(the outside launcher's WORLD_SIZE), where only rank 0's engine would get the weights: start one "
            "engine yourself (README: Student rollouts on an engine) and set opd.engine.server to its URL, "
            "which every rank then shares",
        )
    student = model_path(models_dir, "student") if engine.server in (BUNDLED, VLLM) else ""  # a URL serves its own
    with rollout_endpoint(engine, student, checkpoints, stage_context(cfg)) as endpoint:
        yield endpoint


def launcher_world_size() -> int:
    """How many processes run the stage: an outside launcher's world (torchrun sets ``WORLD_SIZE``), else 1
    (this process starts the workers itself, ``ars_opd.training.distributed.launch``)."""
    return int(os.environ["WORLD_SIZE"]) if launched_externally() else 1


class WorkerPlace(NamedTuple):
    """A worker's place in the run, as its rollouts need it: its rank, the world's size, the stage's seed (the
    probe) and the rank's seed under the seed scenario (its requests' seeds, ``ars_opd.rollouts.schedule``)."""

    rank: int
    world: int
    stage_seed: int
    rollout_seed: int


def worker_rollouts(
    endpoint: RolloutEndpoint | None, cfg: OPDConfig, place: WorkerPlace, eos_ids: tuple[int, ...], vocab: int
) -> EngineRollouts:
    """The side of the stage's engine (``endpoint``, which ``stage_engine`` yielded) of the worker at ``place``;
    ``vocab``: the tokenizer's ids (the probe draws from them)."""
    if endpoint is None:
        raise ValueError("opd.rollouts: engine, but the job carries no rollout engine (run_opd resolves it)")
    plan = RolloutPlan(
        steps=cfg.steps,
        max_lag=cfg.engine.max_lag,
        sync_every=cfg.engine.sync_every,
        sync_dir=Path(endpoint.sync_dir),
        seed=place.stage_seed,
        rollout_seed=place.rollout_seed,
        transport=cfg.engine.transport,
        vocab=vocab,
        check=CheckSettings(
            tokens=cfg.engine.probe_tokens,
            tolerance=cfg.engine.probe_tolerance,
            calibration=cfg.engine.probe_calibration,
            margin=cfg.engine.probe_margin,
            indistinguishable=cfg.engine.indistinguishable,
            fingerprint=cfg.engine.fingerprint,
        ),
    )
    spec = SamplingSpec(cfg.sample_temperature, cfg.top_p, cfg.max_new_tokens, tuple(eos_ids))
    client = EngineClient(endpoint.url, endpoint.model, endpoint.settings, cfg.engine.concurrency)
    return EngineRollouts(client, plan, spec, place.rank, place.world)
