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
from pathlib import Path
from typing import Iterator

from ars_opd.config import OPDConfig, launched_externally
from ars_opd.rollouts.engine_api import EngineClient, SamplingSpec
from ars_opd.rollouts.engines import BUNDLED, VLLM, RolloutEndpoint, rollout_endpoint
from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan


@contextlib.contextmanager
def stage_engine(cfg: OPDConfig, student_dir: str, checkpoints: str, workers: int) -> Iterator[RolloutEndpoint]:
    """The rollout engine for the stage, serving ``student_dir`` (the models-stage student). Started engines
    live in this process: under an outside launcher with several processes each would start its own, and only
    rank 0's would get the weights."""
    engine = cfg.engine
    if engine.server in (BUNDLED, VLLM) and launched_externally() and workers > 1:
        raise ValueError(
            f"opd.engine.server: {engine.server} starts an engine in each launched process, but only rank 0 "
            "publishes weights: under torchrun start the engine once yourself and set opd.engine.server to its URL"
        )
    with rollout_endpoint(engine, student_dir, Path(checkpoints) / "engine") as endpoint:
        yield endpoint


def worker_rollouts(
    endpoint: RolloutEndpoint | None, cfg: OPDConfig, *, rank: int, world: int, seed: int, eos_ids: tuple[int, ...]
) -> EngineRollouts:
    """Worker ``rank``'s side of the stage's engine (``endpoint``, which ``stage_engine`` yielded)."""
    if endpoint is None:
        raise ValueError("opd.rollouts: engine, but the job carries no rollout engine (run_opd resolves it)")
    plan = RolloutPlan(
        steps=cfg.steps,
        max_lag=cfg.engine.max_lag,
        sync_every=cfg.engine.sync_every,
        sync_dir=Path(endpoint.sync_dir),
        seed=seed,
        probe_tokens=cfg.engine.probe_tokens,
        probe_tolerance=cfg.engine.probe_tolerance,
        transport=cfg.engine.transport,
    )
    spec = SamplingSpec(cfg.sample_temperature, cfg.top_p, cfg.max_new_tokens, tuple(eos_ids))
    client = EngineClient(endpoint.url, endpoint.model, endpoint.settings, cfg.engine.concurrency)
    return EngineRollouts(client, plan, spec, rank, world)
