"""opd.rollout_dtype: bf16: rollouts from a bf16 copy of the student that holds each step's weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ars_opd.config import ConfigError, OPDConfig, ParallelConfig, Params, check_objective, check_params
from ars_opd.data import synthetic
from ars_opd.lm.generation import generate_token_ids
from ars_opd.lm.rollout_copy import CastCopy
from ars_opd.models.builtin import build_causal_lm
from ars_opd.models.tokenizer import build_char_word_tokenizer
from tiny_models import TINY

REPO = Path(__file__).resolve().parents[1]


def _model_and_tokenizer():
    tok = build_char_word_tokenizer(synthetic.instruction_words())
    return build_causal_lm(TINY, tok, seed=4).float(), tok


def test_the_copy_holds_the_present_weights_cast_and_is_refreshed_in_place():
    model, _ = _model_and_tokenizer()
    caster = CastCopy(torch.bfloat16)
    first = caster.of(model)
    for p, q in zip(first.parameters(), model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16))
    storage = [p.data_ptr() for p in first.parameters()]
    with torch.no_grad():  # an optimizer step
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    again = caster.of(model)
    assert again is first and [p.data_ptr() for p in again.parameters()] == storage  # refreshed, not re-made
    for p, q in zip(again.parameters(), model.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trained student is untouched


def test_rollouts_from_the_copy_are_those_of_the_student_cast_to_bf16():
    """Greedy, so the comparison is exact: the copy decodes what an independent bf16 cast of the student decodes."""
    model, tok = _model_and_tokenizer()
    chats = [[{"role": "user", "content": q}] for q in ("add 3 and 4", "reverse abc")]
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"]) for c in chats]
    caster = CastCopy(torch.bfloat16)
    caster.of(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    got = generate_token_ids(caster.of(model), tok, prompts, 8)
    want = generate_token_ids(copy.deepcopy(model).to(torch.bfloat16), tok, prompts, 8)
    assert got == want


@pytest.mark.parametrize(
    "opd, ddp, key",
    [
        ({"loss": "sampled_token"}, None, "opd.rollout_dtype"),
        ({"rollouts": "engine"}, None, "opd.rollout_dtype"),
        ({}, {"strategy": "fsdp"}, "opd.rollout_dtype"),
    ],
)
def test_the_bf16_copy_is_refused_where_it_cannot_serve(opd, ddp, key):
    cfg = OPDConfig(rollout_dtype="bf16", **opd)
    with pytest.raises(ConfigError) as e:
        if ddp is None:
            check_objective(cfg)
        else:
            check_params(Params(opd=cfg, ddp=ParallelConfig(**ddp)))
    assert e.value.key == key
    check_objective(OPDConfig(rollout_dtype="bf16"))  # full_vocab on trainer rollouts: fine


@pytest.mark.slow
@pytest.mark.ddp
def test_the_opd_stage_trains_with_bf16_rollouts(tmp_path):
    from micro import distill_workspace, run_opd_in

    opd = {"steps": 3, "global_batch_size": 8, "micro_batch_size": 4, "max_new_tokens": 6, "rollout_dtype": "bf16",
           "checkpoint_every": 0, "snapshot_every": 0, "warmup_steps": 1, "lr": 0.005}  # fmt: skip
    distill_workspace(REPO, tmp_path, opd, workers=2)
    steps, _, _ = run_opd_in(tmp_path)
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["loss"] >= 0 and 1 <= r["task/response_length"] <= 6 for r in steps)
