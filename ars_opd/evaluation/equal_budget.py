"""OPD against its control at equal budget, for one run: the comparison's numbers and the report's words on them.

Both arms start from the same SFT student (``paths.distill_init``) and run the same optimisation loop (the
``opd`` section's steps, batch and learning-rate schedule): OPD on the student's own samples scored by the
teacher, the control (``sft_continued``) on more SFT of the teacher's completions. The evaluate stage scores
each arm's final model on every held-out prompt, and its learning-curve snapshots on the first
``evaluate.curve_examples`` of them, each with the steps and FLOPs spent from scratch to reach it.

- **Equal steps**: the arms' final models (same number of optimiser steps and sequences per step).
- **Equal FLOPs**: an OPD step also samples and runs the teacher, so at the cheaper arm's total FLOPs the
  other arm's learning curve is read off by linear interpolation between its snapshots (both on the curve
  prompts).
- **Equal FLOPs with the teacher's data cost**: the same, with 2·P_teacher FLOPs added per token the teacher
  generated for the text each arm's lineage trained on (the SFT stage's completions, and a fresh control's
  own: ``control.data``), as the published comparisons of distillation with SFT count it. With a control
  that repeats the SFT stage's rows both arms carry the same data cost and this view equals the one above.

``compare`` does this for one run; ``headline``, ``budget_note`` and ``regime_note`` are the report's markdown
on it (``regime_note`` quotes the seed study's measurement of the regime where OPD is expected to win, read
from the study file's text: ``regime_paragraph``). Pure functions of one run's evaluate metrics, no I/O: the
seed sweep (``ars_opd.evaluation.distillation``) compares each of its runs with the same ``compare`` and
``METRICS``, so one run and a sweep measure the same thing.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from ars_opd.evaluation.arms import ARMS
from ars_opd.evaluation.tables import fmt

METRICS = (
    ("reverse_kl", "reverse KL to the teacher (per token)", "lower"),
    ("exact_match", "exact match", "higher"),
    ("teacher_nll", "NLL of the teacher's completions (per token)", "lower"),
)
LABELS = {"opd": "OPD", "sft_continued": "continued SFT (control)", "sft": "SFT"}


def interpolate(curve: list[dict], x_key: str, x: float, y_key: str) -> float:
    """``y_key`` of a learning curve at ``x`` (linear between points; NaN outside the curve)."""
    pts = sorted((p[x_key], p[y_key]) for p in curve if p.get(y_key) is not None)
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return float("nan")
    xs, ys = zip(*pts)
    return float(np.interp(x, xs, ys))


def total_flops(point: dict, teacher_parameters: int) -> float:
    """A budget's FLOPs with the teacher's cost of the text its lineage trained on: 2·P_teacher per token the
    teacher generated for it (``teacher_tokens``, ``ars_opd.training.data_cost``)."""
    return point["flops"] + 2.0 * teacher_parameters * point.get("teacher_tokens", 0)


def _at_equal(curves: dict, x_key: str, metrics: tuple = METRICS) -> dict:
    """Both arms at the cheaper arm's final ``x_key``, each read off its learning curve."""
    x = min(max(p[x_key] for p in curves[a]) for a in ARMS)
    return {"flops": x, **{arm: {k: interpolate(curves[arm], x_key, x, k) for k, _, _ in metrics} for arm in ARMS}}


def compare(eval_metrics: dict, metrics: tuple = METRICS) -> dict | None:
    """One run's comparison: {"equal_steps": {arm: {metric: v, ...budget}}, "equal_flops": {"flops": F,
    arm: {metric: v}}, "equal_total_flops": the same with the teacher's data cost counted}; None when an arm
    is missing. The third view needs the teacher's parameter count (evaluate metrics, ``teacher``). ``metrics``:
    (key, label, direction) triples read in every view (a study may read more than ``METRICS``)."""
    if not all(eval_metrics.get(a) for a in ARMS):
        return None
    out: dict[str, Any] = {"equal_steps": {}, "equal_flops": {}, "equal_total_flops": {}}
    for arm in ARMS:
        m = eval_metrics[arm]
        out["equal_steps"][arm] = {**{k: m.get(k) for k, _, _ in metrics}, **(m.get("budget") or {})}
    curves = eval_metrics.get("curves") or {}
    if all(curves.get(a) for a in ARMS):
        out["equal_flops"] = _at_equal(curves, "flops", metrics)
        p_teacher = (eval_metrics.get("teacher") or {}).get("matmul_parameters")
        if p_teacher:
            total = {a: [{**p, "total_flops": total_flops(p, p_teacher)} for p in curves[a]] for a in ARMS}
            out["equal_total_flops"] = _at_equal(total, "total_flops", metrics)
    return out


