"""What a run's step log says about its rollout engine's versions, for ``ars-opd check`` and the report.

A run with engine rollouts (``opd.rollouts: engine``) logs, on each step with a sync, the version check's
columns (``ars_opd.rollouts.schedule.ENGINE_METRICS``): the probe's largest difference, the tolerance τ it was
held to and the derived bound, the separation the update moved the probe by, ``indistinguishable`` (1: an engine
on the previous version would have passed, and not every tensor was verified exactly), and how many tensors the
fingerprint verified exactly or left to the probe; and on each lag-0 step held to τ, ``engine_abs_dlogp`` beside
``engine_dlogp_tolerance``. ``engine_summary`` condenses them; ``engine_problems`` lists what a sound run must not
hold: a sync or a lag-0 step past its tolerance (possible under ``opd.engine.dlogp_check: warn``) and syncs that
were not told apart (under ``opd.engine.indistinguishable: warn``). Plain Python: no torch.
"""

from __future__ import annotations

import math
import statistics

TOLERANCE = "task/probe_tolerance"


def _num(row: dict, key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan


def has_engine(rows: list[dict]) -> bool:
    """Whether the log is a run with engine rollouts (one sync at least)."""
    return any(math.isfinite(_num(r, TOLERANCE)) for r in rows)


def engine_summary(rows: list[dict]) -> dict:
    """The run's syncs and lag-0 checks in numbers (NaN where the run has none)."""
    syncs = [r for r in rows if math.isfinite(_num(r, TOLERANCE))]
    later = [r for r in syncs if math.isfinite(_num(r, "task/probe_separation"))]
    lag0 = [r for r in rows if math.isfinite(_num(r, "task/engine_dlogp_tolerance"))]

    def agg(fn, values):
        values = [v for v in values if math.isfinite(v)]
        return fn(values) if values else math.nan

    return {
        "syncs": len(syncs),
        "tolerance": agg(statistics.median, [_num(r, TOLERANCE) for r in syncs]),
        "bound": agg(statistics.median, [_num(r, "task/probe_bound") for r in syncs]),
        "probe_max_abs_diff": agg(max, [_num(r, "task/probe_max_abs_diff") for r in syncs]),
        "probe_over_tolerance": sum(_num(r, "task/probe_max_abs_diff") > _num(r, TOLERANCE) for r in syncs),
        "separation_min": agg(min, [_num(r, "task/probe_separation") for r in later]),
        "separation_median": agg(statistics.median, [_num(r, "task/probe_separation") for r in later]),
        "indistinguishable": sum(_num(r, "task/indistinguishable") > 0 for r in later),
        "tensors_verified_min": agg(min, [_num(r, "task/tensors_verified") for r in syncs]),
        "tensors_probe_only_max": agg(max, [_num(r, "task/tensors_probe_only") for r in syncs]),
        "lag0_steps": len(lag0),
        "lag0_dlogp_max": agg(max, [_num(r, "task/engine_abs_dlogp") for r in lag0]),
        "lag0_over_tolerance": sum(
            _num(r, "task/engine_abs_dlogp") > _num(r, "task/engine_dlogp_tolerance") for r in lag0
        ),
    }


def engine_problems(rows: list[dict]) -> list[tuple[str, str]]:
    """(where, what) for each thing a sound run's engine log must not hold."""
    out = []
    for r in rows:
        step = r.get("step")
        diff, tol = _num(r, "task/probe_max_abs_diff"), _num(r, TOLERANCE)
        if diff > tol:
            out.append((f"step {step}", f"the engine's probe differs by {diff:.3g}, past its tolerance {tol:.3g}"))
        dlogp, lag_tol = _num(r, "task/engine_abs_dlogp"), _num(r, "task/engine_dlogp_tolerance")
        if dlogp > lag_tol:
            out.append(
                (
                    f"step {step}",
                    f"at lag 0 the engine's log-probabilities of its samples differ from the trainer's by {dlogp:.3g}, "
                    f"past the tolerance {lag_tol:.3g}: it sampled with other weights than it was verified with "
                    "(trained on under opd.engine.dlogp_check: warn)",
                )
            )
    summary = engine_summary(rows)
    if summary["indistinguishable"]:
        out.append(
            (
                "engine",
                f"{summary['indistinguishable']} of {summary['syncs']} syncs could not tell the new version from the "
                "previous one (separation <= 2 x tolerance, not every tensor verified exactly): an engine that did "
                "not take them would have passed (opd.engine.indistinguishable: warn)",
            )
        )
    return out
