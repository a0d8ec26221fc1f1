"""The replicated seed-scenario study: do the consistency statistics order S1-1 < S1-2 < S1-3?

Input: ``dvc exp show --json`` of a grid of experiments (``-S ddp.scenario=… -S ddp.seed=…``, several
seeds each, K ≥ 3 workers), plus a positive control: runs with a fault injected on one rank
(``-S ddp.inject.kind=shard_skew …``), which show that the statistics move at all when the workers really
differ. For each group (scenario, or the control's fault) and each statistic of the report's metrics it
gives the mean over seeds with a 95% t-interval; across S1-1, S1-2, S1-3 the Jonckheere–Terpstra test of
the paper's ordering (one-sided, permutation p-value); the equivalence bound "S1-3 − S1-1 lies within ±X
with 95% confidence" (Welch interval); the control's difference from S1-1; and the smallest difference the
design could detect (two-sided α = 0.05, power 0.8) given the observed spread.

The statistics are ``ars_opd.evaluation.stats``'s pure functions (``mean_ci``, ``jonckheere``, ``welch_diff``,
``detectable_difference``); ``collect`` reads experiments (``ars_opd.evaluation.experiments``) and ``render``
writes the markdown. Nothing is tuned towards an ordering.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ars_opd.evaluation.experiments import exp_show_json, walk_experiments
from ars_opd.evaluation.stats import detectable_difference, jonckheere, mean_ci, welch_diff
from ars_opd.evaluation.tables import fmt

__all__ = ["collect", "exp_show_json", "render"]

SCENARIOS = ("S1-1", "S1-2", "S1-3")
STATISTICS = (  # (metric key suffix, label, the paper's direction from S1-1 to S1-3)
    ("loss_dispersion_mean", "loss dispersion", "up"),
    ("grad_norm_dispersion_mean", "grad-norm dispersion", "up"),
    ("grad_direction_consistency_mean", "direction consistency", "down"),
    ("alarms", "detector alarms", None),
)


def collect(data: Any) -> dict[str, list[dict]]:
    """group -> runs: scenario runs without a fault under their scenario, faulty runs under their fault kind.

    Only experiments (not the baseline revision) with report metrics count, one per (group, seed)."""
    groups: dict[str, dict[int, dict]] = {}
    for name, params, metrics, is_experiment, _ in walk_experiments(data):
        ddp = params.get("ddp") or {}
        if not is_experiment or not any(k.endswith("_mean") for k in metrics):
            continue
        fault = (ddp.get("inject") or {}).get("kind")
        group = fault or ddp.get("scenario")
        if group is None:
            continue
        groups.setdefault(group, {}).setdefault(
            int(ddp.get("seed", 0)),
            {"name": name, "seed": int(ddp.get("seed", 0)), "workers": ddp.get("workers"), "metrics": metrics},
        )
    return {g: [runs[s] for s in sorted(runs)] for g, runs in groups.items()}


def _values(runs: list[dict], key: str) -> list[float]:
    return [float(r["metrics"][key]) for r in runs if isinstance(r["metrics"].get(key), (int, float))]


def render(found: dict[str, list[dict]], commands: str, notes: str = "") -> str:
    lines = [
        "# Seed scenarios: do dispersion rise and direction consistency fall from S1-1 to S1-3?",
        "",
        "Made from a real sweep of DVC experiments with these commands:",
        "",
        "```",
        commands.strip(),
        "```",
        "",
    ]
    controls = sorted(g for g in found if g not in SCENARIOS)
    workers = sorted({r["workers"] for runs in found.values() for r in runs if r.get("workers")})
    lines += [
        "Runs per group: "
        + ", ".join(f"{g} {len(found[g])}" for g in (*SCENARIOS, *controls) if g in found)
        + f"; workers: {workers}. Each cell: mean over seeds [95% t-interval].",
        "",
    ]
    for stage in ("sft", "opd"):
        lines += [
            f"## {stage}",
            "",
            "| group | " + " | ".join(label for _, label, _ in STATISTICS) + " |",
            "|---|" + "---|" * len(STATISTICS),
        ]
        for g in (*SCENARIOS, *controls):
            if g not in found:
                continue
            cells = []
            for key, _, _ in STATISTICS:
                m, lo, hi = mean_ci(_values(found[g], f"{stage}/{key}"))
                cells.append(f"{fmt(m)} [{fmt(lo)}, {fmt(hi)}]")
            label = g if g in SCENARIOS else f"positive control: {g} on one rank"
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
        for key, label, direction in STATISTICS:
            if direction is None or not all(s in found for s in SCENARIOS):
                continue
            groups = [_values(found[s], f"{stage}/{key}") for s in SCENARIOS]
            if min(len(v) for v in groups) < 2:
                continue
            signed = [[x if direction == "up" else -x for x in v] for v in groups]
            _, p = jonckheere(signed)
            d, lo, hi, se, df = welch_diff(groups[0], groups[2])
            bound = max(abs(lo), abs(hi))
            base = abs(float(np.mean(groups[0]))) or float("nan")
            order = "S1-1 < S1-2 < S1-3" if direction == "up" else "S1-1 > S1-2 > S1-3"
            lines.append(
                f"- **{label}**: ordering {order}: Jonckheere–Terpstra one-sided p = {p:.3g}. "
                f"S1-3 − S1-1 = {fmt(d)} [{fmt(lo)}, {fmt(hi)}]: within **±{fmt(bound)}** "
                f"({bound / base:.1%} of S1-1's mean) with 95% confidence. Smallest difference this design "
                f"detects with power 0.8: {fmt(detectable_difference(se, df))}."
            )
            for c in controls:
                cv = _values(found[c], f"{stage}/{key}")
                if len(cv) >= 2:
                    cd, clo, chi, _, _ = welch_diff(groups[0], cv)
                    lines.append(
                        f"  - positive control {c} − S1-1 = {fmt(cd)} [{fmt(clo)}, {fmt(chi)}]"
                        + (" (moved)" if clo > 0 or chi < 0 else " (not distinguishable)")
                        + "."
                    )
        lines.append("")
    if notes.strip():
        lines += [notes.strip(), ""]
    return "\n".join(lines) + "\n"
