"""The ``report`` stage: a report readable in a minute — did distillation work, were the workers consistent.

Reads the per-step logs of the training stages (``steps.jsonl``), the evaluation metrics and, when
present, the committed detection benchmark (``reports/detection.jsonl``), and writes ``report.md``
(metric definitions, per-stage summaries, clipping, the gradient noise scale, replica-drift checks and
every alarm of the consistency detector with its rank), PNG figures, per-step CSV series for
``dvc plots`` and a flat metrics JSON for ``dvc exp show``.

The detector is ``ars_opd.evaluation.detector``; its false-alarm rate and detection delays are measured by
``bench/detection.py`` on healthy runs and injected faults, and the report quotes them beside the alarms.
``build_report`` does the arithmetic and the text; ``write_report`` does the I/O.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ars_opd.artifacts import atomic_outputs, read_jsonl, write_json
from ars_opd.config import PathsConfig, ReportConfig
from ars_opd.evaluation.detector import (
    Alarm, design_rate, detect, rate_interval, standardised_residuals, threshold_for,
)
from ars_opd.evaluation.distillation import budget_note, compare, curve_figure, headline, regime_note
from ars_opd.evaluation.arms import ARMS, MODELS
from ars_opd.evaluation.tables import fmt, render_table

STAGES = ("sft", "opd", "sft_continued")
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
| direction consistency | mean over pairs i<j of cos(g_i, g_j) (exact for K = 2; for K > 2 exact every `gram_every` steps, else a norm-weighted estimate with a logged error bound) |
| cos to mean | cos(g_k, ḡ) per worker |
| gradient diversity | Σ_k ‖g_k‖² / ‖Σ_k g_k‖² |
| gradient noise scale | B_simple = tr Σ / \\|G\\|² in tokens, from the per-worker norms (McCandlish et al. 2018, App. A.1), numerator and denominator each an EMA over steps |

These follow the model card's words ("std / range of per-worker loss", "std of per-worker gradient L2
norms", "average cosine similarity between worker gradients"); the exact equations of arXiv 2602.14462 were
not recoverable, so these are ours.
"""


