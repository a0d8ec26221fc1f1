"""The report's rollout dashboard: how a rollout-trained stage's samples changed over the run, step by step.

What a user reads first when on-policy distillation goes wrong, from the stage's per-step log
(``ars_opd.training.opd`` defines the columns): the share of the rollouts whose answer is correct (where the
data can be checked), their mean length, EOS and truncation rates, the student's entropy at its sampled tokens,
the learning rate, the teacher's mean log-probability of the sampled tokens and the per-token divergence in the
first and the second half of each completion. One row per step: a collapse that takes three steps must not be
averaged away (a run of more than ``MAX_ROWS`` steps shows every step of its first ``MAX_ROWS // 2`` and then
every k-th). Above the table, the rollout-health detector's verdict in one line
(``ars_opd.training.opd.rollout_health``). With several teachers (``teachers.named``) every teacher's rollouts get a
dashboard and a verdict of their own (``teacher_views``). Arithmetic and text only.
"""

from __future__ import annotations

import math

import pandas as pd

from ars_opd.evaluation.tables import fmt
from ars_opd.training.opd.rollout_health import HealthConfig, detect, teacher_prefixes

# log column -> (table heading, flat metric name); in table order
COLUMNS = {
    "task/correct_rate": ("correct", "correct_rate"),
    "task/response_length": ("length (tokens)", "response_length"),
    "task/eos_rate": ("EOS", "eos_rate"),
    "task/truncation_rate": ("truncated", "truncation_rate"),
    "task/entropy": ("student entropy", "entropy"),
    "lr": ("learning rate", "lr"),
    "task/teacher_logprob": ("teacher log p / token", "teacher_logprob"),
    "task/divergence_first_half": ("divergence, 1st half", "divergence_first_half"),
    "task/divergence_second_half": ("divergence, 2nd half", "divergence_second_half"),
}
RATES = ("task/correct_rate", "task/eos_rate", "task/truncation_rate")
MAX_ROWS = 80


def has_rollouts(df: pd.DataFrame) -> bool:
    """Whether the stage's log carries the dashboard (a rollout-trained stage: opd)."""
    return "task/divergence_first_half" in df


def shown_rows(steps: int) -> list[int]:
    """The row positions the table shows: all of them up to ``MAX_ROWS``; else the first ``MAX_ROWS // 2`` and then
    every k-th, the last row always."""
    if steps <= MAX_ROWS:
        return list(range(steps))
    head = MAX_ROWS // 2
    k = math.ceil((steps - head) / (MAX_ROWS - head))
    return sorted(set(range(head)) | set(range(head, steps, k)) | {steps - 1})


def _cell(col: str, v: float) -> str:
    return fmt(v, pct=col in RATES)


def health_line(stage: str, df: pd.DataFrame, health: HealthConfig | None = None, batch: int | None = None) -> str:
    """The rollout-health verdict of ``stage``'s log in one line: its first alarm, or that none fired (with the
    tests' smallest p-value: how near one came); "" for a log with no on-policy step to judge."""
    monitor = detect(df.to_dict("records"), health or HealthConfig(), batch)
    if monitor.alarm is not None:
        return "**Rollout health: alarm.** " + monitor.alarm.line(stage) + "."
    if not monitor.smallest:
        return ""
    kind, p = min(monitor.smallest.items(), key=lambda kv: kv[1])
    return (
        f"Rollout health, {stage}: no alarm in {len(monitor.steps)} on-policy steps (no test of the EOS rate, cut "
        f"share or length against the start's reached α = {monitor.cfg.alpha:g}; the nearest: p = {p:.1e}, {kind})."
    )


