"""Exact match per task kind, from a recovery-style study's runs: where the teacher is better than the student, and
where each arm gains or loses against its seed's control.

A study page's headline exact match pools every checkable prompt; a teacher that is better on some kinds and worse
on others, or an arm that learns one kind and forgets another, is hidden by the pool. This reads each run's
``evaluate`` metrics (``exact_match_per_task``, ``examples_per_task``; the evaluation's own checker made them) and
prints one Markdown table: the shared models (base, start, teacher; the same in every run), the control and each
arm as a mean over seeds, and each arm's paired difference from the control with a 95% t-interval over seeds once
there are two or more. Counts are the checkable prompts of each kind.

With ``--rows`` (the held-out rows, for their references) it also reads each run's answers
(``data/evaluate/answers.jsonl``) and prints, for the arithmetic kinds, how often each model writes the operation out
("4 + 7 = 11") rather than the bare number the prompt asks for, and how often each form is right: a model that
copies a teacher's bare numbers may lose the working it computed with.

    python studies/per_task.py reports/larger_teacher/runs --arms xtok_sampled_loo xtok_vocab \
        --rows reports/larger_teacher/runs/start/eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ars_opd.data.answers import is_correct  # noqa: E402
from ars_opd.evaluation.stats import mean_ci  # noqa: E402

CONTROL = "sft"
SHARED = (("base", "base"), ("start", "sft"), ("teacher", "teacher"))
ARITHMETIC = ("nl_sum", "nl_difference")
# the operation written out before its result: "4 + 7 = 11", "19 - 11 is 8"
WRITTEN_OUT = re.compile(r"\d+\s*[-+]\s*\d+\s*(=|is\b)")


def load(root: Path, arms: list[str]) -> dict[str, dict[int, dict]]:
    """{arm: {seed: evaluate metrics}} for every arm run of ``root`` with metrics."""
    out: dict[str, dict[int, dict]] = {}
    for arm in arms:
        for path in sorted(root.glob(f"seed-*/{arm}/data/metrics/evaluate.json")):
            seed = int(path.parts[-5].removeprefix("seed-"))
            out.setdefault(arm, {})[seed] = json.loads(path.read_text())
    if not out:
        raise SystemExit(f"{root}: no run of {arms} has evaluate metrics")
    return out


def counts(metrics: dict) -> dict[str, int]:
    """Checkable prompts per kind: the kinds the checker scored, with their prompt counts."""
    scored = metrics["base"]["exact_match_per_task"]
    return {k: metrics["examples_per_task"][k] for k in sorted(scored)}


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def cell(values: list[float]) -> str:
    """Mean in points, with its 95% t-interval over seeds when there are two or more."""
    if len(values) < 2:
        return pct(values[0])
    m, lo, hi = mean_ci(values)
    return f"{pct(m)} [{pct(lo)}, {pct(hi)}]"


def diff_cell(values: list[float]) -> str:
    if len(values) < 2:
        return f"{100 * values[0]:+.1f} (1 seed)"
    m, lo, hi = mean_ci(values)
    return f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def table(runs: dict[str, dict[int, dict]]) -> str:
    first = next(iter(next(iter(runs.values())).values()))
    n = counts(first)
    arms = list(runs)
    seeds = {arm: sorted(runs[arm]) for arm in arms}
    head = ["kind", "prompts", *[label for label, _ in SHARED], "control"]
    for arm in arms:
        head += [arm, f"{arm} − control"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    kinds = [*n, "all checkable"]
    for kind in kinds:

        def em(metrics: dict, model: str) -> float:
            block = metrics[model]
            return block["exact_match"] if kind == "all checkable" else block["exact_match_per_task"][kind]

        row = [kind, str(sum(n.values()) if kind == "all checkable" else n[kind])]
        row += [pct(em(first, model)) for _, model in SHARED]
        control_by_seed = {s: em(m, "sft_continued") for arm in arms for s, m in runs[arm].items()}
        row.append(cell([control_by_seed[s] for s in sorted(control_by_seed)]))
        for arm in arms:
            own = [em(runs[arm][s], "opd") for s in seeds[arm]]
            row += [cell(own), diff_cell([o - control_by_seed[s] for o, s in zip(own, seeds[arm])])]
        lines.append("| " + " | ".join(row) + " |")
    used = ", ".join(f"{arm}: seeds {seeds[arm]}" for arm in arms)
    lines += [
        "",
        f"Exact match in points on the held-out checkable prompts, greedy; mean over seeds [95% t-interval] ({used}); "
        "each difference is paired by seed with that seed's control.",
    ]
    return "\n".join(lines)


def form_counts(answers: list[dict], rows: dict[str, dict], model: str) -> tuple[int, int, int, int]:
    """(arithmetic prompts, answers that write the operation out, of those right, bare answers right) for one
    model's answers (``answers.jsonl`` rows: id, task and one text per model)."""
    n = out = out_right = bare_right = 0
    for a in answers:
        if a["task"] not in ARITHMETIC:
            continue
        text, right = a[model], is_correct(rows[a["id"]], a[model])
        n += 1
        if WRITTEN_OUT.search(text):
            out += 1
            out_right += right
        else:
            bare_right += right
    return n, out, out_right, bare_right


def form_table(root: Path, arms: list[str], rows: dict[str, dict]) -> str:
    """The arithmetic kinds' answer forms, summed over each model's runs: the shared models from one run, a seed's
    control from the first of its arms' runs (every arm's run holds its seed's control), each arm over its seeds."""
    by_seed: dict[str, dict[str, list[dict]]] = {}
    for arm in arms:
        for path in sorted(root.glob(f"seed-*/{arm}/data/evaluate/answers.jsonl")):
            answers = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            by_seed.setdefault(path.parts[-5], {})[arm] = answers
    if not by_seed:
        raise SystemExit(f"{root}: no run of {arms} has data/evaluate/answers.jsonl")
    counted: dict[str, list[tuple[int, int, int, int]]] = {}
    first_seed = next(iter(by_seed.values()))
    first = next(iter(first_seed.values()))
    for label, model in SHARED:
        counted[label] = [form_counts(first, rows, model)]
    counted["control"] = [form_counts(next(iter(runs.values())), rows, "sft_continued") for runs in by_seed.values()]
    for arm in arms:
        counted[arm] = [form_counts(runs[arm], rows, "opd") for runs in by_seed.values() if arm in runs]
    lines = [
        "| model | runs | arithmetic answers | written out | right when written out | right when bare |",
        "|---|---|---|---|---|---|",
    ]
    for label, parts in counted.items():
        if not parts:
            continue
        n, out, out_right, bare_right = (sum(x) for x in zip(*parts))
        lines.append(
            f"| {label} | {len(parts)} | {n} | {out} ({100 * out / n:.0f}%) | {out_right} of {out} | "
            f"{bare_right} of {n - out} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="a study root: seed-<s>/<arm>/data/metrics/evaluate.json")
    ap.add_argument("--arms", nargs="+", required=True, help="the arms' run names (not the control)")
    ap.add_argument(
        "--rows", type=Path, help="the held-out rows (eval.jsonl): also print the arithmetic answers' forms"
    )
    args = ap.parse_args(argv)
    print(table(load(args.root, args.arms)))
    if args.rows:
        rows = {r["id"]: r for r in map(json.loads, args.rows.read_text().splitlines()) if r}
        print()
        print(form_table(args.root, args.arms, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
