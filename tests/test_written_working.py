"""studies/written_working.py: the rewrite changes only the arithmetic answers' form, and the summary's paired
differences and interval match a hand computation."""

from __future__ import annotations

import json
import math

import pytest

from micro import load_study


def _study():
    return load_study("written_working")


def _row(task: str, prompt: str, completion: str) -> dict:
    return {"id": prompt, "task": task, "messages": [{"role": "user", "content": prompt}], "completion": completion}


def test_only_arithmetic_answers_are_written_out_keeping_the_teachers_number(tmp_path):
    ww = _study()
    rows = [
        _row("nl_sum", "What is 4 + 7? Answer with just the number.", "11"),
        _row("nl_sum", "What is 9 + 9? Answer with just the number.", "17"),  # wrong, and stays wrong
        _row("nl_difference", "What is 3 - 8? Answer with just the number.", "The answer is -5."),
        _row("nl_difference", "What is 6 - 2? Answer with just the number.", "four"),  # no number: left alone
        _row("nl_capital", "What is the capital of Chad?", "N'Djamena, 2 words"),
    ]
    source, dest = tmp_path / "teacher", tmp_path / "written"
    source.mkdir()
    (source / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = ww.write_teacher(source, dest)
    out = [json.loads(line) for line in (dest / "train.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in out] == ["4 + 7 = 11", "9 + 9 = 17", "3 - 8 = -5", "four", "N'Djamena, 2 words"]
    assert [{k: v for k, v in r.items() if k != "completion"} for r in out] == [
        {k: v for k, v in r.items() if k != "completion"} for r in rows
    ]
    assert counts == {"train": {"rewritten": 3, "arithmetic": 4, "rows": 5}}
    assert all(ww.WRITTEN.search(r["completion"]) for r in out[:3]) and not ww.WRITTEN.search("11")


def test_summary_is_the_paired_difference_in_points_with_its_t_interval():
    ww = _study()
    scores = {
        "base": {"correct": 22, "n": 54},
        "seed-0/teacher_text": {"correct": 11, "n": 54},
        "seed-0/written_out": {"correct": 20, "n": 54},
        "seed-1/teacher_text": {"correct": 13, "n": 54},
        "seed-1/written_out": {"correct": 19, "n": 54},
    }
    out = ww.summary(scores, [0, 1])
    d = [100 * 9 / 54, 100 * 6 / 54]
    half = 12.706204736 * abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2)  # t(0.975, 1); sd of two = |a - b| / sqrt 2
    got = out["written_out_minus_teacher_text_points"]
    assert got["per_seed"] == pytest.approx(d) and got["mean"] == pytest.approx(sum(d) / 2)
    assert got["ci95"] == pytest.approx([sum(d) / 2 - half, sum(d) / 2 + half], rel=1e-6)
    assert out["positive_control_base_minus_start_points"] == pytest.approx(100 * 11 / 54)
