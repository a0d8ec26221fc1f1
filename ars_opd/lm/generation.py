"""Batched generation: left-padded prompts through ``model.generate``, completions cut after the first EOS.

Prompts are padded on the left so every row's next token sits at the same column; ``generate`` derives
the position ids from the attention mask, so a left-padded row sees the same positions as the row alone
and batched greedy output equals one-by-one greedy output (tested). ``cache="static"`` decodes with a
preallocated KV cache and the loop of ``ars_opd.lm.decoding`` instead (compiled on CUDA; same greedy output).

What this module leaves out: any server concerns (see ``ars_opd.teacher``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ars_opd.data.prompts import encode_prompts
from ars_opd.lm.batching import cut_at_first_eos, pad_left
from ars_opd.lm.decoding import generate_static


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
) -> list[list[int]]:
    """New tokens for each prompt, cut after the first EOS (EOS kept) when ``stop_at_eos``.

    cache: "dynamic" (``model.generate``) or "static" (``ars_opd.lm.decoding.generate_static``).
    synced: every worker runs the same number of forward passes (transformers' ``synced_gpus``: a worker
    whose rows are done keeps stepping until every worker's are), as a sharded model needs, since each of its
    forwards gathers the weights from all workers. Dynamic cache only.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if cache not in ("dynamic", "static"):
        raise ValueError(f"cache must be dynamic or static, got {cache!r}")
    if synced and cache == "static":
        raise ValueError("synced generation (a sharded student) needs the dynamic cache")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    if generator_seed is not None:
        torch.manual_seed(generator_seed)
    try:
        for start in range(0, len(prompt_ids), batch_size):
            chunk = prompt_ids[start : start + batch_size]
            if cache == "static":
                new = generate_static(model, chunk, pad_id, eos_id, max_new_tokens, do_sample, temperature, top_p)
                out.extend(cut_at_first_eos(row, eos_id)[0] if stop_at_eos else row for row in new)
                continue
            ids, mask = pad_left(chunk, pad_id)
            ids, mask = ids.to(device), mask.to(device)
            kwargs = dict(do_sample=do_sample, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id)
            if synced:
                kwargs["synced_gpus"] = True
            if do_sample:
                kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
            else:
                kwargs.update(temperature=None, top_p=None, top_k=None)
            gen = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            new = gen[:, ids.shape[1] :].tolist()
            out.extend(cut_at_first_eos(row, eos_id)[0] if stop_at_eos else row for row in new)
    finally:
        model.train(was_training)
    return out


def decode_completion(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Text of generated ids up to (not including) the first EOS."""
    ids, ended = cut_at_first_eos(ids, tokenizer.eos_token_id)
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
    return [
        decode_completion(tokenizer, g)
        for g in generate_token_ids(model, tokenizer, ids, max_new_tokens, batch_size, **kwargs)
    ]
