"""A teacher completion cut at the teacher's length limit (finish_reason: length) is never taught to stop.

Such a completion gets no EOS: trained on without an end (``truncated_completions: keep``, the default) or
left out (``drop``), and counted either way in the stage's data counts, which must add up (every row kept or
dropped for one named reason, as ``ars-opd check`` verifies). The same rule holds for the SFT stage, its
control arm (sft_continued, which takes SFT's data rules) and OPD's teacher-text steps (GKD, λ < 1).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ars_opd.checks import Problems, check_data_counts
from ars_opd.config import ConfigError, OPDConfig, SFTConfig, parse_section
from ars_opd.data.prompts import alpaca_messages, encode_teacher_completions
from ars_opd.training.data_cost import generated_tokens
from ars_opd.training.opd.data import encode_rows
from ars_opd.training.sft import continued_sft_config, encode_sft_rows

ANSWERS = [("abc", "stop"), ("a long answer the teacher was cut off in", "length"), ("xy", "stop"), ("qq", "length")]


def _rows() -> list[dict]:
    return [
        {
            "id": str(i),
            "messages": alpaca_messages("Reverse the letters.", "abc"),
            "task": "reverse",
            "completion": text,
            "finish_reason": reason,
        }
        for i, (text, reason) in enumerate(ANSWERS)
    ]


def _text_ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _adds_up(counts: dict) -> bool:
    problems = Problems()
    check_data_counts(Path("manifest.json"), counts, problems)
    return not problems


def test_only_completions_the_teacher_ended_get_an_eos(char_tokenizer):
    tok, rows = char_tokenizer, _rows()
    got = encode_teacher_completions(tok, rows)
    for (text, reason), ids in zip(ANSWERS, got):
        want = _text_ids(tok, text) + ([tok.eos_token_id] if reason == "stop" else [])
        assert ids == want, (text, reason)
    # what the data cost charges is exactly what is trained on: the text, and the EOS where there is one
    assert generated_tokens(tok, rows) == [len(ids) for ids in got]


@pytest.mark.parametrize("rule", ["keep", "drop"])
def test_sft_keeps_truncated_rows_without_an_end_or_drops_them(char_tokenizer, rule):
    tok, rows = char_tokenizer, _rows()
    data = encode_sft_rows(tok, rows, SFTConfig(truncated_completions=rule))
    kept_answers = [a for a in ANSWERS if rule == "keep" or a[1] == "stop"]
    assert data.completions == [
        _text_ids(tok, text) + ([tok.eos_token_id] if reason == "stop" else []) for text, reason in kept_answers
    ]
    assert data.generated == [len(c) for c in data.completions]  # each kept row charged what it trains on
    assert data.counts["teacher_truncated"] == 2
    assert data.counts["dropped_teacher_truncated"] == (2 if rule == "drop" else 0)
    assert data.counts["kept"] == len(kept_answers) and _adds_up(data.counts)
    # the control arm trains under SFT's data rules
    assert continued_sft_config(SFTConfig(truncated_completions=rule), OPDConfig()).truncated_completions == rule


def test_a_truncated_row_cut_further_by_the_budget_has_no_eos_either(char_tokenizer):
    """``max_completion_tokens`` cuts a kept truncated row like any other; nothing puts an EOS back."""
    tok, rows = char_tokenizer, _rows()
    data = encode_sft_rows(tok, rows, SFTConfig(max_completion_tokens=5))
    assert data.completions[1] == _text_ids(tok, ANSWERS[1][0])[:5]
    assert data.counts["completion_truncated"] == 1 and _adds_up(data.counts)


@pytest.mark.parametrize("rule, lam, dropped", [("keep", 0.5, 0), ("drop", 0.5, 2), ("drop", 1.0, 0)])
def test_opd_teacher_text_follows_the_same_rule(char_tokenizer, rule, lam, dropped):
    """OPD trains on teacher text only on its GKD teacher steps (λ < 1): there a truncated completion has no
    EOS, or its row is dropped; with λ = 1 its prompt stays (the completion is never read)."""
    tok, rows = char_tokenizer, _rows()
    data = encode_rows(tok, rows, OPDConfig(on_policy_fraction=lam, truncated_completions=rule))
    prompts, completions, counts = data.prompts, data.completions, data.counts
    ended = [a for a in ANSWERS if not (dropped and a[1] == "length")]
    assert completions == [
        _text_ids(tok, text) + ([tok.eos_token_id] if reason == "stop" else []) for text, reason in ended
    ]
    assert len(prompts) == len(ANSWERS) - dropped
    assert counts["teacher_truncated"] == 2 and counts["dropped_teacher_truncated"] == dropped
    assert _adds_up(counts)


def test_the_rule_is_a_validated_param():
    assert SFTConfig().truncated_completions == OPDConfig().truncated_completions == "keep"  # the faithful default
    with pytest.raises(ConfigError, match="sft.truncated_completions"):
        parse_section(SFTConfig, {"truncated_completions": "cut"}, "sft")
    assert dataclasses.replace(OPDConfig(), truncated_completions="drop").truncated_completions == "drop"


def test_data_counts_that_do_not_add_up_are_reported():
    assert not _adds_up({"rows": 4, "kept": 2, "dropped_teacher_truncated": 1, "teacher_truncated": 2})
    assert _adds_up({"rows": 4, "kept": 2, "dropped_teacher_truncated": 2, "teacher_truncated": 2})
