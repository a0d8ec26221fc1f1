"""Rollouts and evaluation decode by the pipeline's policy alone, whatever the checkpoint's generation_config says.

A real model's ``generation_config.json`` carries sampling defaults (a repetition penalty, min_p...) and may
list several EOS ids. The model here has both: a repetition penalty of 1.3, min_p 0.05, and EOS ids
{2, 3} while its tokenizer names only 2. Oracles, independent of generation:

- sampled tokens' frequencies on a fixed prefix against softmax(z/τ) (nucleus-restricted) of a plain forward
  in float64, by a chi-squared test (p-value from the regularised incomplete gamma function);
- greedy ids against a brute-force loop of full forwards and argmax, stopping at either EOS;
- raw rollouts (not cut afterwards): after the first of either EOS id only padding follows.

Both rollout paths are covered (``opd.rollout_cache``: dynamic = transformers' generate, static = the decode
loop of ``ars_opd.lm.decoding``) and greedy evaluation (``ars_opd.evaluation.evaluate.score_model``).
"""

from __future__ import annotations

import random

import pytest
import torch

from ars_opd.lm.generation import eos_token_ids, generate_token_ids
from tiny_models import tiny_llama
from tolerances import forward_bound, two_computations

PAD, EOS_A, EOS_B = 0, 2, 3  # the tokenizer's EOS is EOS_A; the model's generation_config also stops at EOS_B
VOCAB = 40


class _Tok:
    pad_token_id, eos_token_id = PAD, EOS_A


def _model(seed: int, scale: float, vocab: int = VOCAB, eos: int = EOS_A, pad: int = PAD, second_eos: int = EOS_B):
    """A tiny Llama (output head scaled by ``scale``: larger logits) whose checkpoint generation config would
    change what generate samples and where it stops: repetition penalty 1.3, min_p 0.05, EOS ids [eos,
    second_eos]."""
    model = tiny_llama(vocab, seed, eos, pad, head_scale=scale, attn_implementation=None).eval()
    g = model.generation_config
    g.repetition_penalty, g.min_p, g.eos_token_id = 1.3, 0.05, [eos, second_eos]
    return model


def _law(model, prefix: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """The next-token law of the policy: softmax(z/τ) restricted to the smallest set of most likely tokens
    holding at least top_p of the mass, renormalised; z from a plain forward of the prefix, in float64."""
    with torch.no_grad():
        z = model.double()(input_ids=torch.tensor([prefix])).logits[0, -1]
    model.float()
    p = torch.softmax(z / temperature, -1)
    if top_p < 1:
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]  # mass of the tokens more likely than each
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order] = before < top_p
        p = torch.where(keep, p, 0.0)
        p = p / p.sum()
    return p


