"""Did distillation work across training seeds? A ``dvc exp run`` sweep of ``ddp.seed``, aggregated.

``collect``/``with_curves`` read the sweep's experiments (the learning curves from their commits);
``render_study`` turns them into means, 95% t-intervals of each arm and of the paired per-seed difference
OPD − control, a positive control and the verdict; ``curve_figure`` draws the learning curves (mean over seeds,
min-max band; the report draws its one run with it). Each run is compared by
``ars_opd.evaluation.equal_budget.compare``: the sweep adds seeds and intervals, never its own definition of
equal steps or equal FLOPs.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ars_opd.config import PathsConfig
from ars_opd.evaluation.arms import ARMS
from ars_opd.evaluation.equal_budget import (
    LABELS,
    METRICS,
    REGIME_LEAD,
    budget_note,
    compare,
    interpolate,
    regime_paragraph,
)
from ars_opd.evaluation.experiments import walk_experiments
from ars_opd.evaluation.first_error import first_error_figure, has_steps, step_table
from ars_opd.evaluation.stats import mean_ci, one_difference
from ars_opd.evaluation.tables import fmt


def _without_seed(params: dict) -> str:
    """The run's params minus ``ddp.seed``: two runs with equal keys are seeds of one experiment."""
    ddp = {k: v for k, v in (params.get("ddp") or {}).items() if k != "seed"}
    return json.dumps({**params, "ddp": ddp}, sort_keys=True, default=str)


def param(params: dict, dotted: str, default: Any = None) -> Any:
    """A params.yaml value by its dotted key (``opd.steps``); ``default`` when absent (pass a sentinel to tell an
    absent key from an explicit null)."""
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def collect(data: Any, where: dict[str, str] | None = None) -> list[dict]:
    """One entry per training seed: {"name", "seed", "evaluate"} from ``dvc exp show --json`` experiments
    (and the baseline revision when no experiment has its seed) whose evaluation has both arms. Only runs
    that differ in ``ddp.seed`` alone are seeds of one study: when experiments exist, the configuration most
    of them share decides, so a baseline run with other steps or workers is not mixed in."""
    found = []
    for name, params, metrics, is_experiment, rev in walk_experiments(data):
        if any(str(param(params, k)) != v for k, v in (where or {}).items()):
            continue  # ``where``: only runs whose params have these values (as text: opd.steps=1000)
        ddp = params.get("ddp") or {}
        if (ddp.get("inject") or {}).get("kind") or ddp.get("scenario", "S1-1") != "S1-1":
            continue  # a fault or another seed scenario is another experiment, not another seed of this one
        if all(a in metrics for a in ARMS):
            run = {
                "name": name,
                "seed": int(ddp.get("seed", 0)),
                "evaluate": metrics,
                "rev": rev,
                "metrics_path": param(params, "paths.eval_metrics") or PathsConfig().eval_metrics,
                # whether the arms start from the sft stage's model (the default) or from a pinned copy
                "start_is_sft": (param(params, "paths.distill_init") or PathsConfig().distill_init)
                == (param(params, "paths.sft_model") or PathsConfig().sft_model),
            }
            found.append((run, is_experiment, _without_seed(params)))
    configs = Counter(key for _, is_exp, key in found if is_exp)
    study = configs.most_common(1)[0][0] if configs else None
    by_seed: dict[int, dict] = {}
    for run, is_experiment, key in found:
        if study is not None and key != study:
            continue
        if is_experiment or run["seed"] not in by_seed:
            by_seed[run["seed"]] = run
    return [by_seed[s] for s in sorted(by_seed)]


def has_curves(ev: dict) -> bool:
    """Whether an evaluation carries both arms' learning curves (lists of points)."""
    curves = ev.get("curves") or {}
    return all(isinstance(curves.get(a), list) and curves[a] for a in ARMS)


def git_metrics_reader(rev: str, path: str) -> str | None:
    """A metrics file as committed in ``rev`` (an experiment's commit), or in the workspace; None if absent."""
    if rev == "workspace":
        return Path(path).read_text() if Path(path).is_file() else None
    try:
        return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None


