"""The ``report`` stage: a report readable in a minute — did distillation work, were the workers consistent.

Reads the per-step logs of the training stages (``steps.jsonl``), the evaluation metrics and, when
present, the committed detection benchmark (``reports/detection.jsonl``), and writes ``report.md``
(metric definitions, per-stage summaries, clipping, the gradient noise scale, replica-drift checks and
every alarm of the consistency detector with its rank), PNG figures, per-step CSV series for
``dvc plots`` and a flat metrics JSON for ``dvc exp show``.

The sections come from ``ars_opd.evaluation.equal_budget`` (did distillation work),
``ars_opd.evaluation.rollout_dashboard`` (how a rollout-trained stage's samples changed) and
``ars_opd.evaluation.consistency_report`` (the workers); this module assembles them. ``build_report`` does the
arithmetic and the text; ``write_report`` does the I/O.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ars_opd.artifacts import atomic_outputs, read_jsonl, write_json
from ars_opd.config import TRAINING_STAGES, PathsConfig, ReportConfig
from ars_opd.evaluation.arms import ARMS, MODELS
from ars_opd.evaluation.consistency_report import (
    DEFINITIONS,
    detection_benchmark,
    detector_text,
    run_workers,
    stage_section,
)
from ars_opd.evaluation.detector import Alarm, standardised_residuals
from ars_opd.evaluation.distillation import curve_figure
from ars_opd.evaluation.equal_budget import budget_note, compare, headline, regime_note
from ars_opd.evaluation.rollout_dashboard import dashboard_section, engine_section, has_rollouts, teacher_views
from ars_opd.evaluation.tables import render_table
from ars_opd.training.opd.rollout_health import HealthConfig

SAMPLED_CROSS_TOKENIZER = "sampled_cross_tokenizer"  # the evaluate stage's reverse_kl_kind across two tokenizers


def reverse_kl_note(eval_metrics: dict | None) -> list[str]:
    """A paragraph saying what every reverse KL of the page is when the evaluate stage could not take the exact
    KL over one vocabulary (``reverse_kl_kind``: teacher and student tokenize differently); empty otherwise,
    metrics written before the kind was recorded included (they are exact)."""
    if not eval_metrics or eval_metrics.get("reverse_kl_kind") != SAMPLED_CROSS_TOKENIZER:
        return []
    return [
        "**Reverse KL on this page is the sampled cross-tokenizer estimate**, not the exact KL over one vocabulary: "
        "teacher and student tokenize differently (`opd.cross_tokenizer`), so each model's reverse KL is "
        "(Σ log q over its sampled tokens − Σ log p over the teacher's tokens of the same text) per student token, "
        "on its own samples, over the spans both tokenisations share. Single samples can make it negative, and it "
        "is not comparable with the exact reverse KL of a same-tokenizer run. Teacher NLL is per each model's own "
        "tokens of the teacher's text.",
        "",
    ]


def load_steps(path: Path) -> pd.DataFrame:
    """A stage's per-step log as a DataFrame (one row per step); empty if the file is absent."""
    if not path.exists():
        return pd.DataFrame()
    return pd.DataFrame(read_jsonl(path))