def headline(cmp: dict) -> list[str]:
    """Markdown: the two arms at equal steps, at equal FLOPs (and with the teacher's data cost), and a one-run
    verdict."""
    steps = cmp["equal_steps"]
    lines = [
        "Both arms start from the same SFT student and run the same loop (same steps, batch, learning-rate "
        "schedule); only the objective and its data differ. One training seed here: the sweep with "
        "intervals is `reports/distillation.md`.",
        "",
        "| at equal steps | steps from scratch | FLOPs from scratch | tokens generated | "
        + " | ".join(label for _, label, _ in METRICS)
        + " |",
        "|---|---|---|---|" + "---|" * len(METRICS),
    ]
    for arm in ARMS:
        s = steps[arm]
        lines.append(
            f"| {LABELS[arm]} | {s.get('steps', 'n/a')} | {fmt(s.get('flops'))} | "
            f"{s.get('tokens_generated', 'n/a')} | "
            + " | ".join(fmt(s.get(k), pct=k == "exact_match") for k, _, _ in METRICS)
            + " |"
        )
    views = [("equal steps", steps)]
    for key, label, what in (
        ("equal_flops", "equal FLOPs", "from scratch, the cheaper arm's total"),
        (
            "equal_total_flops",
            "equal FLOPs with the teacher's data cost",
            "from scratch with 2·P_teacher per token the teacher wrote for the text each arm's lineage trained "
            "on, the cheaper arm's total",
        ),
    ):
        table = cmp.get(key)
        if not table:
            continue
        views.append((label, table))
        lines += [
            "",
            f"At {label} ({fmt(table['flops'])} {what}; learning curves interpolated on the curve prompts):",
            "",
            f"| at {label} | " + " | ".join(label for _, label, _ in METRICS) + " |",
            "|---|" + "---|" * len(METRICS),
        ]
        for arm in ARMS:
            lines.append(
                f"| {LABELS[arm]} | "
                + " | ".join(fmt(table[arm].get(k), pct=k == "exact_match") for k, _, _ in METRICS)
                + " |"
            )
    verdict = []
    for label, table in views:
        if not table:
            continue
        o, c = table["opd"].get("reverse_kl"), table["sft_continued"].get("reverse_kl")
        e_o, e_c = table["opd"].get("exact_match"), table["sft_continued"].get("exact_match")
        if o is None or c is None or not (math.isfinite(o) and math.isfinite(c)):
            continue
        words = (
            f"at {label}, OPD's reverse KL to the teacher is **{'lower' if o < c else 'not lower'}** than the "
            f"control's ({o:.4f} vs {c:.4f})"
        )
        if e_o is not None and e_c is not None and math.isfinite(e_o) and math.isfinite(e_c):
            words += f" and its exact match **{'higher' if e_o > e_c else 'not higher'}** ({e_o:.1%} vs {e_c:.1%})"
        verdict.append(words)
    if verdict:
        lines += ["", "In this run, " + "; ".join(verdict) + "."]
    return lines + [""]


def regime_note(cmp: dict, study: str = "") -> list[str]:
    """Markdown: where OPD is expected to win, when it did not win here at equal steps or equal FLOPs, quoting
    what the study (``study``: the text of ``STUDY_FILE``) measured there (``regime_paragraph``)."""
    if _opd_wins(cmp["equal_steps"]) and (not cmp["equal_flops"] or _opd_wins(cmp["equal_flops"])):
        return []
    return [regime_paragraph(study), ""]


# The paragraph on the regime where OPD is expected to win quotes what the seed study measured there: the
# section of ``STUDY_FILE`` that ``ars-opd distillation --family REGIME_FAMILY`` writes (studies/long_horizon_sweep.sh),
# read back from its tables, so rerunning that study updates the paragraph here, in the report stage (which
# lists the file as a dep) and in the study file's own sections (``distillation.merge_family_section``).
STUDY_FILE = "reports/distillation.md"
REGIME_FAMILY = "long-horizon"
REGIME_LEAD = "Where OPD is expected to win"
_WHY = (
    "on-policy distillation trains on the states the student itself reaches, so the published case for it is long "
    "answers, where an early mistake compounds and SFT on teacher text never shows the student how to recover."
)
_FAMILY = (
    "the long-horizon family, `synthetic.tasks: [running_sum, shift_steps]`, answers of 20-60 characters checked "
    "step by step"
)
_COST = (
    "At equal FLOPs OPD also pays for sampling and for the teacher's forward (2·P_teacher per scored token against "
    "6·P_student per trained token); a served teacher (`opd.teacher: endpoint`) moves that cost off the student's "
    "devices, not out of the budget."
)
# the study's views the paragraph quotes: (heading in the family's section, regime heading or None: the main
# study, how the paragraph introduces it); a fresh control's data-cost view is the one that charges the
# teacher's writing to one arm only
_VIEWS = (
    ("At equal steps", None, "at equal steps"),
    ("At equal FLOPs", None, "at equal FLOPs"),
    (
        "At equal FLOPs, the teacher's data cost counted",
        "fresh control",
        "against a control on fresh teacher completions, the teacher's cost of writing them counted,",
    ),
)
_METRIC_ROWS = {label: (key, direction) for key, label, direction in METRICS[:2]}


