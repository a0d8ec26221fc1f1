"""The several-teachers study's page: does one student distilled from two specialists get both specialties?

``studies/multi_teacher.py`` runs the study: from one start (the SFT student of the specialists' completions), per
training seed, one OPD run per arm, the arms differing in the route alone (``ARMS``): each prompt to the specialist
that knows it (``routed``), every prompt to one specialist (``arith_only``, ``words_only``), and every prompt to one
teacher trained on every task at the same parameter count as one specialist (``general``). Each arm's student is then
evaluated with the specialists' route, so every arm is measured against the same reference: each held-out row
against the specialist that knows it (reverse KL), and exact match on each specialist's half of the tasks.

This module is text and arithmetic only: the runs are read by the study script. Each figure is the mean over seeds
with its 95% t-interval; differences between arms are paired by seed (the same start, the same data order and
rollout seeds up to what the arms themselves change) and reported the same way against the routed arm. Two budget
views: equal steps (the final models on every held-out row) and equal FLOPs (for each seed, every arm's learning
curve read off at the cheapest arm's final FLOPs, on the curve prompts; ``equal_budget.interpolate``'s rule, per
teacher's half). The positive control is the effect the design must see if it can see anything: a student
distilled from one specialist alone, measured on the other specialist's half, against the routed student.
"""

from __future__ import annotations

import math

import numpy as np

from ars_opd.evaluation.stats import mean_ci, one_difference
from ars_opd.evaluation.tables import fmt

# arm -> (label, what it is, the teachers section's route and default for its OPD run)
ARMS: dict[str, tuple[str, str, dict]] = {
    "routed": (
        "both specialists, routed",
        "each prompt to the specialist trained on its task (the route by task)",
        {"route": None, "default": None},  # None: the start's route (the specialists')
    ),
    "arith_only": (
        "the arithmetic specialist alone",
        "every prompt to the specialist trained on add, sort_digits and length",
        {"route": {}, "default": "arith"},
    ),
    "words_only": (
        "the letters specialist alone",
        "every prompt to the specialist trained on reverse and uppercase",
        {"route": {}, "default": "words"},
    ),
    "general": (
        "one teacher trained on every task",
        "every prompt to a teacher of a specialist's size trained on all five tasks",
        {"route": {}, "default": "general"},
    ),
}
REFERENCE = "routed"
HALVES = ("arith", "words")  # the specialists, and the halves of the tasks they know
METRICS = (
    ("exact_match", "exact match", "higher", True),
    ("reverse_kl", "reverse KL to the row's specialist (per token, own samples)", "lower", False),
    ("reverse_kl_fixed_prefix", "reverse KL at the specialist's fixed prefixes (per token)", "lower", False),
)


def _cell(values: list[float], pct: bool) -> str:
    m, lo, hi = mean_ci(values)
    if not math.isfinite(lo):
        return fmt(m, pct)
    return f"{fmt(m, pct)} [{fmt(lo, pct)}, {fmt(hi, pct)}]"


def _signed(values: list[float], pct: bool) -> str:
    m, lo, hi = mean_ci(values)

    def one(v: float) -> str:
        if pct:
            return f"{100 * v:+.1f}"
        return f"{v:+.3g}"

    unit = " pt" if pct else ""
    if not math.isfinite(lo):
        return f"{one(m)}{unit}"
    return f"{one(m)} [{one(lo)}, {one(hi)}]{unit}"


def difference(a: list[float], b: list[float]) -> dict:
    """a − b per seed, the mean's 95% interval, and whether it is resolved: the interval excludes 0, and the seeds did
    not all give the same difference (an interval with no width says nothing)."""
    values = [x - y for x, y in zip(a, b)]
    m, lo, hi = mean_ci(values)
    resolved = math.isfinite(lo) and (lo > 0 or hi < 0) and not one_difference(a, b)
    return {"values": values, "mean_ci": [m, lo, hi], "resolved": resolved}


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    pts = sorted(p for p in points if p[1] is not None and math.isfinite(p[1]))
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return float("nan")
    xs, ys = zip(*pts)
    return float(np.interp(x, xs, ys))


def final_values(evaluation: dict, model: str = "opd") -> dict[str, dict[str, float]]:
    """{half: {metric: value}} of ``model``'s final scores on every held-out row (equal steps), plus ``all``."""
    m = evaluation[model]
    out = {half: {k: (m.get("per_teacher") or {}).get(half, {}).get(k) for k, *_ in METRICS} for half in HALVES}
    out["all"] = {k: m.get(k) for k, *_ in METRICS}
    return out


def at_flops(curve: list[dict], x: float) -> dict[str, dict[str, float]]:
    """{half: {metric: value}} of a learning curve read off at FLOPs ``x`` (linear between its points)."""
    out = {}
    for half in HALVES:
        out[half] = {
            k: _interpolate([(p["flops"], ((p.get("per_teacher") or {}).get(half) or {}).get(k)) for p in curve], x)
            for k, *_ in METRICS
        }
    out["all"] = {k: _interpolate([(p["flops"], p.get(k)) for p in curve], x) for k, *_ in METRICS}
    return out