def build_report(
    stage_logs: dict[str, pd.DataFrame],
    eval_metrics: dict | None,
    cfg: ReportConfig,
    benchmark: tuple[list[str], dict] | None = None,
    study: str = "",
) -> tuple[str, dict, dict]:
    """(markdown, flat metrics, alarms per stage) from the loaded logs; ``study``: the seed study's file, whose
    measurement of the regime where OPD is expected to win the verdict quotes."""
    md = ["# ars-opd report", ""]
    flat: dict = {}
    alarms_by_stage: dict[str, list[Alarm]] = {}
    if eval_metrics:
        md += ["## Did distillation work?", "", *reverse_kl_note(eval_metrics)]
        cmp = compare(eval_metrics)
        if cmp is not None:
            md += headline(cmp) + budget_note(eval_metrics) + regime_note(cmp, study)
            md += [
                "![learning curves against steps](figures/learning_curves_steps.png)",
                "",
                "![learning curves against FLOPs](figures/learning_curves_flops.png)",
                "",
            ]
            for where in ("equal_steps", "equal_flops", "equal_total_flops"):
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
    health = HealthConfig.of(cfg)
    dashboards = [
        dashboard_section(stage, df, health) for stage, df in stage_logs.items() if not df.empty and has_rollouts(df)
    ]
    dashboards += [  # several teachers: each teacher's rollouts again, with their own verdict
        dashboard_section(f"{stage}/{teacher}", view, health)
        for stage, df in stage_logs.items()
        if not df.empty and has_rollouts(df)
        for teacher, view in teacher_views(df).items()
    ]
    engines = [engine_section(stage, df) for stage, df in stage_logs.items() if not df.empty]
    dashboards += [part for part in engines if part[0]]  # stages with engine rollouts
    if dashboards:
        md += ["## The rollouts", ""]
        for part, part_flat in dashboards:
            md += part
            flat.update(part_flat)
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
    for ax, name, title in (
        (axes[1, 0], "loss", "loss vs other workers (robust z)"),
        (axes[1, 1], "grad_norm", "gradient norm vs other workers (robust z)"),
        (axes[2, 0], "direction", "cos(g_k, ḡ) vs other workers (robust z)"),
    ):
        z = z_by_stat.get(name)
        if z is not None:
            for k in range(z.shape[1]):
                ax.plot(steps, z[:, k], lw=0.5, alpha=0.7, label=f"rank {k}")
            hits = [a for a in alarms if a.statistic == name]
            if hits:
                ax.scatter(
                    [a.step for a in hits], [0] * len(hits), color="red", marker="v", s=25, zorder=3, label="alarm"
                )
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


def _teacher_rollouts_figure(views: dict[str, pd.DataFrame], stage: str, path: Path) -> None:
    """Each teacher's rollouts over the run (OPD with several teachers): EOS share, mean length, correct share and
    the divergence per token, one line per teacher (``rollout_dashboard.teacher_views``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("task/eos_rate", "share of rollouts that ended (EOS)"),
        ("task/response_length", "mean length (tokens)"),
        ("task/correct_rate", "share answered correctly"),
        ("task/divergence_second_half", "divergence per token, 2nd half"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    for ax, (col, title) in zip(axes.flat, panels):
        for teacher, df in views.items():
            if col in df:
                ax.plot(df["step"], pd.to_numeric(df[col], errors="coerce"), lw=0.9, label=teacher)
        ax.set_title(f"{stage}: {title}")
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


PLOT_COLUMNS = (
    "step",
    "loss",
    "consistency/loss_dispersion",
    "consistency/grad_norm_dispersion",
    "consistency/grad_direction_consistency",
    "grad_norm",
    "gns/b_simple",
)


def write_report(cfg: ReportConfig, paths: PathsConfig) -> dict:
    """Run the stage: read logs, evaluation and benchmark; write report.md, figures, plot series and metrics."""
    logs = {s: load_steps(Path(paths.training(s).steps)) for s in TRAINING_STAGES}
    if all(df.empty for df in logs.values()):
        where = ", ".join(paths.training(s).steps for s in TRAINING_STAGES)
        raise FileNotFoundError(f"no training log found ({where}): run sft/opd first")
    eval_path = Path(paths.eval_metrics)
    eval_metrics = json.loads(eval_path.read_text()) if eval_path.exists() else None
    benchmark = detection_benchmark(Path(paths.detection_benchmark), run_workers(logs))
    study_file = Path(paths.distillation_study)  # a dep of the stage (dvc.yaml)
    study = study_file.read_text() if study_file.is_file() else ""
    md, flat, alarms = build_report(logs, eval_metrics, cfg, benchmark, study)
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
            views = teacher_views(df) if has_rollouts(df) else {}
            if views:  # several teachers: each one's rollouts over the run
                _teacher_rollouts_figure(views, stage, tmp[1] / f"{stage}_rollouts_by_teacher.png")
            cols = [c for c in PLOT_COLUMNS if c in df]
            df[cols].rename(columns=lambda c: c.split("/")[-1]).to_csv(tmp[2] / f"{stage}.csv", index=False)
        write_json(tmp[3], flat)
    return flat
