"""The report's worker-consistency part: metric definitions, per-stage summaries and the detector's alarms.

``stage_section`` writes one training stage's part (its statistics, clipping, the gradient noise scale, the
replica-drift checks and every alarm of the consistency detector with its rank) with its flat metrics;
``detector_text`` states the method and ``detection_benchmark`` the measured false-alarm rate beside it.

The detector is ``ars_opd.evaluation.detector``; its false-alarm rate and detection delays are measured by
``studies/detection.py`` on healthy runs and injected faults, and the report quotes them beside the alarms.
Arithmetic and text only, no files written: ``ars_opd.evaluation.report`` assembles the report and does the I/O.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ars_opd.artifacts import read_jsonl
from ars_opd.config import ReportConfig
from ars_opd.evaluation.detector import Alarm, design_rate, detect, rate_interval, threshold_for
from ars_opd.evaluation.tables import fmt

SUMMARY_COLUMNS = {
    "loss": "global loss",
    "consistency/loss_dispersion": "loss dispersion (std)",
    "consistency/loss_range": "loss range",
    "consistency/grad_norm_dispersion": "grad-norm dispersion (std)",
    "consistency/grad_direction_consistency": "direction consistency (mean pairwise cos)",
    "consistency/gradient_diversity": "gradient diversity",
    "grad_norm": "grad norm of the reduced gradient (pre-clip)",
}

DEFINITIONS = """\
Step t, K workers. L_k: worker k's token-mean loss on its share of the step. g_k: worker k's local
gradient, summed over its accumulation micro-batches, taken before the all-reduce, in the scale of the
reduced gradient ḡ = mean_k g_k (each worker's loss is scaled by K / N_global tokens).

| statistic | definition |
|---|---|
| loss dispersion | population std over k of L_k; loss range: max_k L_k − min_k L_k |
| gradient-norm dispersion | population std over k of ‖g_k‖₂ |
| direction consistency | mean over pairs i<j of cos(g_i, g_j) (exact for K = 2; for K > 2 exact every \
`gram_every` steps, else a norm-weighted estimate with a logged error bound) |
| cos to mean | cos(g_k, ḡ) per worker |
| gradient diversity | Σ_k ‖g_k‖² / ‖Σ_k g_k‖² |
| gradient noise scale | B_simple = tr Σ / \\|G\\|² in tokens, from the per-worker norms (McCandlish et al. 2018, \
App. A.1), numerator and denominator each an EMA over steps |

These follow the model card's words ("std / range of per-worker loss", "std of per-worker gradient L2
norms", "average cosine similarity between worker gradients"); the exact equations of arXiv 2602.14462 were
not recoverable, so these are ours.
"""


def summarise(df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """mean, p95 and max of each summary column present."""
    out = {}
    for col in SUMMARY_COLUMNS:
        if col in df and df[col].notna().any():
            x = df[col].astype(float).dropna()
            out[col] = {"mean": float(x.mean()), "p95": float(x.quantile(0.95)), "max": float(x.max())}
    return out


def noise_scale_summary(df: pd.DataFrame) -> tuple[float, float]:
    """(B_simple at the last step, the mean global batch in loss tokens): NaN when not logged."""
    b = df["gns/b_simple"].astype(float).dropna() if "gns/b_simple" in df else pd.Series(dtype=float)
    tokens = float(df["tokens"].mean()) if "tokens" in df else float("nan")
    return (float(b.iloc[-1]) if len(b) else float("nan")), tokens


def detection_benchmark(path: Path, workers: int) -> tuple[list[str], dict]:
    """Markdown lines and flat metrics from ``studies/detection.py``'s committed output, for a run of ``workers``.

    The rate quoted is the one measured on the held-out healthy runs of the default pipeline at this K,
    with its exact 95% interval (recomputed from the per-run lines); the fault table is the one at this K.
    """
    if not path.exists():
        return [f"No detection benchmark found ({path}): run `python studies/detection.py > {path}`.", ""], {}
    rows = read_jsonl(path)
    null = [r for r in rows if "null" in r and r["workers"] == workers]
    faults = [r for r in rows if r.get("case") not in (None, "healthy") and r.get("workers") == workers]
    measured = sorted({r["workers"] for r in rows if "null" in r})
    if not null:
        return [
            f"`studies/detection.py` measured no healthy runs at K = {workers} workers (it did at K = "
            f"{', '.join(map(str, measured)) or 'none'}): this run's false-alarm rate is not known. Run "
            f"`python studies/detection.py --workers {workers} --rows DIR > {path}`.",
            "",
        ], {}
    judged = sum(r["judged_steps"] for r in null)
    false_alarms = sum(r["false_alarms"] for r in null)
    rate = 1000 * false_alarms / judged if judged else float("nan")
    lo, hi = rate_interval(false_alarms, judged)
    seeds = sorted({r["seed"] for r in null})
    per_stage = {}
    for r in null:
        per_stage.setdefault(r["null"], []).append(r)
    covered = "; ".join(
        f"{stage} on {len(rs)} seeds ({sum(r['judged_steps'] for r in rs)} judged steps, "
        f"{sum(r['false_alarms'] for r in rs)} alarms)"
        for stage, rs in sorted(per_stage.items(), key=lambda kv: kv[0] != "sft")
    )
    lines = [
        f"Measured by `studies/detection.py` at this run's K = {workers} workers on the default pipeline's own "
        f"stages, nothing injected, held-out seeds {seeds[0]}–{seeds[-1]} never used to calibrate ({covered}): "
        f"**{false_alarms} false alarms in {judged} judged healthy steps = {rate:.2f} per 1,000 steps** (exact "
        f"95% interval {lo:.2f}–{hi:.2f}), against a target of at most 1 per 1,000.",
        "",
    ]
    attributable = workers > 2
    if faults:
        head = "detected, right rank" if attributable else "detected (rank not attributable)"
        lines += [
            f"Injected faults at K = {workers} (the built-in student, SFT on reference answers, one rank "
            "faulty from step 150):",
            "",
            f"| fault | magnitude | default | {head} | median delay | max delay |",
            "|---|---|---|---|---|---|",
        ]
        groups: dict[tuple, list[dict]] = {}
        for r in faults:
            groups.setdefault((r["case"], r["magnitude"]), []).append(r)
        for (case, m), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            hits = sorted(
                r["delay_steps"] for r in rs if r["detected"] and (not attributable or r["named_rank"] == r["rank"])
            )
            med = hits[len(hits) // 2] if hits else None
            lines.append(
                f"| {case} | {m:g} | {'yes' if rs[0]['default'] else ''} | {len(hits)}/{len(rs)} | "
                f"{'n/a' if med is None else med} | {hits[-1] if hits else 'n/a'} |"
            )
        lines.append("")
    if not attributable:
        lines += [
            "**With two workers an alarm says that the two workers disagree, not which one is wrong**: each "
            "worker's residual is the other's negative, so a third worker is needed to say which one departed. "
            "For attribution run K ≥ 3 workers (`ddp.workers`).",
            "",
        ]
    return lines, {
        "detector/false_alarms_per_1000_measured": rate,
        "detector/false_alarms_per_1000_ci_low": lo,
        "detector/false_alarms_per_1000_ci_high": hi,
    }


def run_workers(stage_logs: dict[str, pd.DataFrame]) -> int:
    """The run's K: the per-worker columns' width in the first training log that has them (1 if none)."""
    for df in stage_logs.values():
        if not df.empty and "worker_loss" in df:
            return len(df["worker_loss"].iloc[0])
    return 1


def _alarm_lines(alarms: list[Alarm]) -> list[str]:
    if not alarms:
        return []
    lines = [
        "| step | rank | statistic | direction | CUSUM | estimated onset | averaged loss curve |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in alarms[:50]:
        rank = "0 or 1" if a.rank is None else str(a.rank)
        lines.append(
            f"| {a.step} | {rank} | {a.statistic} | {a.direction} | {a.value:.3g} | {a.onset} | "
            f"{'visible' if a.visible else '**silent**'} |"
        )
    if len(alarms) > 50:
        lines.append(f"| … | {len(alarms) - 50} more | | | | | |")
    return lines + [""]


def stage_section(stage: str, df: pd.DataFrame, cfg: ReportConfig) -> tuple[list[str], dict, list[Alarm]]:
    """One training stage's part of the report, its flat metrics and its alarms."""
    rows = df.to_dict("records")
    workers = run_workers({stage: df})
    scenario = df["scenario"].iloc[0] if "scenario" in df else "n/a"
    flat: dict = {}
    strategy = df["strategy"].iloc[0] if "strategy" in df else "ddp"
    md = [f"### {stage}: {len(df)} steps, {workers} workers ({strategy}), scenario {scenario}", ""]
    if strategy == "fsdp":
        md += [
            "Sharded (FSDP2): the worker statistics come from each worker's local gradient before the "
            "reduce-scatter, exact every step; the replica-drift check does not apply (there are no replicas: "
            "every worker computes with the same gathered weights).",
            "",
        ]
    md += ["| statistic | mean | p95 | max |", "|---|---|---|---|"]
    for col, s in summarise(df).items():
        md.append(f"| {SUMMARY_COLUMNS[col]} | {fmt(s['mean'])} | {fmt(s['p95'])} | {fmt(s['max'])} |")
        flat[f"{stage}/{col.split('/')[-1]}_mean"] = s["mean"]
    md += ["", f"![{stage}](figures/{stage}.png)", ""]

    clipped = int(df["clipped"].sum()) if "clipped" in df else 0
    flat[f"{stage}/clip_fraction"] = clipped / len(df) if len(df) else 0.0
    median_norm = float(df["grad_norm"].median()) if "grad_norm" in df else float("nan")
    md += [
        f"**Clipping:** {clipped} of {len(df)} steps clipped ({flat[f'{stage}/clip_fraction']:.0%}); the median "
        f"pre-clip gradient norm was {fmt(median_norm)}. "
        + (
            "Clipping acted on most steps: it worked as part of the optimiser, not as a guard."
            if clipped > len(df) / 2
            else "Clipping acted as a guard against rare large steps."
        ),
        "",
    ]

    b_simple, batch_tokens = noise_scale_summary(df)
    # not measured (one worker, or no step with an estimate): null, not NaN, in metrics.json (ars-opd check reads it)
    flat[f"{stage}/noise_scale_tokens"] = b_simple if math.isfinite(b_simple) else None
    flat[f"{stage}/global_batch_tokens"] = batch_tokens
    if math.isfinite(b_simple) and b_simple > 0:
        md += [
            f"**Gradient noise scale:** the critical batch size in tokens is about **{b_simple:,.0f}**; your "
            f"global batch is **{batch_tokens:,.0f}** tokens per step (B_simple at the last step; below the "
            "critical batch size a larger batch still buys nearly proportional progress per step, far above "
            "it mostly wasted compute).",
            "",
        ]
    elif math.isfinite(b_simple):  # the |G|² estimate is a difference of two noisy terms and came out <= 0
        md += [
            f"**Gradient noise scale:** not resolved in this stage: the smoothed |G|² estimate is not positive "
            f"(B_simple {b_simple:,.0f}), i.e. at a global batch of **{batch_tokens:,.0f}** tokens per step "
            "the gradient's signal is below what the workers' spread can measure; the critical batch size is "
            "then well above the global batch.",
            "",
        ]

    checks = [r for r in rows if r.get("drift_mismatch") is not None]
    bad = [r for r in checks if r["drift_mismatch"]]
    flat[f"{stage}/drift_checks"] = len(checks)
    flat[f"{stage}/drift_mismatches"] = len(bad)
    if strategy == "fsdp" and not checks:
        md += ["**Replica drift:** not applicable (sharded: there are no replicas to compare).", ""]
    else:
        md += [
            f"**Replica drift:** {len(checks)} bit-exact fingerprint checks of every rank's parameters and "
            + (
                "optimizer state; the replicas were identical at every check."
                if not bad
                else f"optimizer state; **{len(bad)} found replicas apart**, first at step {bad[0]['step']} "
                f"(ranks {bad[0]['drift_mismatch']})."
            ),
            "",
        ]

    alarms = detect(rows, cfg)
    judged = max(0, len(df) - cfg.warmup)
    silent = sum(1 for a in alarms if not a.visible)
    flat[f"{stage}/alarms"] = len(alarms)
    flat[f"{stage}/alarms_silent"] = silent
    flat[f"{stage}/alarms_per_1000"] = 1000 * len(alarms) / judged if judged else 0.0
    faults = sorted({f for f in df.get("fault", pd.Series(dtype=object)).dropna()})
    if faults:
        md += [f"An injected fault was active in this run: {', '.join(faults)} (see the `fault` column).", ""]
    md += [
        f"**Alarms:** {len(alarms)} in {judged} judged steps ({silent} silent, {len(alarms) - silent} visible)"
        + ("." if alarms else "; no worker departed from the others."),
        "",
    ]
    md += _alarm_lines(alarms)
    flat[f"{stage}/final_loss"] = float(df["loss"].iloc[-1])
    return md, flat, alarms


def detector_text(cfg: ReportConfig) -> str:
    return (
        "Each worker's loss, gradient norm and cos(g_k, ḡ) is compared with the median of the other workers at "
        "the same step (log ratios for loss and norm, a difference for the cosine), standardised against the "
        f"median and MAD of the same statistic over the previous {cfg.window} steps (ending {cfg.lag} steps "
        f"back, all ranks pooled), clipped at ±{cfg.clip_z}, and watched by a two-sided CUSUM per rank and "
        f"statistic (reference k = {cfg.k}). The alarm threshold h is set from a design rate, every test "
        "combined, were the scores independent: training runs alarm more often than independent scores would, "
        "so the design rate is calibrated per worker count on healthy runs of the default pipeline "
        f"(**{design_rate(cfg, 4):g} per 1,000 steps** at K ≥ 3, h = {threshold_for(cfg, 4):.2f} for 4 workers; "
        f"**{design_rate(cfg, 2):g}** at K = 2, h = {threshold_for(cfg, 2):.2f}, where each rank's residual is "
        "the other's negative and an alarm cannot name the faulty one), and the rate that counts is the one "
        "measured on held-out healthy runs below, against a target of at most 1 per 1,000 steps. "
        f"The first {cfg.warmup} steps of a stage are not judged. An alarm is **silent** when the same test on "
        "the averaged loss curve stayed quiet between the alarm's estimated onset and the alarm, else visible. "
        "Replica drift is checked apart, bit-exactly: every rank's parameters and optimizer state are "
        "fingerprinted every `ddp.drift_check_every` steps."
    )
