"""Rollouts with a static KV cache against transformers' generate, and the on-device sampler against its law."""

from __future__ import annotations

import random

import pytest
import torch

from ars_opd.lm.decoding import generate_static, sample_next
from ars_opd.lm.generation import generate_token_ids

EOS, PAD = 2, 0


class _Tok:
    pad_token_id, eos_token_id = PAD, EOS


def _model(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    cfg = cls(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: greedy paths are not decided by rounding
    return model


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_cache_greedy_equals_generate(family):
    model = _model(family)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randint(1, 21))] for _ in range(9)]  # widths across buckets
    dynamic = generate_token_ids(model, _Tok, prompts, 14, batch_size=9)
    static = generate_token_ids(model, _Tok, prompts, 14, batch_size=9, cache="static")
    assert static == dynamic
    assert any(len(r) < 14 and r[-1] == EOS for r in dynamic) and any(len(r) == 14 for r in dynamic)
    # the cache is kept across calls: a longer call grows it, a shorter one reuses it after a reset
    for width in (70, 3):
        more = [[rng.randrange(3, 40) for _ in range(rng.randint(1, width))] for _ in range(9)]
        assert generate_token_ids(model, _Tok, more, 14, batch_size=9, cache="static") == generate_token_ids(
            model, _Tok, more, 14, batch_size=9
        )


def test_rows_that_ended_decode_padding():
    model = _model("llama", seed=3)
    prompts = [[5, 6, 7], [9] * 12]
    full = generate_static(model, prompts, PAD, EOS, 10)
    cut = generate_token_ids(model, _Tok, prompts, 10, cache="static")
    for row, kept in zip(full, cut):
        assert row[: len(kept)] == kept and len(row) == 10
        if kept and kept[-1] == EOS:
            assert row[len(kept) :] == [PAD] * (10 - len(kept))


def test_sampler_follows_temperature_and_nucleus():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 200_000
    g = torch.Generator().manual_seed(5)
    for tau, top_p in ((1.0, 1.0), (0.6, 1.0), (1.0, 0.8)):
        probs = torch.softmax(logits.double() / tau, -1)
        if top_p < 1:  # the smallest set of most likely tokens holding >= top_p of the mass
            keep = (probs.cumsum(-1) - probs) < top_p
            probs = torch.where(keep, probs, 0.0)
            probs /= probs.sum()
        draws = sample_next(logits.expand(n, -1), tau, top_p, g)
        freq = torch.bincount(draws, minlength=6).double() / n
        assert (freq[probs == 0] == 0).all()
        # binomial standard error at n = 200k is below 1.2e-3; 5 of them
        assert (freq - probs).abs().max() < 6e-3, (tau, top_p, freq, probs)
    assert sample_next(logits[None], 0.0, 1.0, g).item() == 0  # temperature 0: greedy


def test_static_sampling_first_token_follows_the_models_distribution():
    model = _model("llama", seed=4)
    prompt = [7, 8, 9, 10]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / 0.8, -1)
    torch.manual_seed(11)
    draws = generate_static(model, [prompt] * 4000, PAD, EOS, 1, do_sample=True, temperature=0.8)
    freq = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=40).double() / 4000
    assert (freq - probs).abs().max() < 0.04  # 4000 draws: binomial standard error below 8e-3


def test_sampler_never_draws_a_zero_probability_token_and_follows_a_wide_law():
    """Tokens of probability exactly 0 (first, last and between; a -inf logit) own an empty interval of the
    inverse CDF, so no draw lands on them; over a vocabulary of 2,000 with most of the mass in a long tail the
    frequencies of the tail's buckets match the law (float64 oracle). Drawn 10,000 rows at a time: a (rows, V)
    batch of probabilities and its float64 CDF take 16 bytes a cell."""
    g = torch.Generator().manual_seed(3)
    logits = torch.tensor([-float("inf"), 0.0, -float("inf"), 0.5, -float("inf")])
    draws = sample_next(logits.expand(100_000, -1), 1.0, 1.0, g)
    assert set(draws.unique().tolist()) == {1, 3}
    frac = (draws == 3).double().mean().item()
    p3 = torch.softmax(logits.double(), -1)[3].item()
    assert abs(frac - p3) < 5 * (p3 * (1 - p3) / 100_000) ** 0.5  # 5 binomial standard errors

    wide = torch.randn(2000, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 0.5
    wide[0] = 5.0  # one heavy token, the rest a long flat tail
    probs = torch.softmax(wide, -1)
    n, rows = 200_000, 10_000
    got = torch.cat([sample_next(wide.float().expand(rows, -1), 1.0, 1.0, g) for _ in range(n // rows)])
    buckets = torch.arange(2000) // 200  # ten buckets of 200 tokens (token 0 alone carries ~6%)
    freq = torch.bincount(buckets[got], minlength=10).double() / n
    law = torch.zeros(10, dtype=torch.float64).index_add_(0, buckets, probs)
    se = (law * (1 - law) / n).sqrt()
    assert ((freq - law).abs() <= 5 * se + 1e-6).all(), (freq, law)  # + fp32 logits' rounding of the law


def test_static_prefill_gives_the_head_a_contiguous_row():
    """The prefill's last position reaches the head as its own contiguous (B, 1, H) row (an index, not a slice of
    the (B, T, H) hidden states, which a bf16 head on CPU would serve by copying its weight B times); greedy
    equality with ``generate`` (above) covers the values."""
    model = _model("llama", seed=6)
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
        generate_static(model, prompts, PAD, None, 2)
    finally:
        handle.remove()
    prefill = seen[0]
    assert prefill.shape == (2, 1, 32) and prefill.is_contiguous()
