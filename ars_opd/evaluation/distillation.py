"""Did distillation work? OPD against its control at equal budget, for one run and across seeds.

Both arms start from the same SFT student (``paths.distill_init``) and run the same optimisation loop (the
``opd`` section's steps, batch and learning-rate schedule): OPD on the student's own samples scored by the
teacher, the control (``sft_continued``) on more SFT of the teacher's completions. The evaluate stage scores
each arm's final model on every held-out prompt, and its learning-curve snapshots on the first
``evaluate.curve_examples`` of them, each with the steps and FLOPs spent from scratch to reach it.

- **Equal steps**: the arms' final models (same number of optimiser steps and sequences per step).
- **Equal FLOPs**: an OPD step also samples and runs the teacher, so at the cheaper arm's total FLOPs the
  other arm's learning curve is read off by linear interpolation between its snapshots (both on the curve
  prompts).

``compare`` does this for one run (the report's headline); ``collect``/``render_study`` aggregate a
``dvc exp run`` sweep of training seeds (``ddp.seed``) into means, 95% t-intervals of each arm and of the
paired per-seed difference OPD − control, the learning-curve figures, and the verdict.
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
from ars_opd.evaluation.scenarios import mean_ci, walk_experiments
from ars_opd.evaluation.arms import ARMS
from ars_opd.evaluation.tables import fmt

METRICS = (("reverse_kl", "reverse KL to the teacher (per token)", "lower"),
           ("exact_match", "exact match", "higher"),
           ("teacher_nll", "NLL of the teacher's completions (per token)", "lower"))
LABELS = {"opd": "OPD", "sft_continued": "continued SFT (control)", "sft": "SFT"}


def interpolate(curve: list[dict], x_key: str, x: float, y_key: str) -> float:
    """``y_key`` of a learning curve at ``x`` (linear between points; NaN outside the curve)."""
    pts = sorted((p[x_key], p[y_key]) for p in curve if p.get(y_key) is not None)
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return float("nan")
    xs, ys = zip(*pts)
    return float(np.interp(x, xs, ys))


def compare(eval_metrics: dict) -> dict | None:
    """One run's comparison: {"equal_steps": {arm: {metric: v, ...budget}}, "equal_flops": {"flops": F,
    arm: {metric: v}}}; None when an arm is missing."""
    if not all(eval_metrics.get(a) for a in ARMS):
        return None
    out: dict[str, Any] = {"equal_steps": {}, "equal_flops": {}}
    for arm in ARMS:
        m = eval_metrics[arm]
        out["equal_steps"][arm] = {**{k: m.get(k) for k, _, _ in METRICS}, **(m.get("budget") or {})}
    curves = eval_metrics.get("curves") or {}
    if all(curves.get(a) for a in ARMS):
        flops = min(max(p["flops"] for p in curves[a]) for a in ARMS)
        out["equal_flops"]["flops"] = flops
        for arm in ARMS:
            out["equal_flops"][arm] = {k: interpolate(curves[arm], "flops", flops, k) for k, _, _ in METRICS}
    return out


def _interval(mean_lo_hi: tuple[float, float, float], pct: bool = False) -> str:
    """``mean [lo, hi]`` as the tables print it."""
    m, lo, hi = mean_lo_hi
    return f"{fmt(m, pct)} [{fmt(lo, pct)}, {fmt(hi, pct)}]"


def headline(cmp: dict) -> list[str]:
    """Markdown: the two arms at equal steps and at equal FLOPs, and a one-run verdict."""
    steps = cmp["equal_steps"]
    lines = ["Both arms start from the same SFT student and run the same loop (same steps, batch, learning-rate "
             "schedule); only the objective and its data differ. One training seed here: the sweep with "
             "intervals is `reports/distillation.md`.", "",
             "| at equal steps | steps from scratch | FLOPs from scratch | tokens generated | "
             + " | ".join(label for _, label, _ in METRICS) + " |", "|---|---|---|---|" + "---|" * len(METRICS)]
    for arm in ARMS:
        s = steps[arm]
        lines.append(f"| {LABELS[arm]} | {s.get('steps', 'n/a')} | {fmt(s.get('flops'))} | "
                     f"{s.get('tokens_generated', 'n/a')} | " + " | ".join(
                         fmt(s.get(k), pct=k == "exact_match") for k, _, _ in METRICS) + " |")
    flops = cmp["equal_flops"]
    if flops:
        lines += ["", f"At equal FLOPs ({fmt(flops['flops'])} from scratch, the cheaper arm's total; learning "
                      "curves interpolated on the curve prompts):", "",
                  "| at equal FLOPs | " + " | ".join(label for _, label, _ in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        for arm in ARMS:
            lines.append(f"| {LABELS[arm]} | " + " | ".join(
                fmt(flops[arm].get(k), pct=k == "exact_match") for k, _, _ in METRICS) + " |")
    verdict = []
    for label, table in (("equal steps", steps), ("equal FLOPs", flops)):
        if not table:
            continue
        o, c = table["opd"].get("reverse_kl"), table["sft_continued"].get("reverse_kl")
        e_o, e_c = table["opd"].get("exact_match"), table["sft_continued"].get("exact_match")
        if o is None or c is None or not (math.isfinite(o) and math.isfinite(c)):
            continue
        words = f"at {label}, OPD's reverse KL to the teacher is **{'lower' if o < c else 'not lower'}** than the " \
                f"control's ({o:.4f} vs {c:.4f})"
        if e_o is not None and e_c is not None and math.isfinite(e_o) and math.isfinite(e_c):
            words += f" and its exact match **{'higher' if e_o > e_c else 'not higher'}** ({e_o:.1%} vs {e_c:.1%})"
        verdict.append(words)
    if verdict:
        lines += ["", "In this run, " + "; ".join(verdict) + "."]
    return lines + [""]


def regime_note(cmp: dict) -> list[str]:
    """Markdown: where OPD is expected to win, when it did not win here at equal steps or equal FLOPs."""
    if _opd_wins(cmp["equal_steps"]) and (not cmp["equal_flops"] or _opd_wins(cmp["equal_flops"])):
        return []
    return [REGIME, ""]


REGIME = ("Where OPD is expected to win, if not here: on-policy distillation trains on the states the student "
          "itself reaches, so its advantage over SFT on teacher text grows with (1) a longer horizon, answers of "
          "many tokens where the student's early mistakes compound and SFT never shows it how to recover; (2) a "
          "larger teacher–student gap with a student good enough that its samples are informative; (3) judging "
          "by the reverse KL on the student's own samples, the quantity OPD minimises, rather than by the "
          "teacher-text NLL that SFT minimises. At equal FLOPs it also pays for sampling and for the teacher's "
          "forward (2·P_teacher per scored token against 6·P_student per trained token); a served teacher "
          "(`opd.teacher: endpoint`) moves that cost off the student's devices, not out of the budget.")


def _opd_wins(table: dict) -> bool:
    """OPD at least as good as the control on both reverse KL and exact match (where both are known)."""
    o, c = table.get("opd") or {}, table.get("sft_continued") or {}
    ok = True
    for metric, _, direction in METRICS[:2]:
        a, b = o.get(metric), c.get(metric)
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            continue
        ok &= (a <= b) if direction == "lower" else (a >= b)
    return bool(ok)


def budget_note(eval_metrics: dict) -> list[str]:
    """Markdown: the budget both arms had and how far from converged they are (the teacher as the ceiling,
    and whether each arm's learning curve was still improving over its last interval)."""
    curves = eval_metrics.get("curves") or {}
    teacher = eval_metrics.get("teacher") or {}
    bits = []
    for arm in ARMS:
        c = [p for p in curves.get(arm) or [] if p.get("reverse_kl") is not None]
        if len(c) >= 2:
            a, b = c[-2], c[-1]
            trend = "still falling" if b["reverse_kl"] < a["reverse_kl"] else "flat or rising"
            bits.append(f"{LABELS[arm]}'s reverse KL was {trend} over its last {b['steps'] - a['steps']} steps "
                        f"({a['reverse_kl']:.3g} → {b['reverse_kl']:.3g} on the curve prompts)")
    start = (curves.get("opd") or [{}])[0]
    arm_steps = (eval_metrics.get("opd") or {}).get("budget", {}).get("steps")
    words = []
    if start.get("steps") is not None and arm_steps is not None:
        words.append(f"Budget: the SFT student both arms start from had {start['steps']} steps; each arm adds "
                     f"{arm_steps - start['steps']}.")
    if teacher.get("exact_match") is not None:
        em = {a: (eval_metrics.get(a) or {}).get("exact_match") for a in ARMS}
        if all(v is not None for v in em.values()):
            words.append(f"The teacher's exact match is {teacher['exact_match']:.1%} against the arms' "
                         f"{em['opd']:.1%} and {em['sft_continued']:.1%}, so neither student is near the ceiling"
                         if max(em.values()) < teacher["exact_match"] - 0.05 else
                         f"The teacher's exact match is {teacher['exact_match']:.1%}, the arms' {em['opd']:.1%} "
                         f"and {em['sft_continued']:.1%}")
    if bits:
        words.append("; ".join(bits) + ".")
    return [" ".join(w if w.endswith(".") else w + "." for w in words), ""] if words else []


# -- the seed sweep ---------------------------------------------------------------------------------------

def _without_seed(params: dict) -> str:
    """The run's params minus ``ddp.seed``: two runs with equal keys are seeds of one experiment."""
    ddp = {k: v for k, v in (params.get("ddp") or {}).items() if k != "seed"}
    return json.dumps({**params, "ddp": ddp}, sort_keys=True, default=str)


def param(params: dict, dotted: str) -> Any:
    """A params.yaml value by its dotted key (``opd.steps``); None when absent."""
    node: Any = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
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
            run = {"name": name, "seed": int(ddp.get("seed", 0)), "evaluate": metrics, "rev": rev,
                   "metrics_path": param(params, "paths.eval_metrics") or PathsConfig().eval_metrics}
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


def _comparison(runs: list[dict], level: str = "##") -> tuple[list[str], dict, list[str]]:
    """The equal-steps and equal-FLOPs tables of a set of seeds: (markdown, flat summary, verdict bits)."""
    lines: list[str] = []
    summary: dict = {}
    verdict_bits = []
    for where, title in (("equal_steps", "At equal steps"), ("equal_flops", "At equal FLOPs")):
        lines += [f"{level} {title}", "", "| metric | OPD | continued SFT (control) | OPD − control |",
                  "|---|---|---|---|"]
        for metric, label, direction in METRICS:
            a, b = _paired(runs, where, metric)
            if len(a) < 2:
                continue
            pct = metric == "exact_match"
            diff = mean_ci([x - y for x, y in zip(a, b)])
            _, ld, hd = diff
            lines.append(f"| {label} | {_interval(mean_ci(a), pct)} | {_interval(mean_ci(b), pct)} | "
                         f"{_interval(diff, pct)} |")
            summary[f"{where}/{metric}/diff"] = diff
            if metric in ("reverse_kl", "exact_match"):
                good = (hd < 0) if direction == "lower" else (ld > 0)
                bad = (ld > 0) if direction == "lower" else (hd < 0)
                word = "OPD better" if good else "control better" if bad else "no difference resolved"
                if ld == hd:  # every seed gave the same difference: a zero-width interval says nothing
                    word = "not resolved (every seed gave the same difference, so the interval has no width)"
                verdict_bits.append(f"{title.lower()}, {label}: {word} (OPD − control {_interval(diff, pct)})")
        lines.append("")
    return lines, summary, verdict_bits


def render_study(runs: list[dict], commands: str, figures: dict[str, str],
                 regimes: dict[str, list[dict]] | None = None) -> tuple[str, dict]:
    """Markdown of the sweep and its flat summary: per arm mean [95% CI], paired difference, a positive
    control, verdict; then each further regime (label -> its seeds) with the same tables."""
    lines = ["# Did on-policy distillation beat more SFT at equal budget?", "",
             "Made from a real sweep of DVC experiments (training seeds `ddp.seed`; the models, data and teacher "
             "completions are shared) with these commands:", "", "```", commands.strip(), "```", "",
             f"Seeds: {[r['seed'] for r in runs]} (scenario S1-1, nothing injected). Both arms start from the same SFT "
             "student (`paths.distill_init`) and run "
             "the same loop (the `opd` section's steps, batch and schedule). Each cell: mean over seeds [95% "
             "t-interval over training seeds]; differences are paired by seed. The held-out prompts are the same "
             "for every seed, so the intervals hold for these prompts: their own sampling error is not in them. "
             "At equal FLOPs the costlier arm (OPD) is read off its learning curve (which begins at the shared "
             "start) at the cheaper arm's total.", ""]
    budget = budget_note(runs[0]["evaluate"]) if runs else []
    if budget:
        lines += ["Seed " + str(runs[0]["seed"]) + ": " + budget[0], ""]
    table, summary, verdict_bits = _comparison(runs)
    lines += table
    control = _instrument_control(runs)
    if control:
        lines += ["## Can this sweep see an effect? (positive control)", "",
                  "The same instrument (these seeds, the curve prompts) measuring something that does change: "
                  "the control arm's improvement over the second half of its steps (its curve at the end minus "
                  "its curve half-way, interpolated on steps), paired by seed. A difference between the arms "
                  "smaller than this is one the sweep may miss.", "",
                  "| metric | control, end − half-way |", "|---|---|"]
        for metric, label, _ in METRICS:
            if metric in control:
                lines.append(f"| {label} | {_interval(control[metric], metric == 'exact_match')} |")
                summary[f"control_last_half/{metric}"] = control[metric]
        lines.append("")
    for key, path in figures.items():
        lines += [f"![learning curves against {key}]({path})", ""]
    lines += ["## Verdict", "", "- " + "\n- ".join(verdict_bits), ""] if verdict_bits else []
    regime_bits = []
    for label, seeds in (regimes or {}).items():
        table, regime_summary, bits = _comparison(seeds, level="###")
        summary.update({f"{label}/{k}": v for k, v in regime_summary.items()})
        lines += [f"## Regime: {label}", "", f"Seeds: {[r['seed'] for r in seeds]}."]
        note = budget_note(seeds[0]["evaluate"]) if seeds else []
        lines += ([f"Seed {seeds[0]['seed']}: " + note[0]] if note else []) + [""] + table
        regime_bits += [f"{label}: {b}" for b in bits]
    if regime_bits:
        lines += ["Regimes:", "", "- " + "\n- ".join(regime_bits), ""]
    if any("OPD better" not in b for b in verdict_bits + regime_bits):
        lines += [REGIME, ""]
    return "\n".join(lines) + "\n", summary


def _instrument_control(runs: list[dict]) -> dict:
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
    return bool(sft_curve) and sft_curve[-1].get("steps") == start.get("steps") \
        and sft_curve[-1].get("flops") == start.get("flops")


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