def with_curves(runs: list[dict], read: Callable[[str, str], str | None] = git_metrics_reader) -> list[dict]:
    """The runs with their whole evaluation metrics. ``dvc exp show --json`` drops list-valued metrics, so
    the learning curves (lists of points) do not survive it: where a run lacks them, its metrics file is read
    whole from the experiment's commit (the evaluate metrics are committed to git, not to the DVC cache)."""
    out = []
    for run in runs:
        ev = run["evaluate"]
        if not has_curves(ev) and run.get("rev"):
            text = read(run["rev"], run["metrics_path"])
            if text:
                ev = json.loads(text)
        out.append({**run, "evaluate": ev})
    return out


def interval_cell(mean_lo_hi: tuple[float, float, float], pct: bool = False) -> str:
    """``mean [lo, hi]`` as the tables print it."""
    m, lo, hi = mean_lo_hi
    return f"{fmt(m, pct)} [{fmt(lo, pct)}, {fmt(hi, pct)}]"


def _paired(runs: list[dict], where: str, metric: str) -> tuple[list[float], list[float]]:
    a, b = [], []
    for r in runs:
        c = compare(r["evaluate"])
        if c and c[where]:
            x, y = c[where]["opd"].get(metric), c[where]["sft_continued"].get(metric)
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                a.append(x)
                b.append(y)
    return a, b


VIEWS = (
    ("equal_steps", "At equal steps"),
    ("equal_flops", "At equal FLOPs"),
    ("equal_total_flops", "At equal FLOPs, the teacher's data cost counted"),
)


def comparison(runs: list[dict], level: str = "##", arm: str = "OPD") -> tuple[list[str], dict, list[str]]:
    """The equal-steps and equal-FLOPs tables of a set of seeds: (markdown, flat summary, verdict bits). ``arm``:
    how the tables name the evaluation's ``opd`` entry (a study of several arms evaluates each as ``opd``)."""
    lines: list[str] = []
    summary: dict = {}
    verdict_bits = []
    for where, title in VIEWS:
        if not any((compare(r["evaluate"]) or {}).get(where) for r in runs):
            continue  # e.g. no teacher parameter count in older evaluations: no data-cost view
        lines += [
            f"{level} {title}",
            "",
            f"| metric | {arm} | continued SFT (control) | {arm} − control |",
            "|---|---|---|---|",
        ]
        for metric, label, direction in METRICS:
            a, b = _paired(runs, where, metric)
            if len(a) < 2:
                continue
            pct = metric == "exact_match"
            diff = mean_ci([x - y for x, y in zip(a, b)])
            _, ld, hd = diff
            cells = (interval_cell(mean_ci(a), pct), interval_cell(mean_ci(b), pct), interval_cell(diff, pct))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
            summary[f"{where}/{metric}/diff"] = diff
            if metric in ("reverse_kl", "exact_match"):
                good = (hd < 0) if direction == "lower" else (ld > 0)
                bad = (ld > 0) if direction == "lower" else (hd < 0)
                word = f"{arm} better" if good else "control better" if bad else "no difference resolved"
                if one_difference(a, b):  # every seed gave the same difference: a zero-width interval says nothing
                    word = "not resolved (every seed gave the same difference, so the interval has no width)"
                verdict_bits.append(f"{title.lower()}, {label}: {word} ({arm} − control {interval_cell(diff, pct)})")
        lines.append("")
    return lines, summary, verdict_bits


