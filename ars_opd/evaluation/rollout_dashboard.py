"""The report's rollout dashboard: how a rollout-trained stage's samples changed over the run.

What a user reads first when on-policy distillation goes wrong, from the stage's per-step log
(``ars_opd.training.opd`` defines the columns): the share of the rollouts whose answer is correct (where the
data can be checked), their mean length, EOS and truncation rates, the learning rate, the teacher's mean
log-probability of the sampled tokens and the per-token divergence in the first and the second half of each
completion. The run is cut into ``windows`` equal spans of steps and each column averaged over a span's steps
(each step's value is already a mean over the whole world's completions or tokens). Arithmetic and text only.
"""

from __future__ import annotations

import math

import pandas as pd

from ars_opd.evaluation.tables import fmt

# log column -> (table heading, flat metric name); in table order
COLUMNS = {
    "task/correct_rate": ("correct", "correct_rate"),
    "task/response_length": ("length (tokens)", "response_length"),
    "task/eos_rate": ("EOS", "eos_rate"),
    "task/truncation_rate": ("truncated", "truncation_rate"),
    "lr": ("learning rate", "lr"),
    "task/teacher_logprob": ("teacher log p / token", "teacher_logprob"),
    "task/divergence_first_half": ("divergence, 1st half", "divergence_first_half"),
    "task/divergence_second_half": ("divergence, 2nd half", "divergence_second_half"),
}
RATES = ("task/correct_rate", "task/eos_rate", "task/truncation_rate")


def has_rollouts(df: pd.DataFrame) -> bool:
    """Whether the stage's log carries the dashboard (a rollout-trained stage: opd)."""
    return "task/divergence_first_half" in df


def windows_of(steps: int, windows: int) -> list[tuple[int, int]]:
    """``windows`` (or fewer, for a short run) consecutive spans [start, end) of row positions covering ``steps``."""
    n = max(1, min(windows, steps))
    bounds = [round(i * steps / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _cell(col: str, v: float) -> str:
    return fmt(v, pct=col in RATES)


def dashboard_section(stage: str, df: pd.DataFrame, windows: int = 5) -> tuple[list[str], dict]:
    """(markdown lines, flat metrics) of ``stage``'s rollout dashboard; flat: each column's mean over the first
    and the last span (``<stage>/rollouts/<name>_start`` and ``_end``)."""
    cols = [c for c in COLUMNS if c in df]
    spans = windows_of(len(df), windows)
    steps = df["step"].tolist() if "step" in df else list(range(1, len(df) + 1))
    md = [
        f"### {stage}: the rollouts",
        "",
        "Each column averaged over a span of steps: correct (the share of completions whose answer is right, "
        "checked as the evaluation checks it), mean length in tokens (EOS included), the share that ended with "
        "an EOS and the share cut at `max_new_tokens`, the learning rate, the teacher's mean log-probability "
        "of the trained tokens, and the objective's per-token divergence (reverse KL at β = 1) over the first "
        "and the second half of each completion.",
        "",
        "| steps | " + " | ".join(COLUMNS[c][0] for c in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    means = []
    for a, b in spans:
        part = df.iloc[a:b]
        row = {c: float(pd.to_numeric(part[c], errors="coerce").mean()) for c in cols}
        means.append(row)
        md.append(f"| {steps[a]}–{steps[b - 1]} | " + " | ".join(_cell(c, row[c]) for c in cols) + " |")
    if "task/on_policy" in df and float(df["task/on_policy"].mean()) < 1.0:
        share = float(df["task/on_policy"].mean())
        md += [
            "",
            f"Only {share:.0%} of the steps trained on the student's rollouts (GKD's λ); the other steps' "
            "columns describe the teacher's completions.",
        ]
    md.append("")
    flat = {}
    for c in cols:
        name = COLUMNS[c][1]
        flat[f"{stage}/rollouts/{name}_start"] = means[0][c]
        flat[f"{stage}/rollouts/{name}_end"] = means[-1][c]
    return md, {k: v for k, v in flat.items() if math.isfinite(v)}


def engine_section(stage: str, df: pd.DataFrame) -> tuple[list[str], dict]:
    """(markdown lines, flat metrics) on ``stage``'s rollout engine's versions (``ars_opd.rollouts.version_log``);
    nothing for a stage without engine rollouts."""
    from ars_opd.rollouts.version_log import engine_problems, engine_summary, has_engine

    rows = df.to_dict("records")
    if not has_engine(rows):
        return [], {}
    s = engine_summary(rows)
    problems = engine_problems(rows)
    md = [
        f"### {stage}: the rollout engine's versions",
        "",
        f"{s['syncs']} syncs, each checked by the probe (largest difference {fmt(s['probe_max_abs_diff'])} against a "
        f"calibrated tolerance of {fmt(s['tolerance'])}; the derived fp32 bound {fmt(s['bound'])}) and by the "
        f"fingerprint (at least {fmt(s['tensors_verified_min'])} tensors verified exactly at each, at most "
        f"{fmt(s['tensors_probe_only_max'])} left to the probe). Updates moved the probe by {fmt(s['separation_min'])} "
        f"at least (median {fmt(s['separation_median'])}); {s['indistinguishable']} could not be told from the "
        f"previous version. {s['lag0_steps']} lag-0 steps held the engine's log-probabilities of its samples to the "
        f"tolerance: largest mean difference {fmt(s['lag0_dlogp_max'])}, {s['lag0_over_tolerance']} past it.",
        "",
    ]
    if problems:
        md += [f"**{len(problems)} problem(s)**: " + "; ".join(f"{w}: {what}" for w, what in problems[:3]), ""]
    flat = {f"{stage}/engine/{k}": float(v) for k, v in s.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    return md, flat
