"""Where in a long answer each model first goes wrong, across the seeds of a study (long-horizon tasks).

The evaluate stage's ``steps`` metrics (``ars_opd.evaluation.steps``) give, per model, the share of held-out
answers still right after each step (``prefix_accuracy``) and the step accuracy. Over a seed sweep this
module draws the survival curves of base, SFT, OPD, the control and the teacher (mean over seeds, min-max
band) and tabulates step accuracy with 95% t-intervals and the paired difference OPD − control. A share's
t-interval is clipped to [0, 100%] (a difference's to [-100%, 100%]): with five seeds and a share near a
bound the symmetric interval would run past it.

The SFT row is the sft stage's model, so it is shown only when that model is the arms' start; a study that
pins another start (``paths.distill_init``) and reruns a short sft stage beside it (as the long-horizon
sweep does) has no SFT row: that stage's model is neither arm's start.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ars_opd.evaluation.stats import mean_ci
from ars_opd.evaluation.tables import fmt

SHOWN = (
    ("base", "base student", "lightgrey"),
    ("sft", "SFT", "grey"),
    ("opd", "OPD", "tab:blue"),
    ("sft_continued", "continued SFT (control)", "tab:orange"),
    ("teacher", "teacher", "black"),
)


def has_steps(runs: list[dict]) -> bool:
    """Whether the runs' evaluations carry step metrics (their held-out prompts include long-horizon tasks)."""
    return bool(runs) and all(((r["evaluate"].get("opd") or {}).get("steps")) for r in runs)


def _steps(run: dict, model: str) -> dict | None:
    if model == "sft" and not run.get("start_is_sft", True):
        return None  # the sft stage's model is not the arms' start in this run (see the module's docstring)
    return (run["evaluate"].get(model) or {}).get("steps")


def right_throughout(steps: dict) -> float:
    """The share of answers right at every step of the reference (and with nothing after it)."""
    return steps["first_error"].get("none", 0) / steps["answers"]


def first_error_figure(runs: list[dict], path: Path) -> None:
    """The share of answers right through each step, one line per model (mean over seeds, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for model, label, color in SHOWN:
        curves = [s["prefix_accuracy"] for r in runs if (s := _steps(r, model))]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        ys = np.array([c[:n] for c in curves], dtype=float)
        xs = np.arange(1, n + 1)
        ax.plot(xs, ys.mean(0), marker="o", color=color, label=label)
        ax.fill_between(xs, ys.min(0), ys.max(0), color=color, alpha=0.2)
    ax.set_xlabel("step of the answer")
    ax.set_ylabel("answers right through this step")
    ax.set_ylim(0, 1.02)
    ax.set_title("Where each model first goes wrong (held-out long-horizon prompts)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def step_table(runs: list[dict]) -> list[str]:
    """Markdown: step accuracy, the share right through the first step and the share right at every step, per
    model (mean [95% CI] over seeds, clipped to the possible range), and OPD − control paired by seed."""
    lines = [
        "| model | step accuracy | right through step 1 | right at every step |",
        "|---|---|---|---|",
    ]
    for model, label, _ in SHOWN:
        found = [s for r in runs if (s := _steps(r, model))]
        if len(found) < 2:
            continue
        cells = [
            mean_ci([s["step_accuracy"] for s in found]),
            mean_ci([s["prefix_accuracy"][0] for s in found]),
            mean_ci([right_throughout(s) for s in found]),
        ]
        lines.append(f"| {label} | " + " | ".join(_interval(c, 0.0) for c in cells) + " |")
    pairs = [(_steps(r, "opd"), _steps(r, "sft_continued")) for r in runs]
    pairs = [(a, b) for a, b in pairs if a and b]
    if len(pairs) >= 2:
        cells = [
            mean_ci([a["step_accuracy"] - b["step_accuracy"] for a, b in pairs]),
            mean_ci([a["prefix_accuracy"][0] - b["prefix_accuracy"][0] for a, b in pairs]),
            mean_ci([right_throughout(a) - right_throughout(b) for a, b in pairs]),
        ]
        lines.append("| OPD − control (paired) | " + " | ".join(_interval(c, -1.0) for c in cells) + " |")
    return lines + [""]


def _interval(c: tuple[float, float, float], floor: float) -> str:
    """``mean [lo, hi]`` in percent, the interval clipped to [floor, 1] (a share, or a difference of two)."""
    m, lo, hi = c
    lo, hi = max(lo, floor), min(hi, 1.0)
    return f"{fmt(m, True)} [{fmt(lo, True)}, {fmt(hi, True)}]"
