"""studies/per_task.py: the per-kind exact-match table's paired differences and the arithmetic answers' forms,
checked against sums done here by hand on made-up runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))

import per_task  # noqa: E402

T_975_DF1 = 12.706204736174707  # Student's t, 97.5% quantile at one degree of freedom (published tables)


def metrics(arm_em: dict[str, float], control_em: dict[str, float]) -> dict:
    shared = {"exact_match": 0.5, "exact_match_per_task": {"nl_sum": 0.5, "nl_capital": 0.5}}

    def block(em):
        return {"exact_match": sum(em.values()) / 2, "exact_match_per_task": em}

    return {
        "examples_per_task": {"nl_sum": 4, "nl_capital": 2, "nl_poem": 3},
        "base": shared,
        "sft": shared,
        "teacher": shared,
        "sft_continued": block(control_em),
        "opd": block(arm_em),
    }


def write_run(root: Path, seed: int, arm: str, m: dict, answers: list[dict] | None = None) -> None:
    run = root / f"seed-{seed}" / arm / "data"
    (run / "metrics").mkdir(parents=True)
    (run / "metrics" / "evaluate.json").write_text(json.dumps(m))
    if answers is not None:
        (run / "evaluate").mkdir()
        (run / "evaluate" / "answers.jsonl").write_text("\n".join(json.dumps(a) for a in answers) + "\n")


def test_paired_difference_and_interval_match_a_hand_computation(tmp_path):
    write_run(tmp_path, 1, "arm", metrics({"nl_sum": 0.25, "nl_capital": 1.0}, {"nl_sum": 0.5, "nl_capital": 0.5}))
    write_run(tmp_path, 2, "arm", metrics({"nl_sum": 0.75, "nl_capital": 0.5}, {"nl_sum": 0.5, "nl_capital": 0.5}))
    lines = per_task.table(per_task.load(tmp_path, ["arm"])).splitlines()
    row = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines if line.startswith("| nl_")}
    # nl_sum: differences -0.25 and +0.25: mean 0, sd sqrt(0.125), half-width t * sd / sqrt(2)
    half = T_975_DF1 * (0.125**0.5) / 2**0.5 * 100
    assert row["nl_sum"][-1].strip(" |") == f"{0:+.1f} [{-half:+.1f}, {half:+.1f}]"
    assert row["nl_sum"][1] == "4"  # the kind's prompt count, not the open-ended kind's
    assert "nl_poem" not in row  # a kind no rule checks is not a row
    # nl_capital: +0.5 and 0.0 -> mean +25 points
    assert row["nl_capital"][-1].strip(" |").startswith("+25.0 [")


def test_one_seed_says_so(tmp_path):
    write_run(tmp_path, 3, "arm", metrics({"nl_sum": 0.0, "nl_capital": 1.0}, {"nl_sum": 0.5, "nl_capital": 0.5}))
    text = per_task.table(per_task.load(tmp_path, ["arm"]))
    assert "-50.0 (1 seed)" in text and "seeds [3]" in text


def row(i: int, a: int, b: int, op: str) -> dict:
    ref = str(a + b if op == "+" else a - b)
    task = "nl_sum" if op == "+" else "nl_difference"
    question = f"What is {a} {op} {b}? Answer with just the number."
    return {"id": str(i), "task": task, "reference": ref, "messages": [{"role": "user", "content": question}]}


def test_answer_forms_are_counted_by_form_and_correctness(tmp_path):
    rows = {r["id"]: r for r in [row(0, 4, 7, "+"), row(1, 9, 3, "-"), row(2, 8, 9, "+")]}
    models = ("base", "opd", "sft", "teacher", "sft_continued")
    texts = {
        ("0", "nl_sum"): ("4 + 7 = 11", "11", "12", "11", "11"),
        ("1", "nl_difference"): ("9 - 3 is 6.", "7", "6", "6", "6"),
        ("2", "nl_sum"): ("8 + 9 = 16", "17", "17", "17", "1"),
        ("9", "nl_capital"): ("1 + 1 = 2", "", "", "", ""),
    }
    answers = [{"id": i, "task": task, **dict(zip(models, t))} for (i, task), t in texts.items()]
    assert per_task.form_counts(answers, rows, "base") == (3, 3, 2, 0)  # the capital row is not arithmetic
    assert per_task.form_counts(answers, rows, "opd") == (3, 0, 0, 2)
    write_run(tmp_path, 1, "arm", metrics({"nl_sum": 0, "nl_capital": 0}, {"nl_sum": 0, "nl_capital": 0}), answers)
    write_run(tmp_path, 2, "arm", metrics({"nl_sum": 0, "nl_capital": 0}, {"nl_sum": 0, "nl_capital": 0}), answers)
    write_run(tmp_path, 2, "other", metrics({"nl_sum": 0, "nl_capital": 0}, {"nl_sum": 0, "nl_capital": 0}), answers)
    table = per_task.form_table(tmp_path, ["arm", "other"], rows)
    # the control twice (seeds 1 and 2, seed 2's once although two arms hold it), the shared models once
    assert "| control | 2 | 6 | 0 (0%) | 0 of 0 | 4 of 6 |" in table
    assert "| base | 1 | 3 | 3 (100%) | 2 of 3 | 0 of 0 |" in table
    assert "| arm | 2 | 6 |" in table and "| other | 1 | 3 |" in table


def test_no_runs_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no run"):
        per_task.load(tmp_path, ["arm"])