def family_section(text: str, family: str) -> str | None:
    """The ``## Task family: <family>`` section of a study file (to the next family's), or None."""
    head = f"## Task family: {family}\n"
    at = text.find(head)
    if at < 0:
        return None
    rest = text[at + len(head) :]
    end = rest.find("\n## Task family: ")
    return rest if end < 0 else rest[:end]


def _subsection(text: str, heading: str) -> str | None:
    """The body under the first markdown heading ``heading`` (any level), to the next heading of any level."""
    match = re.search(rf"^#+ {re.escape(heading)}\n", text, flags=re.M)
    if match is None:
        return None
    rest = text[match.end() :]
    following = re.search(r"^#+ ", rest, flags=re.M)
    return rest if following is None else rest[: following.start()]


def _number(cell: str) -> float:
    """A table cell's number: percentages in points (``-12.4%`` -> -12.4)."""
    return float(cell.strip().rstrip("%"))


def _differences(table: str) -> dict[str, tuple[float, float, float]]:
    """{metric key: OPD − control (mean, lo, hi)} of a comparison table (``distillation.comparison``'s rows)."""
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in _METRIC_ROWS:
            m = re.fullmatch(r"(\S+) \[(\S+), (\S+)\]", cells[3])
            if m:
                out[_METRIC_ROWS[cells[0]][0]] = tuple(_number(g) for g in m.groups())
    return out


def regime_facts(section: str) -> dict | None:
    """What the paragraph quotes, read from the study's family section: its seeds, steps per arm, the model
    sizes its notes state, and OPD − control for reverse KL and exact match in each of ``_VIEWS``."""
    views = []
    for heading, regime, words in _VIEWS:
        where = section
        if regime is not None:
            match = re.search(rf"^#+ Regime: {re.escape(regime)}.*\n", section, flags=re.M)
            where = section[match.end() :] if match else ""
        table = _subsection(where, heading)
        diffs = _differences(table) if table else {}
        if diffs:
            views.append((words, diffs))
    if not views:
        return None
    seeds = re.search(r"^Seeds: \[([^\]]*)\]", section, flags=re.M)
    steps = re.search(r"each arm adds (\d+)\b", section)
    sizes = re.search(r"student \(([\d,]+) parameters\) and teacher \(([\d,]+)", section)
    return {
        "seeds": len(seeds.group(1).split(",")) if seeds else None,
        "steps": int(steps.group(1)) if steps else None,
        "student": int(sizes.group(1).replace(",", "")) if sizes else None,
        "teacher": int(sizes.group(2).replace(",", "")) if sizes else None,
        "views": views,
    }


def _resolved(key: str, diff: tuple[float, float, float]) -> str | None:
    """ "opd", "control" or None (the 95% interval of OPD − control holds 0), by the metric's direction."""
    _, lo, hi = diff
    lower_is_better = dict((k, d) for k, _, d in METRICS)[key] == "lower"
    if (hi < 0) if lower_is_better else (lo > 0):
        return "opd"
    if (lo > 0) if lower_is_better else (hi < 0):
        return "control"
    return None


def _value(key: str, x: float, signed: bool) -> str:
    """Reverse KL to 2 decimals; exact match in whole points (one decimal below 1 point)."""
    if key == "reverse_kl":
        return f"{x:+.2f}" if signed else f"{x:.2f}"
    digits = 1 if round(abs(x)) < 1 else 0
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _signed(key: str, diff: tuple[float, float, float]) -> str:
    """OPD − control as measured: ``+0.03 [-0.02, 0.07]``, ``-12 points [-25, +0.4]``."""
    m, lo, hi = diff
    if key == "reverse_kl":
        return f"reverse KL {_value(key, m, True)} [{_value(key, lo, False)}, {_value(key, hi, False)}]"
    return f"exact match {_value(key, m, True)} points [{_value(key, lo, True)}, {_value(key, hi, True)}]"


def _margin(key: str, diff: tuple[float, float, float]) -> str:
    """How far the winner is ahead, a positive interval: ``0.13 [0.08, 0.18]``, ``18 points [4, 32]``."""
    m, lo, hi = (abs(x) for x in diff)
    lo, hi = min(lo, hi), max(lo, hi)
    unit = " points" if key == "exact_match" else ""
    return f"{_value(key, m, False)}{unit} [{_value(key, lo, False)}, {_value(key, hi, False)}]"


_AHEAD = {"reverse_kl": ("reverse KL", "lower"), "exact_match": ("exact match", "higher")}


