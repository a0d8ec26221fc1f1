"""The teacher's data cost: each row's generated tokens counted once, at the step that first draws it, by the
runs that pay for it; and the equal-budget view that adds 2·P_teacher per such token."""

from __future__ import annotations

import random

import pytest

from ars_opd.config import ControlConfig
from ars_opd.evaluation.equal_budget import compare, total_flops
from ars_opd.training.batch_plan import BatchGeometry, step_indices
from ars_opd.training.data_cost import TeacherText, charges_teacher_text, generated_tokens


def _brute_force(tokens, geometry, seeds, steps):
    """Per step, the tokens of the rows that step draws on any rank and no earlier step drew."""
    seen, out = set(), []
    for step in range(steps):
        drawn = set()
        for rank, seed in enumerate(seeds):
            drawn |= set(step_indices(step, len(tokens), geometry, seed, rank))
        out.append(sum(tokens[i] for i in drawn - seen))
        seen |= drawn
    return out, seen


@pytest.mark.parametrize("seeds", [(5, 5), (3, 8), (7, 7, 7, 7)])  # S1-1 (shared), per-rank seeds, 4 ranks
def test_each_row_is_charged_once_at_its_first_draw_and_a_resume_replays(seeds):
    rng = random.Random(0)
    tokens = [rng.randint(1, 60) for _ in range(37)]
    geometry = BatchGeometry.check(8, len(seeds), 2, "sft")
    want, seen = _brute_force(tokens, geometry, seeds, 40)  # several epochs: rows repeat, none is charged twice
    run = TeacherText(tokens, geometry, list(seeds))
    got = [run.new_tokens(s) for s in range(40)]
    assert got == want and sum(got) == sum(tokens[i] for i in seen)
    resumed = TeacherText(tokens, geometry, list(seeds))  # a run resumed at step 23 replays steps 0-22
    assert [resumed.new_tokens(s) for s in range(23, 40)] == want[23:]
    with pytest.raises(ValueError):
        resumed.new_tokens(5)
    assert TeacherText(tokens, geometry, list(seeds), charged=False).new_tokens(0) == 0


def test_generated_tokens_are_the_completion_and_its_eos(char_tokenizer):
    rows = [
        {"completion": "7+5=12", "finish_reason": "stop"},
        {"completion": "abcd", "finish_reason": "length"},  # cut at the limit: no EOS was generated
    ]
    assert generated_tokens(char_tokenizer, rows) == [7, 4]


def test_who_pays_for_teacher_text():
    repeat, fresh = ControlConfig(), ControlConfig(data="fresh", fresh_rows=10)
    assert charges_teacher_text("sft", repeat) and charges_teacher_text("sft", fresh)
    assert charges_teacher_text("sft_continued", fresh) and not charges_teacher_text("sft_continued", repeat)
    assert not charges_teacher_text("opd", fresh)


def test_the_data_cost_view_adds_two_teacher_flops_per_teacher_token():
    p_t = 1000

    start = {"steps": 10, "flops": 100.0, "teacher_tokens": 50, "exact_match": 0.5, "reverse_kl": 1.0}
    opd = [start, {**start, "steps": 20, "flops": 400.0, "exact_match": 0.7}]  # pays no teacher text
    ctl = [start, {**start, "steps": 20, "flops": 200.0, "teacher_tokens": 250, "exact_match": 0.6}]  # fresh rows
    ev = {
        "opd": {"exact_match": 0.7, "budget": opd[-1]},
        "sft_continued": {"exact_match": 0.6, "budget": ctl[-1]},
        "teacher": {"matmul_parameters": p_t},
        "curves": {"opd": opd, "sft_continued": ctl},
    }
    cmp = compare(ev)
    assert cmp["equal_flops"]["flops"] == 200.0  # the control is cheaper without the data cost
    assert [total_flops(p, p_t) for p in ctl] == [100.0 + 2 * p_t * 50, 200.0 + 2 * p_t * 250]
    # with it, OPD's end (400 + 100,000) is the cheaper total: the control is read at that total
    total = cmp["equal_total_flops"]
    assert total["flops"] == 400.0 + 2 * p_t * 50
    x0, x1 = 100.0 + 2 * p_t * 50, 200.0 + 2 * p_t * 250
    assert total["sft_continued"]["exact_match"] == pytest.approx(0.5 + 0.1 * (total["flops"] - x0) / (x1 - x0))
    assert total["opd"]["exact_match"] == pytest.approx(0.7)
    del ev["teacher"]["matmul_parameters"]
    assert compare(ev)["equal_total_flops"] == {}  # no teacher size known: no such view
