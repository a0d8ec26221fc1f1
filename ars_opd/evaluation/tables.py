"""Markdown for the evaluate and report stages: the metrics table and how a number is printed."""

from __future__ import annotations

import math

from ars_opd.evaluation.arms import MODELS


def fmt(v, pct: bool = False) -> str:
    """A number as the tables print it: 4 significant digits (or a percentage); "n/a" for a missing value
    (None or NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.1%}" if pct else f"{v:.4g}"


def render_table(metrics: dict) -> str:
    """Markdown table: one row per model."""
    lines = [
        "| model | exact match | reverse KL to teacher (per token) | NLL of teacher completions (per token) |",
        "|---|---|---|---|",
    ]
    for name in MODELS:
        m = metrics.get(name)
        if m is None:
            continue
        em = "n/a" if m.get("exact_match") is None else f"{m['exact_match']:.1%}"
        lines.append(f"| {name} | {em} | {m['reverse_kl']:.4f} | {m['teacher_nll']:.4f} |")
    tasks = sorted({t for name in MODELS for t in (metrics.get(name) or {}).get("exact_match_per_task", {})})
    if tasks:
        lines += ["", "| model | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
        for name in MODELS:
            per = (metrics.get(name) or {}).get("exact_match_per_task", {})
            lines.append(f"| {name} | " + " | ".join(f"{per.get(t, float('nan')):.1%}" for t in tasks) + " |")
    return "\n".join(lines) + "\n"