def _view_clause(words: str, diffs: dict, earlier: set[str]) -> str:
    """One view of the study in words: what was resolved, and by how much."""
    keys = [k for k, _, _ in METRICS[:2] if k in diffs]
    winners = {k: _resolved(k, diffs[k]) for k in keys}
    resolved = [k for k in keys if winners[k]]
    if not resolved:
        return f"{words} no difference was resolved ({', '.join(_signed(k, diffs[k]) for k in keys)})"
    names = {"opd": "OPD", "control": "the control"}
    parts = []
    for who in ("opd", "control"):
        mine = [k for k in resolved if winners[k] == who]
        if len(mine) == 1:
            what, how = _AHEAD[mine[0]]
            owner = "OPD's" if who == "opd" else "the control's"
            parts.append(f"{owner} {what} was {how} by {_margin(mine[0], diffs[mine[0]])}")
        elif mine:
            still = " still" if who in earlier else ""
            margins = ", ".join(f"{_AHEAD[k][0]} by {_margin(k, diffs[k])}" for k in mine)
            parts.append(f"{names[who]} was{still} better ({margins})")
    return f"{words} " + " and ".join(parts)


def _size(n: int) -> str:
    """A parameter count as the paragraph says it: 0.3M, 1M, 600M, 1.7B."""
    if n >= 1e9:
        return f"{n / 1e9:.2g}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e6:.1g}M"


def regime_paragraph(study: str = "") -> str:
    """The paragraph on the regime where OPD is expected to win, with what ``study`` (the text of the study file)
    measured there in its ``REGIME_FAMILY`` section; without such a section, the regime and how to measure it."""
    section = family_section(study, REGIME_FAMILY) if study else None
    facts = regime_facts(section) if section else None
    if facts is None:
        return (
            f"{REGIME_LEAD}: {_WHY} That regime is built in ({_FAMILY}); `studies/long_horizon_sweep.sh` measures it "
            f"the same way and writes its section of {STUDY_FILE}, which this paragraph then quotes. {_COST}"
        )
    how = [f"{facts['seeds']} seeds from one SFT student" if facts["seeds"] else None]
    how.append(f"{facts['steps']} steps an arm" if facts["steps"] else None)
    how = ", ".join(h for h in how if h)
    clauses, earlier = [], set()
    for words, diffs in facts["views"]:
        clauses.append(_view_clause(words, diffs, earlier))
        earlier |= {w for w in (_resolved(k, d) for k, d in diffs.items()) if w}
    won = "opd" in earlier
    if not won:
        lead = "OPD did not beat continued SFT there either"
    else:
        lead = "OPD beat continued SFT there" + (" on some measures" if "control" in earlier else "")
    scale = "At that scale"
    if facts["teacher"] and facts["student"]:
        scale += f" (a {_size(facts['teacher'])}-parameter teacher, a {_size(facts['student'])} student)"
    outcome = "the advantage appeared only where stated" if won else "the advantage did not appear"
    return (
        f"{REGIME_LEAD}, and what we measured there: {_WHY} We built that regime ({_FAMILY}) and measured it the "
        f"same way ({STUDY_FILE}, its {REGIME_FAMILY} section{': ' + how if how else ''}). {lead}: "
        f"{'; '.join(clauses)}. {scale} {outcome}; a larger teacher–student gap and longer training are the "
        f"conditions left untested. {_COST}"
    )


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
            bits.append(
                f"{LABELS[arm]}'s reverse KL was {trend} over its last {b['steps'] - a['steps']} steps "
                f"({a['reverse_kl']:.3g} → {b['reverse_kl']:.3g} on the curve prompts)"
            )
    start = (curves.get("opd") or [{}])[0]
    arm_steps = (eval_metrics.get("opd") or {}).get("budget", {}).get("steps")
    words = []
    if start.get("steps") is not None and arm_steps is not None:
        words.append(
            f"Budget: the SFT student both arms start from had {start['steps']} steps; each arm adds "
            f"{arm_steps - start['steps']}."
        )
    if teacher.get("exact_match") is not None:
        em = {a: (eval_metrics.get(a) or {}).get("exact_match") for a in ARMS}
        if all(v is not None for v in em.values()):
            words.append(
                f"The teacher's exact match is {teacher['exact_match']:.1%} against the arms' "
                f"{em['opd']:.1%} and {em['sft_continued']:.1%}, so neither student is near the ceiling"
                if max(em.values()) < teacher["exact_match"] - 0.05
                else f"The teacher's exact match is {teacher['exact_match']:.1%}, the arms' {em['opd']:.1%} "
                f"and {em['sft_continued']:.1%}"
            )
    if bits:
        words.append("; ".join(bits) + ".")
    return [" ".join(w if w.endswith(".") else w + "." for w in words), ""] if words else []