def render_study(
    runs: list[dict],
    commands: str,
    figures: dict[str, str],
    regimes: dict[str, list[dict]] | None = None,
    study: str = "",
) -> tuple[str, dict]:
    """Markdown of the sweep and its flat summary: per arm mean [95% CI], paired difference, a positive
    control, verdict; then each further regime (label -> its seeds) with the same tables. Where OPD did not win
    everything, the paragraph on the regime where it is expected to quotes ``study`` (the study file's text,
    ``equal_budget.regime_paragraph``); ``merge_family_section`` brings it up to date with the merged file."""
    lines = [
        TITLE,
        "",
        "Made from a real sweep of DVC experiments (training seeds `ddp.seed`; the models, data and teacher "
        "completions are shared) with these commands:",
        "",
        "```",
        commands.strip(),
        "```",
        "",
        f"Seeds: {[r['seed'] for r in runs]} (scenario S1-1, nothing injected). Both arms start from the same SFT "
        "student (`paths.distill_init`) and run "
        "the same loop (the `opd` section's steps, batch and schedule). Each cell: mean over seeds [95% "
        "t-interval over training seeds]; differences are paired by seed. The held-out prompts are the same "
        "for every seed, so the intervals hold for these prompts: their own sampling error is not in them. "
        "At equal FLOPs the costlier arm (OPD) is read off its learning curve (which begins at the shared "
        "start) at the cheaper arm's total.",
        "",
    ]
    budget = budget_note(runs[0]["evaluate"]) if runs else []
    if budget:
        lines += ["Seed " + str(runs[0]["seed"]) + ": " + budget[0], ""]
    table, summary, verdict_bits = comparison(runs)
    lines += table
    control = instrument_control(runs)
    if control:
        lines += [
            "## Can this sweep see an effect? (positive control)",
            "",
            "The same instrument (these seeds, the curve prompts) measuring something that does change: "
            "the control arm's improvement over the second half of its steps (its curve at the end minus "
            "its curve half-way, interpolated on steps), paired by seed. A difference between the arms "
            "smaller than this is one the sweep may miss.",
            "",
            *control_table(control),
        ]
        summary.update({f"control_last_half/{metric}": v for metric, v in control.items()})
    for key, path in figures.items():
        if key in ("steps", "flops"):
            lines += [f"![learning curves against {key}]({path})", ""]
    if has_steps(runs):
        lines += [
            "## Where each model first goes wrong",
            "",
            "Long-horizon prompts: the share of held-out answers right through each step of the answer (mean "
            "over seeds, min-max band), step accuracy, and the share right through the first and through every "
            "step, mean [95% t-interval over seeds, clipped to the possible range].",
            "",
        ]
        if not all(r.get("start_is_sft", True) for r in runs):
            lines += [
                "The arms start from a pinned student (`paths.distill_init`), not from this sweep's sft stage, "
                "so the sft stage's model has no row here.",
                "",
            ]
        if "first_error" in figures:
            lines += [f"![answers right through each step]({figures['first_error']})", ""]
        lines += step_table(runs)
    lines += ["## Verdict", "", "- " + "\n- ".join(verdict_bits), ""] if verdict_bits else []
    regime_bits = []
    for label, seeds in (regimes or {}).items():
        table, regime_summary, bits = comparison(seeds, level="###")
        summary.update({f"{label}/{k}": v for k, v in regime_summary.items()})
        lines += [f"## Regime: {label}", "", f"Seeds: {[r['seed'] for r in seeds]}."]
        note = budget_note(seeds[0]["evaluate"]) if seeds else []
        lines += ([f"Seed {seeds[0]['seed']}: " + note[0]] if note else []) + [""] + table
        regime_bits += [f"{label}: {b}" for b in bits]
    if regime_bits:
        lines += ["Regimes:", "", "- " + "\n- ".join(regime_bits), ""]
    if any("OPD better" not in b for b in verdict_bits + regime_bits):
        lines += [regime_paragraph(study), ""]
    return "\n".join(lines) + "\n", summary


TITLE = "# Did on-policy distillation beat more SFT at equal budget?"
FAMILY = "## Task family: "


def as_family_section(study: str, family: str) -> str:
    """A rendered study as one section of a file with one per task family: its title becomes ``## Task
    family: <family>`` and every other heading goes one level down (code blocks are left as they are)."""
    out, fenced = [], False
    for line in study.splitlines():
        if line.startswith("```"):
            fenced = not fenced  # a code block's comments are not headings
        if line == TITLE and not fenced:
            out.append(FAMILY + family)
        elif line.startswith("#") and not fenced:
            out.append("#" + line)
        else:
            out.append(line)
    return "\n".join(out).strip() + "\n"


def merge_family_section(existing: str, family: str, section: str) -> str:
    """``existing`` (a file of family sections, or empty) with the section of ``family`` replaced by
    ``section`` (or added at the end); the file's title and the other families stay as they are, but for the
    paragraph on the regime where OPD is expected to win, which every section then quotes from the merged
    file (``refresh_regime``): a rerun of the regime's own family updates it everywhere."""
    head, *parts = existing.split("\n" + FAMILY) if existing.strip() else [TITLE + "\n"]
    kept = [p for p in parts if p.split("\n", 1)[0].strip() != family]
    body = [head.rstrip() + "\n"] + [FAMILY + p.rstrip() + "\n" for p in kept] + [section]
    return refresh_regime("\n".join(body))