def views(by_seed: dict[int, dict[str, dict]]) -> dict[str, dict[str, dict[int, dict]]]:
    """{view: {arm: {seed: {half: {metric: value}}}}} for the two budget views, from each seed's evaluations by arm.
    Equal FLOPs: each seed's arms read off at the seed's cheapest arm's final FLOPs."""
    steps: dict[str, dict[int, dict]] = {}
    flops: dict[str, dict[int, dict]] = {}
    for seed, arms in by_seed.items():
        finals = {arm: ev["curves"]["opd"][-1]["flops"] for arm, ev in arms.items()}
        x = min(finals.values())
        for arm, ev in arms.items():
            steps.setdefault(arm, {})[seed] = final_values(ev)
            flops.setdefault(arm, {})[seed] = {**at_flops(ev["curves"]["opd"], x), "flops": x}
    return {"equal_steps": steps, "equal_flops": flops}


def _series(view: dict[str, dict[int, dict]], arm: str, half: str, metric: str, seeds: list[int]) -> list[float]:
    return [view[arm][s][half][metric] for s in seeds if s in view.get(arm, {})]


def _paired(view, arm: str, half: str, metric: str, seeds: list[int]) -> dict:
    """arm − routed, per seed that has both (``difference``)."""
    both = [s for s in seeds if s in view.get(arm, {}) and s in view.get(REFERENCE, {})]
    return difference([view[arm][s][half][metric] for s in both], [view[REFERENCE][s][half][metric] for s in both])


def summary(by_seed: dict[int, dict[str, dict]], start: dict[int, dict]) -> dict:
    """The study's numbers: for each view, arm, half and metric the mean and 95% interval over seeds, and the paired
    difference from the routed arm; the SFT start's; the positive control; each arm's rollouts at the end."""
    seeds = sorted(by_seed)
    out: dict = {"seeds": seeds, "views": {}}
    for name, view in views(by_seed).items():
        table = {}
        for arm in ARMS:
            if arm not in view:
                continue
            table[arm] = {}
            for half in (*HALVES, "all"):
                table[arm][half] = {}
                for metric, *_ in METRICS:
                    values = _series(view, arm, half, metric, seeds)
                    entry = {"values": values, "mean_ci": list(mean_ci(values))}
                    if arm != REFERENCE:
                        entry["minus_routed"] = _paired(view, arm, half, metric, seeds)
                    table[arm][half][metric] = entry
        out["views"][name] = table
        if name == "equal_flops":
            out["equal_flops_at"] = {s: view[REFERENCE][s]["flops"] for s in seeds if s in view.get(REFERENCE, {})}
    out["start"] = {
        half: {metric: list(mean_ci([start[s][half][metric] for s in seeds if s in start])) for metric, *_ in METRICS}
        for half in (*HALVES, "all")
    }
    steps = views(by_seed)["equal_steps"]
    out["positive_control"] = {
        "arith_only on the letters half": _paired(steps, "arith_only", "words", "exact_match", seeds),
        "words_only on the arithmetic half": _paired(steps, "words_only", "arith", "exact_match", seeds),
    }
    return out


def verdict(s: dict) -> list[str]:
    """The verdict in words, from the equal-steps and equal-FLOPs tables: does the routed student keep each
    specialty (against the student of that specialist alone, on its half), and how does it compare with the student
    of one teacher trained on everything."""
    lines = []
    for view, words in (("equal_steps", "At equal steps"), ("equal_flops", "At equal FLOPs")):
        t = s["views"].get(view) or {}
        if REFERENCE not in t:
            continue
        parts = []
        for arm, half, name in (("arith_only", "arith", "arithmetic"), ("words_only", "words", "letters")):
            if arm not in t:
                continue
            d = t[arm][half]["exact_match"]["minus_routed"]
            m, lo, hi = d["mean_ci"]  # the specialist alone − routed
            c, clo, chi = 0.0 - m, 0.0 - hi, 0.0 - lo  # routed − the specialist alone (0.0 -: no signed zero)
            interval = f"routed − {name} specialist alone {100 * c:+.1f} [{100 * clo:+.1f}, {100 * chi:+.1f}] points"
            if d["resolved"]:
                side = "lost" if c < 0 else "gained"
                parts.append(
                    f"on the {name} half the routed student {side} {abs(100 * c):.1f} exact-match points against "
                    f"the student of the {name} specialist alone ({interval})"
                )
            else:
                parts.append(
                    f"on the {name} half the routed student was not resolved from the {name} specialist's ({interval})"
                )
        if "general" in t:
            d = t["general"]["all"]["exact_match"]["minus_routed"]
            m, lo, hi = d["mean_ci"]
            if d["resolved"]:
                better = "routed" if m < 0 else "single-teacher"
                parts.append(
                    f"overall the {better} student was ahead of the other by {abs(100 * m):.1f} points "
                    f"(single teacher − routed {100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}])"
                )
            else:
                parts.append(
                    f"overall the routed student and the single teacher's were not resolved "
                    f"(single teacher − routed {100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points)"
                )
        lines.append(f"{words}: " + "; ".join(parts) + ".")
    return lines