def dashboard_section(
    stage: str,
    df: pd.DataFrame,
    health: HealthConfig | None = None,
    batch: int | None = None,
    per_seed_eos: list[list[float]] | None = None,
) -> tuple[list[str], dict]:
    """(markdown lines, flat metrics) of ``stage``'s rollout dashboard. Flat: each column at the first step and its
    mean over the last fifth of the steps (``<stage>/rollouts/<name>_start`` and ``_end``), and the health alarm
    (``<stage>/rollouts/alarm`` 1 or 0, ``alarm_step``). ``per_seed_eos``: a pooled log's (the mean over seeds
    per step) EOS rate of each seed at each of its rows, shown beside the mean (``health`` then judges no pooled
    means: the caller judges each seed's own log)."""
    cols = [c for c in COLUMNS if c in df]
    steps = df["step"].tolist() if "step" in df else list(range(len(df)))
    md = [f"### {stage}: the rollouts", ""]
    flat: dict = {}
    if per_seed_eos is None:
        line = health_line(stage, df, health, batch)
        if line:
            md += [line, ""]
            flat[f"{stage}/rollouts/alarm"] = float(line.startswith("**"))
            alarm = detect(df.to_dict("records"), health or HealthConfig(), batch).alarm
            if alarm is not None:
                flat[f"{stage}/rollouts/alarm_step"] = float(alarm.step)
    md += [
        "One row per step: correct (the share of completions whose answer is right, checked as the evaluation "
        "checks it), mean length in tokens (EOS included), the share that ended with an EOS and the share cut at "
        "`max_new_tokens`, the student's entropy at its sampled positions, the learning rate, the teacher's mean "
        "log-probability of the trained tokens, and the objective's per-token divergence (reverse KL at β = 1) "
        "over the first and the second half of each completion."
        + (" The EOS column is the mean over seeds; each seed's own follows it." if per_seed_eos else ""),
        "",
    ]
    heads = [COLUMNS[c][0] for c in cols]
    if per_seed_eos:
        heads.insert(cols.index("task/eos_rate") + 1 if "task/eos_rate" in cols else 0, "EOS, seed by seed")
    md += ["| step | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    rows = shown_rows(len(df))
    if len(rows) < len(df):
        md.insert(-2, f"The run has {len(df)} steps: every step of the first {MAX_ROWS // 2}, then every k-th.\n")
    values = {c: pd.to_numeric(df[c], errors="coerce").tolist() for c in cols}
    for i in rows:
        cells = [_cell(c, values[c][i]) for c in cols]
        if per_seed_eos:
            seeds = " / ".join(fmt(v[i], True) if i < len(v) and math.isfinite(v[i]) else "–" for v in per_seed_eos)
            cells.insert(cols.index("task/eos_rate") + 1 if "task/eos_rate" in cols else 0, seeds)
        md.append(f"| {steps[i]} | " + " | ".join(cells) + " |")
    if "task/on_policy" in df and float(df["task/on_policy"].mean()) < 1.0:
        share = float(df["task/on_policy"].mean())
        md += [
            "",
            f"Only {share:.0%} of the steps trained on the student's rollouts (GKD's λ); the other steps' "
            "columns describe the teacher's completions.",
        ]
    md.append("")
    tail = max(1, len(df) // 5)
    for c in cols:
        name = COLUMNS[c][1]
        first, last = values[c][0], pd.Series(values[c][-tail:]).mean()
        if math.isfinite(first):
            flat[f"{stage}/rollouts/{name}_start"] = first
        if math.isfinite(last):
            flat[f"{stage}/rollouts/{name}_end"] = float(last)
    return md, flat


def teacher_views(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """A log of OPD with several teachers as one log per teacher: its ``task/<teacher>/<column>`` columns under the
    all-teacher names (``task/<column>``), beside the step, the learning rate and the on-policy share, so that the
    dashboard and the health detector read each teacher's rollouts as they read a run's; {} for one teacher."""
    prefixes = teacher_prefixes(df.head(1).to_dict("records"))
    shared = [c for c in ("step", "lr", "task/on_policy") if c in df]
    return {
        teacher: pd.concat(
            [
                df[shared],
                df[[c for c in df if c.startswith(prefix)]].rename(columns=lambda c: "task/" + c[len(prefix) :]),
            ],
            axis=1,
        )
        for teacher, prefix in prefixes.items()
    }


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