def load_steps(path: Path) -> pd.DataFrame:
    """A stage's per-step log as a DataFrame (one row per step); empty if the file is absent."""
    if not path.exists():
        return pd.DataFrame()
    return pd.DataFrame(read_jsonl(path))


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
    """Markdown lines and flat metrics from ``bench/detection.py``'s committed output, for a run of ``workers``.

    The rate quoted is the one measured on the held-out healthy runs of the default pipeline at this K,
    with its exact 95% interval (recomputed from the per-run lines); the fault table is the one at this K.
    """
    if not path.exists():
        return [f"No detection benchmark found ({path}): run `python bench/detection.py > {path}`.", ""], {}
    rows = read_jsonl(path)
    null = [r for r in rows if "null" in r and r["workers"] == workers]
    faults = [r for r in rows if r.get("case") not in (None, "healthy") and r.get("workers") == workers]
    measured = sorted({r["workers"] for r in rows if "null" in r})
    if not null:
        return [f"`bench/detection.py` measured no healthy runs at K = {workers} workers (it did at K = "
                f"{', '.join(map(str, measured)) or 'none'}): this run's false-alarm rate is not known. Run "
                f"`python bench/detection.py --workers {workers} --rows DIR > {path}`.", ""], {}
    judged = sum(r["judged_steps"] for r in null)
    false_alarms = sum(r["false_alarms"] for r in null)
    rate = 1000 * false_alarms / judged if judged else float("nan")
    lo, hi = rate_interval(false_alarms, judged)
    seeds = sorted({r["seed"] for r in null})
    per_stage = {}
    for r in null:
        per_stage.setdefault(r["null"], []).append(r)
    covered = "; ".join(f"{stage} on {len(rs)} seeds ({sum(r['judged_steps'] for r in rs)} judged steps, "
                        f"{sum(r['false_alarms'] for r in rs)} alarms)" for stage, rs in sorted(per_stage.items(),
                                                                                       key=lambda kv: kv[0] != "sft"))
    lines = [f"Measured by `bench/detection.py` at this run's K = {workers} workers on the default pipeline's own "
             f"stages, nothing injected, held-out seeds {seeds[0]}–{seeds[-1]} never used to calibrate ({covered}): "
             f"**{false_alarms} false alarms in {judged} judged healthy steps = {rate:.2f} per 1,000 steps** (exact 95% "
             f"interval {lo:.2f}–{hi:.2f}), against a target of at most 1 per 1,000.", ""]
    attributable = workers > 2
    if faults:
        head = "detected, right rank" if attributable else "detected (rank not attributable)"
        lines += [f"Injected faults at K = {workers} (the built-in student, SFT on reference answers, one rank "
                  "faulty from step 150):", "",
                  f"| fault | magnitude | default | {head} | median delay | max delay |", "|---|---|---|---|---|---|"]
        groups: dict[tuple, list[dict]] = {}
        for r in faults:
            groups.setdefault((r["case"], r["magnitude"]), []).append(r)
        for (case, m), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            hits = sorted(r["delay_steps"] for r in rs
                          if r["detected"] and (not attributable or r["named_rank"] == r["rank"]))
            med = hits[len(hits) // 2] if hits else None
            lines.append(f"| {case} | {m:g} | {'yes' if rs[0]['default'] else ''} | {len(hits)}/{len(rs)} | "
                         f"{'n/a' if med is None else med} | {hits[-1] if hits else 'n/a'} |")
        lines.append("")
    if not attributable:
        lines += ["**With two workers an alarm says that the two workers disagree, not which one is wrong**: each "
                  "worker's residual is the other's negative, so a third worker is needed to say which one departed. "
                  "For attribution run K ≥ 3 workers (`ddp.workers`).", ""]
    return lines, {"detector/false_alarms_per_1000_measured": rate, "detector/false_alarms_per_1000_ci_low": lo,
                   "detector/false_alarms_per_1000_ci_high": hi}


def run_workers(stage_logs: dict[str, pd.DataFrame]) -> int:
    """The run's K: the per-worker columns' width in the first training log that has them (1 if none)."""
    for df in stage_logs.values():
        if not df.empty and "worker_loss" in df:
            return len(df["worker_loss"].iloc[0])
    return 1


def _alarm_lines(alarms: list[Alarm]) -> list[str]:
    if not alarms:
        return []
    lines = ["| step | rank | statistic | direction | CUSUM | estimated onset | averaged loss curve |",
             "|---|---|---|---|---|---|---|"]
    for a in alarms[:50]:
        rank = "0 or 1" if a.rank is None else str(a.rank)
        lines.append(f"| {a.step} | {rank} | {a.statistic} | {a.direction} | {a.value:.3g} | {a.onset} | "
                     f"{'visible' if a.visible else '**silent**'} |")
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
        md += ["Sharded (FSDP2): the worker statistics come from each worker's local gradient before the "
               "reduce-scatter, exact every step; the replica-drift check does not apply (there are no replicas: "
               "every worker computes with the same gathered weights).", ""]
    md += ["| statistic | mean | p95 | max |", "|---|---|---|---|"]
    for col, s in summarise(df).items():
        md.append(f"| {SUMMARY_COLUMNS[col]} | {fmt(s['mean'])} | {fmt(s['p95'])} | {fmt(s['max'])} |")
        flat[f"{stage}/{col.split('/')[-1]}_mean"] = s["mean"]
    md += ["", f"![{stage}](figures/{stage}.png)", ""]

    clipped = int(df["clipped"].sum()) if "clipped" in df else 0
    flat[f"{stage}/clip_fraction"] = clipped / len(df) if len(df) else 0.0
    median_norm = float(df["grad_norm"].median()) if "grad_norm" in df else float("nan")
    md += [f"**Clipping:** {clipped} of {len(df)} steps clipped ({flat[f'{stage}/clip_fraction']:.0%}); the median "
           f"pre-clip gradient norm was {fmt(median_norm)}. "
           + ("Clipping acted on most steps: it worked as part of the optimiser, not as a guard."
              if clipped > len(df) / 2 else "Clipping acted as a guard against rare large steps."), ""]

    b_simple, batch_tokens = noise_scale_summary(df)
    flat[f"{stage}/noise_scale_tokens"] = b_simple
    flat[f"{stage}/global_batch_tokens"] = batch_tokens
    if math.isfinite(b_simple) and b_simple > 0:
        md += [f"**Gradient noise scale:** the critical batch size in tokens is about **{b_simple:,.0f}**; your "
               f"global batch is **{batch_tokens:,.0f}** tokens per step (B_simple at the last step; below the "
               "critical batch size a larger batch still buys nearly proportional progress per step, far above "
               "it mostly wasted compute).", ""]
    elif math.isfinite(b_simple):  # the |G|² estimate is a difference of two noisy terms and came out <= 0
        md += [f"**Gradient noise scale:** not resolved in this stage: the smoothed |G|² estimate is not positive "
               f"(B_simple {b_simple:,.0f}), i.e. at a global batch of **{batch_tokens:,.0f}** tokens per step "
               "the gradient's signal is below what the workers' spread can measure; the critical batch size is "
               "then well above the global batch.", ""]

    checks = [r for r in rows if r.get("drift_mismatch") is not None]
    bad = [r for r in checks if r["drift_mismatch"]]
    flat[f"{stage}/drift_checks"] = len(checks)
    flat[f"{stage}/drift_mismatches"] = len(bad)
    if strategy == "fsdp" and not checks:
        md += ["**Replica drift:** not applicable (sharded: there are no replicas to compare).", ""]
    else:
        md += [f"**Replica drift:** {len(checks)} bit-exact fingerprint checks of every rank's parameters and "
               + ("optimizer state; the replicas were identical at every check." if not bad else
                  f"optimizer state; **{len(bad)} found replicas apart**, first at step {bad[0]['step']} "
                  f"(ranks {bad[0]['drift_mismatch']})."), ""]

    alarms = detect(rows, cfg)
    judged = max(0, len(df) - cfg.warmup)
    silent = sum(1 for a in alarms if not a.visible)
    flat[f"{stage}/alarms"] = len(alarms)
    flat[f"{stage}/alarms_silent"] = silent
    flat[f"{stage}/alarms_per_1000"] = 1000 * len(alarms) / judged if judged else 0.0
    faults = sorted({f for f in df.get("fault", pd.Series(dtype=object)).dropna()})
    if faults:
        md += [f"An injected fault was active in this run: {', '.join(faults)} (see the `fault` column).", ""]
    md += [f"**Alarms:** {len(alarms)} in {judged} judged steps ({silent} silent, {len(alarms) - silent} visible)"
           + ("." if alarms else "; no worker departed from the others."), ""]
    md += _alarm_lines(alarms)
    flat[f"{stage}/final_loss"] = float(df["loss"].iloc[-1])
    return md, flat, alarms


def build_report(stage_logs: dict[str, pd.DataFrame], eval_metrics: dict | None, cfg: ReportConfig,
                 benchmark: tuple[list[str], dict] | None = None) -> tuple[str, dict, dict]:
    """(markdown, flat metrics, alarms per stage) from the loaded logs."""
    md = ["# ars-opd report", ""]
    flat: dict = {}
    alarms_by_stage: dict[str, list[Alarm]] = {}
    if eval_metrics:
        md += ["## Did distillation work?", ""]
        cmp = compare(eval_metrics)
        if cmp is not None:
            md += headline(cmp) + budget_note(eval_metrics) + regime_note(cmp)
            md += ["![learning curves against steps](figures/learning_curves_steps.png)", "",
                   "![learning curves against FLOPs](figures/learning_curves_flops.png)", ""]
            for where in ("equal_steps", "equal_flops"):
                for arm in ARMS:
                    for key, v in (cmp[where].get(arm) or {}).items():
                        if isinstance(v, (int, float)) and math.isfinite(v):
                            flat[f"distill/{where}/{arm}/{key}"] = v
        md += ["Every model on every held-out prompt:", "", render_table(eval_metrics)]
        for model in MODELS:
            m = eval_metrics.get(model) or {}
            for key in ("exact_match", "reverse_kl", "teacher_nll"):
                if m.get(key) is not None:
                    flat[f"eval/{model}/{key}"] = m[key]
    md += ["## Worker consistency", "", DEFINITIONS, "", "### The detector", "", detector_text(cfg), ""]
    if benchmark is not None:
        md += benchmark[0]
        flat.update(benchmark[1])
    for stage, df in stage_logs.items():
        if df.empty:
            continue
        part, stage_flat, alarms = stage_section(stage, df, cfg)
        md += part
        flat.update(stage_flat)
        alarms_by_stage[stage] = alarms
    return "\n".join(md) + "\n", flat, alarms_by_stage


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
        "fingerprinted every `ddp.drift_check_every` steps.")


