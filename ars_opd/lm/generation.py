"""Batched generation: left-padded prompts through ``model.generate``, completions cut after the first EOS.

Prompts are padded on the left so every row's next token sits at the same column; ``generate`` derives
the position ids from the attention mask, so a left-padded row sees the same positions as the row alone
and batched greedy output equals one-by-one greedy output (tested). ``cache="static"`` decodes with a
preallocated KV cache and the loop of ``ars_opd.lm.decoding`` instead (compiled on CUDA; same greedy output).

The decoding policy is the caller's alone: greedy, or softmax(z/τ) with nucleus ``top_p``, nothing else. A
real checkpoint's ``generation_config.json`` carries sampling defaults (Qwen2.5-Instruct: repetition_penalty
1.05, top_k 20, top_p 0.8...), and ``generate`` applies every one the call does not override, so for the
duration of each call the model's ``generation_config`` is replaced by one that holds only this call's
settings (``_own_decoding_policy``; restored afterwards, so a published model keeps its own). Otherwise the
rollouts would not be samples of the student's distribution, which ``sampled_token`` needs and every OPD
objective assumes, and greedy evaluation would be something else than greedy. The bundled server
does the same (``ars_opd.serving.server.engine``).

A model may stop at several EOS ids: ``eos_token_ids`` is the tokenizer's EOS plus the model's
``generation_config.eos_token_id`` (one id or a list), and any of them ends a completion, here, in the
rollout batches and in evaluation (``ars_opd.lm.batching.cut_at_first_eos``).

What this module leaves out: any server concerns (see ``ars_opd.teacher``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from ars_opd.data.prompts import encode_prompts
from ars_opd.lm.batching import cut_at_first_eos, eos_set, pad_left, pad_token_id
from ars_opd.lm.decoding import GenerationCost, generate_static

__all__ = ["GenerationCost", "decode_completion", "eos_token_ids", "generate_texts", "generate_token_ids"]


def _generating_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold a ``generation_config`` of their own: the model itself, or the causal LM inside a
    wrapper (a peft model forwards ``generate`` and ``generation_config`` to it)."""
    return [m for m in model.modules() if m.__dict__.get("generation_config") is not None]


def eos_token_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    """Every id that ends one of ``model``'s completions: the tokenizer's EOS and the model's
    ``generation_config.eos_token_id`` (an id or a list, e.g. Qwen2.5-Instruct's two), sorted."""
    ids = set(eos_set(getattr(tokenizer, "eos_token_id", None)))
    for m in _generating_modules(model):
        ids |= eos_set(m.generation_config.eos_token_id)
    return tuple(sorted(ids))


@contextmanager
def _own_decoding_policy(model: torch.nn.Module, config: GenerationConfig) -> Iterator[None]:
    """``config`` as the model's only generation config for the duration (``generate`` fills every setting a
    call leaves unset from the model's config, so passing ours alone would not keep a checkpoint's
    repetition penalty, min_p, suppressed tokens... out); the model's own is put back afterwards."""
    holders = _generating_modules(model)
    saved = [m.generation_config for m in holders]
    try:
        for m in holders:
            m.generation_config = config
        yield
    finally:
        for m, old in zip(holders, saved):
            m.generation_config = old


@contextmanager
def _count_forward_tokens(model: torch.nn.Module, cost: GenerationCost | None) -> Iterator[None]:
    """Add to ``cost`` the token positions of every forward ``generate`` makes (prefill, decode steps, and the
    steps a finished batch or a synced worker still runs), counted where they happen."""
    if cost is None:
        yield
        return

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        cost.forward_tokens += int(ids.numel())

    # the outermost module holding a generation config is the one whose forward ``generate`` calls
    handle = (_generating_modules(model) or [model])[0].register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def generate_token_ids(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 64,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator_seed: int | None = None,
    stop_at_eos: bool = True,
    cache: str = "dynamic",
    synced: bool = False,
    eos_ids: Sequence[int] | None = None,
    cost: GenerationCost | None = None,
) -> list[list[int]]:
    """New tokens for each prompt, cut after the first EOS (EOS kept) when ``stop_at_eos``.

    Greedy, or sampled from softmax(z/τ) restricted to the nucleus ``top_p``: no other setting of the model's
    ``generation_config`` applies. eos_ids: the ids that end a completion (default ``eos_token_ids``).
    cache: "dynamic" (``model.generate``) or "static" (``ars_opd.lm.decoding.generate_static``).
    synced: every worker runs the same number of forward passes (transformers' ``synced_gpus``: a worker
    whose rows are done keeps stepping until every worker's are), as a sharded model needs, since each of its
    forwards gathers the weights from all workers. Dynamic cache only.
    cost: adds the token positions the model computed (``GenerationCost``).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if cache not in ("dynamic", "static"):
        raise ValueError(f"cache must be dynamic or static, got {cache!r}")
    if synced and cache == "static":
        raise ValueError("synced generation (a sharded student) needs the dynamic cache")
    pad_id = pad_token_id(tokenizer)
    eos_ids = tuple(sorted(eos_set(eos_ids))) if eos_ids is not None else eos_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    policy = GenerationConfig(
        do_sample=do_sample,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=list(eos_ids) or None,
        use_cache=True,
        # top_k 0: no top-k cut (generate's global default would be 50)
        **(dict(temperature=temperature, top_p=top_p, top_k=0) if do_sample else {}),
    )
    try:
        for start in range(0, len(prompt_ids), batch_size):
            chunk = prompt_ids[start : start + batch_size]
            if cache == "static":
                new = generate_static(
                    model, chunk, pad_id, eos_ids, max_new_tokens, do_sample, temperature, top_p, cost=cost
                )
                out.extend(cut_at_first_eos(row, eos_ids)[0] if stop_at_eos else row for row in new)
                continue
            ids, mask = pad_left(chunk, pad_id)
            ids, mask = ids.to(device), mask.to(device)
            kwargs = {"synced_gpus": True} if synced else {}
            with _own_decoding_policy(model, policy), _count_forward_tokens(model, cost):
                gen = model.generate(input_ids=ids, attention_mask=mask, generation_config=policy, **kwargs)
            new = gen[:, ids.shape[1] :].tolist()
            out.extend(cut_at_first_eos(row, eos_ids)[0] if stop_at_eos else row for row in new)
    finally:
        model.train(was_training)
    return out


def decode_completion(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], eos_ids: Sequence[int] | int | None = None
) -> str:
    """Text of generated ids up to (not including) the first EOS (any of ``eos_ids``, default the tokenizer's)."""
    ids, ended = cut_at_first_eos(ids, tokenizer.eos_token_id if eos_ids is None else eos_ids)
    return tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=True)


def generate_texts(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[dict]],
    max_new_tokens: int,
    batch_size: int = 64,
    **kwargs,
) -> list[str]:
    """Chat-templated generation for lists of prompt messages; returns the decoded completions."""
    ids = encode_prompts(tokenizer, list(prompts))
    eos = eos_token_ids(model, tokenizer)
    return [
        decode_completion(tokenizer, g, eos)
        for g in generate_token_ids(model, tokenizer, ids, max_new_tokens, batch_size, eos_ids=eos, **kwargs)
    ]
