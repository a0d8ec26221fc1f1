"""A run's summary in Markdown, written from its own outputs: ``ars-opd summary``.

``make repro-real`` ends by writing ``reports/real_model.md`` with it. Every figure comes from a file a stage
wrote in this workspace (the models manifest, the subset and teacher_gen metrics, each training stage's DVCLive
summary, the evaluate stage's metrics and table, ``paths.stage_runs``); nothing is typed in by hand, so
rerunning the pipeline and then the summary brings the page up to date. A stage whose output is missing is
named as missing rather than left out silently.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from ars_opd.config import TRAINING_STAGES, PathsConfig
from ars_opd.evaluation.tables import render_table
from ars_opd.resources import latest_runs

PIPELINE = ("models", "subset", "teacher_gen", *TRAINING_STAGES, "evaluate", "report")
MODEL_ROWS = {
    "base": "base: the student before training",
    "sft": "sft: base + SFT on the teacher's completions",
    "opd": "opd: sft + on-policy distillation",
    "sft_continued": "sft_continued: sft + as many more SFT steps (OPD's control)",
    "teacher": "teacher",
}


def _json(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _commit(paths: PathsConfig) -> str:
    """HEAD, and whether code differs from it: params.yaml, dvc.lock and data/ are what a DVC experiment applied
    to the workspace changes by design, so they do not count."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()
        changed = [line[3:] for line in status if line[3:] not in ("params.yaml", "dvc.lock")]
        outputs = {Path(paths.models_dir).parts[0], Path(paths.report_md).parts[0]}  # the stages' output trees
        changed = [f for f in changed if Path(f).parts[0] not in outputs]
        return out.stdout.strip() + (f" (with uncommitted changes to {', '.join(changed[:5])})" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _models_section(paths: PathsConfig) -> list[str]:
    manifest = _json(Path(paths.models_dir) / "manifest.json")
    if manifest is None:
        return [f"*The models stage's manifest ({paths.models_dir}/manifest.json) is missing.*"]
    t, s = manifest.get("teacher", {}), manifest.get("student", {})
    lines = ["| role | source | parameters | layers | pinned as |", "|---|---|---|---|---|"]
    t_source = Path(t["gguf_file"]).name if t.get("gguf_file") else t.get("name", "?")
    t_layers = s.get("teacher_layers", "")
    lines.append(
        f"| teacher | {t.get('source', '?')}: `{t_source}` | {t.get('parameters', 0) / 1e6:.1f}M | {t_layers} "
        f"| sha256 {str(t.get('revision', '?'))[:12]} |"
    )
    if s.get("source") == "pruned":
        kept, rule = s.get("kept_layers", []), s.get("keep_layers")
        s_source = "pruned from the teacher, layers " + (
            f"{kept}" if isinstance(rule, list) else f"{kept} (`keep_layers: {rule}`)"
        )
        s_layers = len(kept)
    else:
        s_source, s_layers = f"{s.get('source', '?')}: `{s.get('name', '?')}`", ""
    lines.append(
        f"| student | {s_source} | {s.get('parameters', 0) / 1e6:.1f}M | {s_layers} "
        f"| files sha256 {str(s.get('files_sha256', '?'))[:12]} |"
    )
    return lines


def _data_section(paths: PathsConfig) -> list[str]:
    subset, teacher = _json(paths.subset_metrics), _json(paths.teacher_metrics)
    lines = []
    if subset is None:
        lines.append(f"*The subset stage's metrics ({paths.subset_metrics}) are missing.*")
    else:
        lines.append(
            f"- subset: {subset.get('train')} training and {subset.get('eval')} held-out prompts "
            f"({subset.get('duplicates_dropped', 0)} duplicates and {subset.get('malformed', 0)} malformed rows "
            "dropped)"
        )
    if teacher is None:
        lines.append(f"*The teacher_gen stage's metrics ({paths.teacher_metrics}) are missing.*")
    else:
        asked = teacher.get("asked") or 0
        lines.append(
            f"- teacher_gen: {teacher.get('prompts')} prompts, {teacher.get('failed')} failed, "
            f"{teacher.get('retries')} retries; {asked} asked in this run ({teacher.get('cached_before_run')} "
            f"answered from the cache) in {teacher.get('seconds')} s; "
            f"{teacher.get('length_finish_fraction', 0):.0%} of answers cut at max_tokens"
        )
    return lines


def _training_section(paths: PathsConfig) -> list[str]:
    lines = [
        "| stage | steps | final loss (mean of last 10) | tokens trained | train seconds | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for stage in TRAINING_STAGES:
        m = _json(Path(getattr(paths, f"{stage}_live")) / "metrics.json")
        if m is None:
            lines.append(f"| {stage} | missing | | | | |")
            continue
        lines.append(
            f"| {stage} | {m.get('steps')} | {m.get('final_loss_mean10', float('nan')):.4f} | {m.get('tokens')} "
            f"| {m.get('train_seconds', 0):.0f} | {m.get('tokens_per_s', 0):.0f} |"
        )
    return lines


def rollout_health_lines(paths: PathsConfig, health=None) -> list[str]:
    """Each rollout-trained stage's rollout-health verdict in one line (``ars_opd.training.opd.rollout_health``)."""
    from ars_opd.artifacts import read_jsonl
    from ars_opd.training.opd.rollout_health import HealthConfig, detect

    lines = []
    for stage in TRAINING_STAGES:
        steps = Path(paths.training(stage).steps)
        if not steps.is_file():
            continue
        monitor = detect(read_jsonl(steps), health or HealthConfig())
        if monitor.alarm is not None:
            lines.append(f"- **Rollout health: alarm.** {monitor.alarm.line(stage)}.")
        elif monitor.steps:
            lines.append(
                f"- Rollout health: {stage}'s rollouts stayed with the start's over {len(monitor.steps)} on-policy "
                f"steps (EOS rate, cut share, length; α = {monitor.cfg.alpha:g})."
            )
    return lines


def _consistency_section(paths: PathsConfig) -> list[str]:
    m = _json(paths.report_metrics)
    if m is None:
        return [f"*The report stage's metrics ({paths.report_metrics}) are missing.*"]
    lines = ["| stage | alarms | of them silent | alarms per 1,000 judged steps |", "|---|---|---|---|"]
    for stage in TRAINING_STAGES:
        if f"{stage}/alarms" in m:
            lines.append(
                f"| {stage} | {m[f'{stage}/alarms']} | {m.get(f'{stage}/alarms_silent')} "
                f"| {m.get(f'{stage}/alarms_per_1000', float('nan')):.2f} |"
            )
    rate = m.get("detector/false_alarms_per_1000_measured")
    if rate is not None:
        lo, hi = m.get("detector/false_alarms_per_1000_ci_low"), m.get("detector/false_alarms_per_1000_ci_high")
        lines += [
            "",
            f"The detector's false-alarm rate measured on healthy runs at this worker count: {rate:.2f} per 1,000 "
            f"steps (95% interval {lo:.2f}-{hi:.2f}); details in `{paths.report_md}`.",
        ]
    return lines


def _costs_section(paths: PathsConfig) -> list[str]:
    runs = latest_runs(paths.stage_runs)
    lines = [
        "| stage | wall time | peak memory (RSS of the stage's process tree) | finished (UTC) |",
        "|---|---|---|---|",
    ]
    total = 0.0
    for stage in PIPELINE:
        r = runs.get(stage)
        if r is None:
            lines.append(f"| {stage} | not recorded | | |")
            continue
        total += r["wall_s"]
        done = datetime.fromtimestamp(r["started"] + r["wall_s"], timezone.utc).strftime("%Y-%m-%d %H:%M")
        lines.append(f"| {stage} | {r['wall_s'] / 60:.1f} min | {r['peak_rss_mb'] / 1024:.2f} GiB | {done} |")
    lines.append(f"| all stages | {total / 60:.1f} min | | |")
    return lines


def render_summary(paths: PathsConfig, command: str, title: str, health=None) -> str:
    """The Markdown page (see the module docstring); ``health``: the rollout-health detector's settings."""
    evaluation = _json(paths.eval_metrics)
    parts = [
        f"# {title}",
        "",
        f"Made by `{command}` at commit {_commit(paths)}, on {os.cpu_count()} CPU cores. Every figure below is read "
        "from this run's own outputs by `ars-opd summary`; rerun both to refresh it.",
        "",
        *rollout_health_lines(paths, health),
        "",
        "## Models",
        "",
        *_models_section(paths),
        "",
        "## Data",
        "",
        *_data_section(paths),
        "",
        "## Held-out evaluation",
        "",
    ]
    if evaluation is None:
        parts.append(f"*The evaluate stage's metrics ({paths.eval_metrics}) are missing.*")
    else:
        from ars_opd.evaluation.report import reverse_kl_note  # pandas: only for a page with an evaluation

        parts += [
            "Rows: " + "; ".join(f"{k}" for k in MODEL_ROWS.values()) + ".",
            "",
            *reverse_kl_note(evaluation),
            render_table(evaluation).rstrip("\n"),
        ]
    parts += [
        "",
        "## Training",
        "",
        *_training_section(paths),
        "",
        "## Worker consistency (the report stage's detector)",
        "",
        *_consistency_section(paths),
        "",
        "## What each stage cost",
        "",
        "The latest successful run of each stage in `" + str(paths.stage_runs) + "` (a stage DVC found up to date "
        "keeps the time of the run that made its outputs).",
        "",
        *_costs_section(paths),
        "",
    ]
    return "\n".join(parts)


def write_summary(paths: PathsConfig, out: str | Path, command: str, title: str, health=None) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render_summary(paths, command, title, health), encoding="utf-8")
    tmp.replace(out)
    return out