def _figure(df: pd.DataFrame, alarms: list[Alarm], cfg: ReportConfig, stage: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 10), sharex=True)
    steps = df["step"].to_numpy()
    ax = axes[0, 0]
    if "worker_loss" in df:
        per = np.array(df["worker_loss"].tolist(), dtype=float)
        for k in range(per.shape[1]):
            ax.plot(steps, per[:, k], lw=0.6, alpha=0.6, label=f"worker {k}")
    ax.plot(steps, df["loss"], color="black", lw=1.2, label="global (all tokens)")
    ax.set_yscale("log")
    ax.set_title(f"{stage}: global and per-worker loss")
    ax.legend(fontsize=7)
    z_by_stat = standardised_residuals(df.to_dict("records"), cfg)
    for ax, name, title in ((axes[1, 0], "loss", "loss vs other workers (robust z)"),
                            (axes[1, 1], "grad_norm", "gradient norm vs other workers (robust z)"),
                            (axes[2, 0], "direction", "cos(g_k, ḡ) vs other workers (robust z)")):
        z = z_by_stat.get(name)
        if z is not None:
            for k in range(z.shape[1]):
                ax.plot(steps, z[:, k], lw=0.5, alpha=0.7, label=f"rank {k}")
            hits = [a for a in alarms if a.statistic == name]
            if hits:
                ax.scatter([a.step for a in hits], [0] * len(hits), color="red", marker="v", s=25, zorder=3,
                           label="alarm")
            ax.legend(fontsize=7)
        ax.set_title(title)
    ax = axes[0, 1]
    if "gns/b_simple" in df:
        ax.plot(steps, df["gns/b_simple"], label="critical batch B_simple (tokens)")
        ax.plot(steps, df["tokens"], label="global batch (tokens)", color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    ax.set_title("gradient noise scale")
    ax = axes[2, 1]
    ax.plot(steps, df["grad_norm"], lw=0.8, label="pre-clip norm")
    if "clipped" in df and df["clipped"].any():
        clipped = df[df["clipped"].astype(bool)]
        ax.scatter(clipped["step"], clipped["grad_norm"], s=4, color="orange", label="clipped")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("reduced gradient norm")
    for ax in axes[2]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


PLOT_COLUMNS = ("step", "loss", "consistency/loss_dispersion", "consistency/grad_norm_dispersion",
                "consistency/grad_direction_consistency", "grad_norm", "gns/b_simple")


def write_report(cfg: ReportConfig, paths: PathsConfig) -> dict:
    """Run the stage: read logs, evaluation and benchmark; write report.md, figures, plot series and metrics."""
    logs = {s: load_steps(Path(paths.training(s).steps)) for s in STAGES}
    if all(df.empty for df in logs.values()):
        where = ", ".join(paths.training(s).steps for s in STAGES)
        raise FileNotFoundError(f"no training log found ({where}): run sft/opd first")
    eval_path = Path(paths.eval_metrics)
    eval_metrics = json.loads(eval_path.read_text()) if eval_path.exists() else None
    benchmark = detection_benchmark(Path(paths.detection_benchmark), run_workers(logs))
    md, flat, alarms = build_report(logs, eval_metrics, cfg, benchmark)
    with atomic_outputs(paths.report_md, paths.report_figures, paths.report_plots, paths.report_metrics) as tmp:
        tmp[0].write_text(md)
        tmp[1].mkdir(parents=True)
        tmp[2].mkdir(parents=True)
        if eval_metrics and eval_metrics.get("curves"):
            for x_key in ("steps", "flops"):
                curve_figure([{"evaluate": eval_metrics}], x_key, tmp[1] / f"learning_curves_{x_key}.png")
        for stage, df in logs.items():
            if df.empty:
                continue
            _figure(df, alarms.get(stage, []), cfg, stage, tmp[1] / f"{stage}.png")
            cols = [c for c in PLOT_COLUMNS if c in df]
            df[cols].rename(columns=lambda c: c.split("/")[-1]).to_csv(tmp[2] / f"{stage}.csv", index=False)
        write_json(tmp[3], flat)
    return flat