def _chi_squared_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` against ``probs``: categories with an expected count below 5 pooled into one
    (the usual validity condition of the chi-squared approximation); p = Q(df/2, X²/2)."""
    n = counts.sum()
    expected = probs * n
    assert counts[probs == 0].sum() == 0, "a token the policy excludes was sampled"
    small = (expected < 5) & (probs > 0)
    obs = torch.cat([counts[~small & (probs > 0)], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small & (probs > 0)], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_tokens_follow_the_models_softmax(cache, temperature, top_p):
    model = _model(seed=0, scale=15.0)
    rng = random.Random(0)
    law0 = _law(model, [5, 6, 7], 1.0, 1.0)
    # the prefix holds the most likely next tokens, where a repetition penalty would move the most mass
    prefix = [int(t) for t in law0.argsort(descending=True)[:8]] + [rng.randrange(4, VOCAB) for _ in range(4)]
    probs = _law(model, prefix, temperature, top_p)
    n = 6000
    torch.manual_seed(1)
    draws = generate_token_ids(
        model,
        _Tok,
        [prefix] * n,
        1,
        batch_size=n,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        cache=cache,
        stop_at_eos=False,
    )
    counts = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=VOCAB).double()
    # 1e-6: the chance that this fixed-seed test fails although the sampler follows the law is below it; the
    # checkpoint's repetition penalty and min_p move the law by a chi-squared noncentrality of about 900 at
    # this n (df about 37), so a sampler under them fails by many orders of magnitude
    assert _chi_squared_p_value(counts, probs) > 1e-6
    # the model's own generation config is back after the call (a published model keeps its own)
    assert model.generation_config.repetition_penalty == 1.3 and model.generation_config.eos_token_id == [2, 3]


def test_eos_ids_are_the_tokenizers_and_the_generation_configs():
    model = _model(seed=0, scale=1.0)
    assert eos_token_ids(model, _Tok) == (EOS_A, EOS_B)
    model.generation_config.eos_token_id = 7  # one id, not the tokenizer's
    assert eos_token_ids(model, _Tok) == (EOS_A, 7)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_either_eos_id_stops_a_rollout(cache):
    model = _model(seed=2, scale=2.0)
    rng = random.Random(3)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(300)]
    torch.manual_seed(4)
    raw = generate_token_ids(model, _Tok, prompts, 24, batch_size=300, do_sample=True, cache=cache, stop_at_eos=False)
    ended_by = {EOS_A: 0, EOS_B: 0}
    for row in raw:
        first = next((i for i, t in enumerate(row) if t in ended_by), None)
        if first is None:
            continue
        ended_by[row[first]] += 1
        # the row stopped there: nothing but padding after its first EOS, whichever id it was
        assert all(t == PAD for t in row[first + 1 :]), (row, first)
    assert ended_by[EOS_A] > 0 and ended_by[EOS_B] > 0, ended_by  # both ids occurred, so both were tested
    torch.manual_seed(4)
    cut = generate_token_ids(model, _Tok, prompts, 24, batch_size=300, do_sample=True, cache=cache)
    for row, kept in zip(raw, cut):  # kept: up to and including the first EOS of either id
        assert row[: len(kept)] == kept
        assert all(t not in (EOS_A, EOS_B) for t in kept[:-1])


def _greedy_oracle(model, prompt: list[int], max_new: int, ends: set[int]) -> list[int]:
    """Greedy by brute force: a full forward of the whole sequence per token, argmax, stop at any id of ``ends``.

    Each argmax must be decided by more than rounding: its margin over the runner-up above twice the bound on
    a logit's fp32 error in one forward (``tolerances.forward_bound``), so that generate's batched, cached
    forwards pick the same token (else the seed is no test of the decoding policy)."""
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            z = model(input_ids=torch.tensor([prompt + ids])).logits[0, -1]
            top = z.topk(2).values
            bound = two_computations(forward_bound(model.config, len(prompt) + len(ids), float(z.abs().max())))
            assert float(top[0] - top[1]) > bound, "a near-tie: greedy is decided by rounding here"
            ids.append(int(z.argmax()))
            if ids[-1] in ends:
                break
    return ids


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_is_plain_argmax_and_stops_at_either_eos(cache):
    model = _model(seed=7, scale=6.0)
    rng = random.Random(6)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(16)]
    want = [_greedy_oracle(model, p, 20, {EOS_A, EOS_B}) for p in prompts]
    assert any(w[-1] == EOS_B for w in want)  # EOS_B ends some answer: its stop is under test
    assert any(len(set(w)) < len(w) for w in want)  # some answer repeats a token: the penalty would matter
    assert generate_token_ids(model, _Tok, prompts, 20, batch_size=16, cache=cache) == want


def test_greedy_evaluation_answers_are_the_plain_argmax(char_tokenizer):
    """``score_model`` (the evaluate stage's greedy answers) on a model whose generation config has a
    repetition penalty, min_p and a second EOS id: each answer is the brute-force greedy text."""
    from ars_opd.config import EvaluateConfig
    from ars_opd.data.prompts import alpaca_messages, encode_prompts
    from ars_opd.evaluation.evaluate import HeldOut, score_model

    tok = char_tokenizer
    words = ("abc", "hello", "xyzzy", "kayak", "moon", "pq")
    prompts = encode_prompts(tok, [alpaca_messages("Reverse the letters.", w) for w in words])
    eos = tok.eos_token_id
    model = _model(seed=2, scale=6.0, vocab=len(tok), eos=eos, pad=tok.pad_token_id, second_eos=eos)
    plain = [_greedy_oracle(model, p, 12, {eos}) for p in prompts]
    assert any(len(set(a)) < len(a) for a in plain)  # repeated tokens: a repetition penalty would change these
    second_eos = plain[0][7]  # a token several answers reach, at different places: it now ends them there
    assert second_eos != eos
    model.generation_config.eos_token_id = [eos, second_eos]
    ends = {eos, second_eos}
    want = [_greedy_oracle(model, p, 12, ends) for p in prompts]
    assert sum(w[-1] == second_eos for w in want) >= 2 and len({len(w) for w in want}) >= 3
    oracle = [tok.decode(w[:-1] if w[-1] in ends else w, skip_special_tokens=True) for w in want]
    rows = [{"id": str(i), "task": None} for i in range(len(prompts))]
    data = HeldOut(rows, prompts, [[eos]] * len(prompts), [False] * len(prompts))
    cfg = EvaluateConfig(max_new_tokens=12, batch_size=4)
    _, texts = score_model(model, model, tok, data, cfg, len(tok), torch.device("cpu"), is_teacher=True)
    assert texts == oracle