def refresh_regime(text: str) -> str:
    """``text`` (a study file) with each paragraph on the regime where OPD is expected to win (one line, as
    ``render_study`` writes it) replaced by the one quoting ``text``'s own measurement of that regime."""
    paragraph = regime_paragraph(text)
    return "\n".join(paragraph if line.startswith(REGIME_LEAD) else line for line in text.split("\n"))


def control_table(control: dict) -> list[str]:
    """Markdown: the positive control (``instrument_control``), one row per metric it has, and a blank line."""
    rows = [
        f"| {label} | {interval_cell(control[metric], metric == 'exact_match')} |"
        for metric, label, _ in METRICS
        if metric in control
    ]
    return ["| metric | control, end − half-way |", "|---|---|", *rows, ""]


def instrument_control(runs: list[dict]) -> dict:
    """Per metric, mean [95% CI] over seeds of the control arm's change over the second half of its steps
    (on its learning curve): an effect the sweep should resolve if it can resolve anything."""
    out = {}
    for metric, _, _ in METRICS:
        diffs = []
        for r in runs:
            curve = (r["evaluate"].get("curves") or {}).get("sft_continued") or []
            if len(curve) < 2:
                continue
            s0, s1 = curve[0]["steps"], curve[-1]["steps"]
            half, end = interpolate(curve, "steps", (s0 + s1) / 2, metric), interpolate(curve, "steps", s1, metric)
            if math.isfinite(half) and math.isfinite(end):
                diffs.append(end - half)
        if len(diffs) >= 2:
            out[metric] = mean_ci(diffs)
    return out


def _leads_to_start(sft_curve: list[dict], ev: dict) -> bool:
    start = ((ev.get("curves") or {}).get("opd") or [{}])[0]
    return (
        bool(sft_curve)
        and sft_curve[-1].get("steps") == start.get("steps")
        and sft_curve[-1].get("flops") == start.get("flops")
    )


def write_figures(runs: list[dict], out: Path, family: str | None = None) -> dict[str, str]:
    """The study's figures beside its markdown ``out``: learning curves by steps and by FLOPs, and where each
    model first goes wrong when the tasks are long-horizon. In ``out``'s stem folder (``reports/distillation/``
    beside ``reports/distillation.md``), one subfolder per task family; returns each figure's path relative to
    ``out``'s folder, as ``render_study`` links them."""
    fig_dir = out.parent / out.stem
    if family:
        fig_dir = fig_dir / "".join(c if c.isalnum() else "_" for c in family.lower())
    fig_dir.mkdir(parents=True, exist_ok=True)
    rel = fig_dir.relative_to(out.parent).as_posix()
    figures = {}
    for x_key in ("steps", "flops"):
        curve_figure(runs, x_key, fig_dir / f"curves_{x_key}.png")
        figures[x_key] = f"{rel}/curves_{x_key}.png"
    if has_steps(runs):
        first_error_figure(runs, fig_dir / "first_error.png")
        figures["first_error"] = f"{rel}/first_error.png"
    return figures


def curve_figure(runs: list[dict], x_key: str, path: Path) -> None:
    """One panel per metric, one line per arm (and SFT before them): mean over seeds, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4))
    for ax, (metric, label, _) in zip(axes, METRICS):
        for stage, color in (("sft", "grey"), ("opd", "tab:blue"), ("sft_continued", "tab:orange")):
            curves = [r["evaluate"].get("curves", {}).get(stage) or [] for r in runs]
            if stage == "sft":  # drawn only where it leads to the arms' start (a study may start them elsewhere)
                curves = [c for c, r in zip(curves, runs) if c and _leads_to_start(c, r["evaluate"])]
            curves = [c for c in curves if c]
            if not curves:
                continue
            xs = sorted({p[x_key] for p in curves[0]})
            ys = np.array([[interpolate(c, x_key, x, metric) for x in xs] for c in curves], dtype=float)
            ax.plot(xs, np.nanmean(ys, 0), color=color, label=LABELS.get(stage, stage))
            ax.fill_between(xs, np.nanmin(ys, 0), np.nanmax(ys, 0), color=color, alpha=0.2)
        ax.set_xlabel("FLOPs from scratch" if x_key == "flops" else "optimiser steps from scratch")
        ax.set_title(label, fontsize=9)
        if metric != "exact_match":
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