def render(s: dict, meta: dict) -> str:
    """The page (markdown) from ``summary``'s numbers and the study's record (``meta``: command, wall time, seeds,
    steps, the teachers' own scores)."""
    md = [
        "# Several teachers, one student: two specialists distilled into one student through a route",
        "",
        "The question: when the teacher that knows each kind of prompt best is not the same model, does one student "
        "distilled from both, each prompt scored by the teacher that knows it (`teachers.route`), get both "
        "specialties, and at what cost to each? From one SFT start, per training seed, one OPD run per arm, the arms "
        "differing in the route alone:",
        "",
    ]
    for arm, (label, what, _) in ARMS.items():
        md.append(f"- **{label}** (`{arm}`): {what}.")
    teachers = meta.get("teachers") or {}
    md += [
        "",
        f"The teachers are built by the models stage at one size ({teachers.get('params', 'n/a')} parameters each, "
        f"`models.teacher_arch`): the arithmetic specialist trained {meta.get('specialist_steps', 'n/a')} steps on "
        f"add, sort_digits and length, the letters specialist {meta.get('specialist_steps', 'n/a')} steps on reverse "
        f"and uppercase, and the single teacher (`models.teacher`) {meta.get('teacher_steps', 'n/a')} steps on all "
        f"five (batches of 64). Their exact match per task on {teachers.get('eval_examples', 'n/a')} fresh "
        "prompts of every task (the models stage's own scoring):",
        "",
        "| teacher | add | sort_digits | length | reverse | uppercase |",
        "|---|---|---|---|---|---|",
    ]
    for name, per_task in (teachers.get("per_task") or {}).items():
        md.append(
            f"| {name} | "
            + " | ".join(fmt(per_task.get(t), True) for t in ("add", "sort_digits", "length", "reverse", "uppercase"))
            + " |"
        )
    md += [
        "",
        f"Setup: {meta.get('setup', '')}",
        "",
        "Every arm's student is evaluated with the specialists' route: each held-out row against the specialist that "
        "knows it, so every arm is measured against the same reference. Halves: the arithmetic half is add, "
        "sort_digits and length; the letters half reverse and uppercase. Cells: mean over "
        f"{len(s['seeds'])} paired training seeds ({', '.join(map(str, s['seeds']))}) with its 95% t-interval; "
        '"− routed" is the arm minus the routed arm, paired by seed.',
        "",
    ]
    start = s["start"]
    for view, title in (("equal_steps", "At equal steps"), ("equal_flops", "At equal FLOPs")):
        t = s["views"].get(view) or {}
        if not t:
            continue
        note = (
            "the final models, every held-out row"
            if view == "equal_steps"
            else "each arm's learning curve read off at its seed's cheapest arm's final FLOPs, on the curve prompts"
        )
        md += [f"## {title}", "", f"({note}.)", ""]
        for metric, label, better, pct in METRICS:
            md += [
                f"**{label}** ({better} is better):",
                "",
                "| arm | arithmetic half | − routed | letters half | − routed | all rows | − routed |",
                "|---|---|---|---|---|---|---|",
            ]
            if view == "equal_steps":
                cells = [cell for h in (*HALVES, "all") for cell in (fmt(start[h][metric][0], pct), "–")]
                md.append("| the SFT start | " + " | ".join(cells) + " |")
            for arm, (label_arm, _, _) in ARMS.items():
                if arm not in t:
                    continue
                cells = []
                for half in (*HALVES, "all"):
                    e = t[arm][half][metric]
                    cells.append(_cell(e["values"], pct))
                    cells.append("–" if arm == REFERENCE else _signed(e["minus_routed"]["values"], pct))
                md.append(f"| {label_arm} | " + " | ".join(cells) + " |")
            md.append("")
    pc = s["positive_control"]
    md += [
        "## The positive control",
        "",
        "What the design must see if it can see anything: a student distilled from one specialist alone is pulled, "
        "on the other half's prompts, towards a teacher that never learned them. Its exact match there against the "
        "routed student's (equal steps, paired by seed):",
        "",
        "| comparison | difference | resolved |",
        "|---|---|---|",
    ]
    for name, e in pc.items():
        md.append(f"| {name} | {_signed(e['values'], True)} | {'yes' if e['resolved'] else 'no'} |")
    md += ["", "## Verdict", ""]
    md += verdict(s)
    md += [
        "",
        "## How it was run",
        "",
        f"`{meta.get('command', '')}`: {meta.get('wall', 'n/a')} on {meta.get('device', 'n/a')}, "
        f"{meta.get('start_wall', 'n/a')}; code at `{meta.get('commit', 'n/a')}`. The page is written again from the "
        "finished runs with `--report-only`.",
        "",
    ]
    return "\n".join(md)
