"""The long-horizon step metrics of the evaluation, against a count by hand, and the answer-room check."""

from __future__ import annotations

import pytest

from ars_opd.config import ConfigError
from ars_opd.data import synthetic
from ars_opd.evaluation.evaluate import check_answer_room
from ars_opd.evaluation.steps import step_metrics

REF3 = "7+5=12, 12+9=21, 21+3=24"
REF2 = "1+1=2, 2+2=4"


def test_step_metrics_count_by_hand():
    tasks = ["running_sum", "running_sum", "running_sum", "add", "running_sum"]
    refs = [REF3, REF3, REF2, "12", REF3]
    answers = [
        REF3,  # right throughout
        "7+5=12, 12+9=22, 22+3=25",  # first error at step 1
        "1+1=3, 3+2=5",  # first error at step 0
        "13",  # not a long-horizon task: left out
        REF3 + ", 24+1=25",  # every step right, then one more: first error at 3
    ]
    m = step_metrics(tasks, answers, refs)
    assert m["answers"] == 4
    assert m["step_accuracy"] == pytest.approx((1 + 1 / 3 + 0 + 1) / 4)
    # prefix s: among answers whose reference has > s steps, all of the first s+1 steps right
    assert m["prefix_accuracy"] == pytest.approx([3 / 4, 2 / 4, 2 / 3])
    assert m["first_error"] == {"0": 1, "1": 1, "3": 1, "none": 1}
    assert step_metrics(["add"], ["1"], ["1"]) is None  # the default tasks: no step metrics at all


def test_the_evaluation_refuses_a_budget_that_cuts_a_reference(char_tokenizer):
    rows = synthetic.generate(50, seed=3, tasks=("running_sum",))
    rows = [{"task": r["task"], "reference": r["output"]} for r in rows]
    longest = max(len(r["reference"]) for r in rows) + 1  # one token a character, and EOS
    check_answer_room(char_tokenizer, rows, longest)
    with pytest.raises(ConfigError) as e:
        check_answer_room(char_tokenizer, rows, longest - 1)
    assert e.value.key == "evaluate.max_new_tokens" and f"at least {longest}" in str(e.value)
    check_answer_room(char_tokenizer, [{"task": None, "reference": "x" * 500}], 16)  # not checkable: no limit
