"""The replicated seed-scenario study: do the consistency statistics order S1-1 < S1-2 < S1-3?

Input: ``dvc exp show --json`` of a grid of experiments (``-S ddp.scenario=… -S ddp.seed=…``, several
seeds each, K ≥ 3 workers), plus a positive control: runs with a fault injected on one rank
(``-S ddp.inject.kind=shard_skew …``), which show that the statistics move at all when the workers really
differ. For each group (scenario, or the control's fault) and each statistic of the report's metrics it
gives the mean over seeds with a 95% t-interval; across S1-1, S1-2, S1-3 the Jonckheere–Terpstra test of
the paper's ordering (one-sided, permutation p-value); the equivalence bound "S1-3 − S1-1 lies within ±X
with 95% confidence" (Welch interval); the control's difference from S1-1; and the smallest difference the
design could detect (two-sided α = 0.05, power 0.8) given the observed spread.

Pure functions (``mean_ci``, ``jonckheere``, ``welch_diff``, ``student_t_quantile``) do the statistics;
``collect`` reads experiments and ``render`` writes the markdown. Nothing is tuned towards an ordering.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
from typing import Any, Sequence

import numpy as np

from ars_opd.evaluation.solve import solve_increasing
from ars_opd.evaluation.tables import fmt

SCENARIOS = ("S1-1", "S1-2", "S1-3")
STATISTICS = (  # (metric key suffix, label, the paper's direction from S1-1 to S1-3)
    ("loss_dispersion_mean", "loss dispersion", "up"),
    ("grad_norm_dispersion_mean", "grad-norm dispersion", "up"),
    ("grad_direction_consistency_mean", "direction consistency", "down"),
    ("alarms", "detector alarms", None),
)


# -- statistics -----------------------------------------------------------------------------------------


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (Simpson's rule on the density)."""
    if df <= 0:
        raise ValueError(f"df must be > 0, got {df}")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    n = 2000  # even: Simpson weights 1, 4, 2, 4, ..., 4, 1
    x = np.linspace(0.0, abs(t), n + 1)
    w = np.where(np.arange(n + 1) % 2 == 1, 4.0, 2.0)
    w[0] = w[-1] = 1.0
    half = c * float((w * (1 + x**2 / df) ** (-(df + 1) / 2)).sum()) * (abs(t) / n) / 3
    return 0.5 + half if t >= 0 else 0.5 - half


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: float) -> float:
    """The t with ``student_t_cdf(t, df) == p`` (bisection), for 0.5 <= p < 1."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    return solve_increasing(lambda t: student_t_cdf(t, df), p, iterations=60)


def mean_ci(x: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper) of the t-interval; NaN bounds for fewer than two values."""
    a = np.asarray(x, dtype=float)
    m = float(a.mean()) if len(a) else float("nan")
    if len(a) < 2:
        return m, float("nan"), float("nan")
    half = student_t_quantile(0.5 + level / 2, len(a) - 1) * float(a.std(ddof=1)) / math.sqrt(len(a))
    return m, m - half, m + half


def welch_diff(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float, float]:
    """mean(b) − mean(a) with its Welch t-interval: (diff, lower, upper, standard error, degrees of freedom)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    d = float(b.mean() - a.mean())
    if se == 0:
        return d, d, d, 0.0, float("inf")
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = student_t_quantile(0.5 + level / 2, df) * se
    return d, d - half, d + half, se, df


def detectable_difference(se: float, df: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference a two-sided level-``alpha`` t-test finds with probability ``power``."""
    if not math.isfinite(df):
        df = 1e6
    return (student_t_quantile(1 - alpha / 2, df) + student_t_quantile(power, df)) * se


def jonckheere(groups: Sequence[Sequence[float]], permutations: int = 20000, seed: int = 0) -> tuple[float, float]:
    """Jonckheere–Terpstra statistic for the ordered alternative groups[0] < groups[1] < …, and its one-sided
    permutation p-value (the share of label permutations with a statistic at least as large; ties count ½)."""
    sizes = [len(g) for g in groups]
    values = np.concatenate([np.asarray(g, dtype=float) for g in groups])
    bounds = np.cumsum([0] + sizes)

    def statistic(x: np.ndarray) -> np.ndarray:  # x: (P, n)
        total = np.zeros(x.shape[0])
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                a = x[:, bounds[i] : bounds[i + 1]][:, :, None]
                b = x[:, bounds[j] : bounds[j + 1]][:, None, :]
                total += (b > a).sum((1, 2)) + 0.5 * (b == a).sum((1, 2))
        return total

    observed = float(statistic(values[None])[0])
    rng = np.random.default_rng(seed)
    perms = np.stack([rng.permutation(values) for _ in range(permutations)])
    p = (1 + int((statistic(perms) >= observed).sum())) / (permutations + 1)
    return observed, p


# -- experiments ------------------------------------------------------------------------------------------


def walk_experiments(data: Any):
    """Yield (name, params, metrics, is_experiment, rev) for every revision in `dvc exp show --json` output
    (rev: the experiment's commit, a baseline commit, or "workspace")."""
    queue = list(data if isinstance(data, list) else [data])
    while queue:
        exp = queue.pop(0)
        for exp_range in exp.get("experiments") or []:
            for rev in exp_range.get("revs") or []:
                queue.append({**rev, "name": rev.get("name") or exp_range.get("name"), "_experiment": True})
        d = exp.get("data") or {}
        params = ((d.get("params") or {}).get("params.yaml") or {}).get("data") or {}
        metrics: dict = {}
        for m in (d.get("metrics") or {}).values():
            metrics.update(m.get("data") or {})
        yield exp.get("name") or exp.get("rev"), params, metrics, bool(exp.get("_experiment")), exp.get("rev")


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


def exp_show_json(cwd: str = ".") -> Any:
    out = subprocess.run(
        ["dvc", "exp", "show", "--json", "--all-commits"], cwd=cwd, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)
