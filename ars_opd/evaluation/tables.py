"""Markdown tables of the evaluation metrics (shared by the evaluate and report stages)."""

from __future__ import annotations

MODELS = ("base", "sft", "opd", "sft_continued", "teacher")
TRAINED = ("sft", "opd", "sft_continued")  # models the training stages write (with budgets and snapshots)
ARMS = ("opd", "sft_continued")  # the arms that start from the SFT student with equal steps


def render_table(metrics: dict) -> str:
    """Markdown table: one row per model."""
    lines = ["| model | exact match | reverse KL to teacher (per token) | NLL of teacher completions (per token) |",
             "|---|---|---|---|"]
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
