"""Rollouts with a static KV cache: a decode loop of our own, compiled with torch.compile on CUDA.

transformers' ``generate`` re-enters Python for every token of every layer, grows its KV cache by
concatenation and checks its stopping criteria with a host sync each step; at B = 256 on an H200 that is
about 3.6k tokens/s for a Qwen3-0.6B shape. Here:

- the KV cache is transformers' ``StaticCache``, allocated once per model and batch size (its length rounded
  up to ``CACHE_BUCKET``, grown only when a call needs more) and reset between calls; the prompt fills its
  first positions and each new token the next one;
- the attention mask spans the whole cache and is written in place (a position becomes visible when its
  token exists), so every decode step of every call has the same shapes and the same cache tensors: one
  compiled step whatever the prompt width — what CUDA graphs need (``torch.compile(mode="reduce-overhead")``
  on CUDA; eager elsewhere);
- position ids count each row's real tokens, as ``generate`` does for left padding, so a row's logits do not
  depend on the padding around it (tested: greedy output equals ``generate``'s);
- sampling stays on the device (temperature, nucleus, then the inverse CDF in float64, which needs no host sync),
  EOS is tracked on the device and checked on the host only every ``SYNC_EVERY`` steps; rows that ended keep
  decoding pad tokens, which the caller drops (everything after the first EOS is cut). Any id of the EOS set
  ends a row (a model may stop at several, ``ars_opd.lm.generation.eos_token_ids``);
- the decoding policy is the caller's alone (temperature, top_p): a checkpoint's ``generation_config``
  (repetition penalty, min_p, top_k...) is never read, so a sample is a sample of softmax(z/τ);
- ``GenerationCost`` counts the token positions that went through the model: the left-padded prompt batch
  (padding included) and each decode step of every row, also of rows that ended, until the batch stops.
  That is what the budget charges for sampling (``ars_opd.training.budget``).

What this leaves out: speculative decoding, paged caches, continuous batching (a batch runs to its longest
row), and architectures with sliding-window or hybrid caches (refused by ``StaticCache``'s own checks).
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ars_opd.lm.batching import EosIds, eos_set, pad_left

CACHE_BUCKET = 64  # cache lengths are rounded up to a multiple of this, so one cache serves many prompt widths
SYNC_EVERY = 8  # decode steps between host checks of "every row has ended"

# per model: the static cache and the (compiled) decode step of each (batch, dtype, compile), kept across calls so
# a training run compiles and records its CUDA graphs once, not once per rollout
_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@dataclass
class GenerationCost:
    """What generation computed: the token positions passed through the model's forward, padding and rows
    that already ended included (what a batch costs, not what it keeps). Callers add to one across calls."""

    forward_tokens: int = 0


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token per row (B,) from fp32 logits (B, V): greedy at temperature 0, else softmax(z/τ) restricted
    to the smallest set of most likely tokens holding at least ``top_p`` of the mass."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)  # (B, V)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        outside = (sorted_p.cumsum(-1) - sorted_p) >= top_p  # mass before a token already reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    # inverse CDF in float64: the first i whose cumulative mass reaches u ~ U(0, Σp] has probability p_i / Σp. A
    # zero-probability token is never it (its predecessor, or u > 0 for the first, reaches u first), and u <= Σp
    # (a product with 1 - r <= 1 cannot round above Σp), so an index always exists. No host sync, and ~50x cheaper on
    # CPU than an exponential race (argmax p_i / E_i), whose Exp(1) draw over the whole vocabulary took 7 ms a step
    # at B = 8, V = 49,152.
    cdf = probs.double().cumsum(-1)  # float64: each token's interval is exact to ~1e-16 of the mass
    r = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device, generator=generator)
    return torch.searchsorted(cdf, (1.0 - r) * cdf[:, -1:]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _cache_argument(model: torch.nn.Module) -> str:
    # transformers 5.24 names the forward's cache ``cache`` (``past_key_values`` is deprecated); 5.17 and
    # earlier only know ``past_key_values``
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _forward(model, cache, cache_kw: str, input_ids, position_ids, attention_mask) -> torch.Tensor:
    """Next-token logits (B, V) fp32 of the last position, writing the new keys and values into ``cache``."""
    # the last position as an index, not ``logits_to_keep=1``: the model slices its hidden states with it, and the
    # slice of a (B, T, H) prefill is not contiguous, which a bf16 head on CPU serves with a batched product over B
    # copies of its (V, H) weight (0.6 s for the pruned SmolLM2's prefill at B = 8); an index gathers a contiguous row
    last = input_ids.shape[1] - 1
    keep = 1 if last == 0 else torch.tensor([last], device=input_ids.device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=keep,
        **{cache_kw: cache},
    )
    return out.logits[:, -1].float()


def _state(model, batch: int, length: int, compile: bool) -> dict:
    """The cache (reset) and decode step for ``batch`` rows of up to ``length`` tokens; grown when too short."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.dtype
    states = _STATES.setdefault(model, {})
    key = (batch, dtype, compile)
    state = states.get(key)
    if state is None or state["length"] < length:
        length = -(-length // CACHE_BUCKET) * CACHE_BUCKET
        states.pop(key, None)  # free the old cache before allocating the larger one
        step = torch.compile(_forward, mode="reduce-overhead", dynamic=False) if compile else _forward
        state = states[key] = {
            "length": length,
            "cache": StaticCache(config=model.config, max_cache_len=length),
            "decode": step,
            "cache_kw": _cache_argument(model),
        }
    else:
        state["cache"].reset()
    return state


@torch.no_grad()
def generate_static(
    model,
    prompt_ids: Sequence[Sequence[int]],
    pad_id: int,
    eos_id: EosIds,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    compile: bool | None = None,
    cost: GenerationCost | None = None,
) -> list[list[int]]:
    """``max_new_tokens`` new tokens per prompt (rows that ended continue with ``pad_id``; cut at EOS after).

    model: a causal LM in eval mode; eos_id: one EOS id or several (any of them ends a row), None: none;
    compile: torch.compile the decode step (default: on CUDA only); cost: adds the token positions computed.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    compile = device.type == "cuda" if compile is None else compile
    ids, mask = pad_left(prompt_ids, pad_id)  # (B, P)
    B, P = ids.shape
    state = _state(model, B, P + max_new_tokens, compile)
    cache, cache_kw, decode = state["cache"], state["cache_kw"], state["decode"]
    # one mask over the whole cache: the prompt's real tokens now, each new token when it exists
    attention = torch.zeros((B, state["length"]), dtype=torch.long, device=device)
    attention[:, :P] = mask.to(device)
    positions = (attention[:, :P].cumsum(-1) - 1).clamp(min=0)  # (B, P): a row's real tokens count from 0
    next_position = attention[:, :P].sum(-1, keepdim=True)  # (B, 1)
    ends = eos_set(eos_id)
    eos = torch.tensor(sorted(ends), dtype=torch.long, device=device) if ends else None
    logits = _forward(model, cache, cache_kw, ids.to(device), positions, attention)  # prefill, eager (its own shape)
    computed = B * P
    tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        token = sample_next(logits, temperature if do_sample else 0.0, top_p, generator)
        token = torch.where(ended, torch.full_like(token, pad_id), token)
        tokens[:, t] = token
        if eos is not None:
            ended |= torch.isin(token, eos)
        if t + 1 == max_new_tokens or (eos is not None and (t + 1) % SYNC_EVERY == 0 and bool(ended.all())):
            break
        attention[:, P + t] = 1
        # same shapes and cache every step: one compiled graph (clone: CUDA graphs reuse their output buffer)
        logits = decode(model, cache, cache_kw, token[:, None], next_position + t, attention).clone()
        computed += B
    if cost is not None:
        cost.forward_tokens += computed
    return tokens.tolist()
