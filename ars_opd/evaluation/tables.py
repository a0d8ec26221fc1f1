"""Markdown for the evaluate and report stages: the metrics tables and how a number is printed."""

from __future__ import annotations

import math

from ars_opd.evaluation.arms import MODELS

OPEN = "–"  # a kind without a checkable answer: no exact match, neither right nor wrong


def fmt(v, pct: bool = False) -> str:
    """A number as the tables print it: 4 significant digits (or a percentage); "n/a" for a missing value
    (None or NaN)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.1%}" if pct else f"{v:.4g}"


def _loss(v) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"


# the figures a change of length cannot game (evaluate's own keys), each with its column and whether it is a share
LENGTH_PROOF = (
    ("reverse_kl_fixed_prefix", "reverse KL at the teacher's prefixes (per token)", False),
    ("reverse_kl_first_sentence", "the same, their first sentence", False),
    ("reverse_kl_per_sequence", "reverse KL on own samples (per sequence)", False),
    ("exact_match_sampled", "exact match, sampled at temperature 1", True),
    ("own_eos_rate", "own samples that end (EOS)", True),
    ("own_length", "their mean length (tokens)", False),
)
# the keys above that describe how the own samples end (shown beside the figures, not judged better or worse)
OWN = ("own_eos_rate", "own_length")


def length_proof_table(metrics: dict) -> list[str]:
    """The figures beside the per-token ones that longer or shorter answers cannot move by themselves: reverse KL
    where the teacher wrote the text (whole, and its first sentence), the own-sample reverse KL summed per
    sequence, exact match of a temperature-1 sample, and how the own samples end. Only the columns some model
    has (an evaluation made before them has none: no table)."""
    models = [(name, metrics[name]) for name in MODELS if isinstance(metrics.get(name), dict)]
    cols = [(k, lbl, pct) for k, lbl, pct in LENGTH_PROOF if any(m.get(k) is not None for _, m in models)]
    if not cols:
        return []
    lines = [
        "",
        "What a change of answer length cannot game by itself (the per-token reverse KL above is averaged over each "
        "model's own samples, so samples that run on add cheap tokens to it):",
        "",
        "| model | " + " | ".join(lbl for _, lbl, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for name, m in models:
        lines.append(f"| {name} | " + " | ".join(fmt(m.get(k), pct) for k, _, pct in cols) + " |")
    return lines


def per_kind_tables(metrics: dict) -> list[str]:
    """For every kind (``task``) in the held-out data, one row per kind with its n and each model's value, in
    three tables: exact match (``OPEN`` for a kind with no checkable answer), reverse KL and teacher NLL (per
    token, token-weighted over the kind's rows). Empty when no row carries a kind."""
    models = [name for name in MODELS if metrics.get(name) is not None]
    per = {
        key: {name: metrics[name].get(key) or {} for name in models}
        for key in ("exact_match_per_task", "reverse_kl_per_task", "teacher_nll_per_task")
    }
    counts = metrics.get("examples_per_task") or {}
    kinds = sorted({*counts, *(t for table in per.values() for d in table.values() for t in d)})
    if not kinds:
        return []
    checkable = {t for d in per["exact_match_per_task"].values() for t in d}
    head = ["| kind | n | " + " | ".join(models) + " |", "|---|---|" + "---|" * len(models)]
    lines = [
        "",
        f"Per kind (n: held-out rows of the kind; exact match only where a program checks the answer, {OPEN} for "
        "an open-ended kind, which has no right answer; reverse KL and teacher NLL per token over the kind's "
        "tokens):",
    ]
    for key, title in (
        ("exact_match_per_task", "Exact match"),
        ("reverse_kl_per_task", "Reverse KL to teacher (per token)"),
        ("teacher_nll_per_task", "NLL of teacher completions (per token)"),
    ):
        if not any(per[key].values()):  # metrics written before this key existed, or no checkable kind
            continue
        lines += ["", f"{title}:", "", *head]
        for t in kinds:
            if key == "exact_match_per_task":
                cells = [fmt(per[key][m].get(t), pct=True) if t in checkable else OPEN for m in models]
            else:
                cells = [_loss(per[key][m].get(t)) for m in models]
            lines.append(f"| {t} | {counts.get(t, '')} | " + " | ".join(cells) + " |")
    return lines


def per_teacher_tables(metrics: dict) -> list[str]:
    """With several teachers (``examples_per_teacher``): one row per teacher with its n and each model's value over
    that teacher's held-out rows, measured against that teacher: exact match, reverse KL on the model's own samples,
    reverse KL at the teacher's fixed prefixes and the NLL of the teacher's completions. Empty for one teacher."""
    counts = metrics.get("examples_per_teacher")
    if not counts:
        return []
    models = [name for name in MODELS if metrics.get(name) is not None]
    per = {name: metrics[name].get("per_teacher") or {} for name in models}
    lines = [
        "",
        "Per teacher (each held-out row measured against its own teacher; n: its rows; the teacher column is each "
        "teacher on its own rows):",
    ]
    for key, title, pct in (
        ("exact_match", "Exact match", True),
        ("reverse_kl", "Reverse KL to the row's teacher (per token)", False),
        ("reverse_kl_fixed_prefix", "Reverse KL at the row's teacher's fixed prefixes (per token)", False),
        ("teacher_nll", "NLL of the row's teacher's completions (per token)", False),
    ):
        lines += [
            "",
            f"{title}:",
            "",
            "| teacher | n | " + " | ".join(models) + " |",
            "|---|---|" + "---|" * len(models),
        ]
        for t, n in counts.items():
            cells = []
            for m in models:
                v = (per[m].get(t) or {}).get(key)
                if m == "teacher" and key.startswith("reverse_kl"):
                    v = 0.0
                cells.append(fmt(v, pct=True) if pct else _loss(v))
            lines.append(f"| {t} | {n} | " + " | ".join(cells) + " |")
    return lines


def render_table(metrics: dict) -> str:
    """Markdown: one row per model (exact match over the checkable rows only), then the per-kind tables."""
    checkable, examples = metrics.get("checkable_examples"), metrics.get("examples")
    lines = [
        "| model | exact match (checkable rows only) | reverse KL to teacher (per token) "
        "| NLL of teacher completions (per token) |",
        "|---|---|---|---|",
    ]
    for name in MODELS:
        m = metrics.get(name)
        if m is None:
            continue
        em = "n/a" if m.get("exact_match") is None else f"{m['exact_match']:.1%}"
        lines.append(f"| {name} | {em} | {m['reverse_kl']:.4f} | {m['teacher_nll']:.4f} |")
    if checkable is not None and examples is not None:
        lines += [
            "",
            f"Exact match counts the {checkable} checkable rows of the {examples} held out; reverse KL and "
            "teacher NLL count every row.",
        ]
    lines += length_proof_table(metrics)
    lines += per_kind_tables(metrics)
    lines += per_teacher_tables(metrics)
    return "\n".join(lines) + "\n"
