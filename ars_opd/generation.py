"""Batched generation with left padding, and padding helpers for training batches.

Generation pads prompts on the left so every row's next token sits at the same column, and passes
position ids derived from the attention mask (``cumsum - 1``) so a left-padded row sees the same
positions as the row alone: batched greedy output then equals one-by-one greedy output (tested).
Training batches pad on the right with labels -100 on prompt and padding.

What this module leaves out: sampling loops of its own (``model.generate`` does the decoding with its
KV cache) and any server concerns (see the teacher server).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ars_opd.losses import IGNORE_INDEX
from ars_opd.prompts import encode_prompts


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (input_ids, attention_mask), both (B, T)."""
    if not seqs:
        raise ValueError("pad_left needs at least one sequence")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def pad_right_with_labels(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate prompt+completion, right-pad; labels are the completion tokens, -100 elsewhere.

    Returns ``input_ids``, ``attention_mask``, ``labels``, each (B, T). Labels are *unshifted*
    (aligned with input_ids); the loss shifts them.
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(f"need equal, non-zero numbers of prompts and completions, got {len(prompts)}, {len(completions)}")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[i, :n] = torch.as_tensor(list(p) + list(c), dtype=torch.long)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.as_tensor(list(c), dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
) -> list[list[int]]:
    """New tokens for each prompt, cut after the first EOS (EOS kept) when ``stop_at_eos``."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
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
            chunk = prompt_ids[start:start + batch_size]
            ids, mask = pad_left(chunk, pad_id)
            ids, mask = ids.to(device), mask.to(device)
            kwargs = dict(do_sample=do_sample, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                          eos_token_id=eos_id)
            if do_sample:
                kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
            else:
                kwargs.update(temperature=None, top_p=None, top_k=None)
            gen = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            new = gen[:, ids.shape[1]:].tolist()
            for row in new:
                if stop_at_eos and eos_id is not None and eos_id in row:
                    row = row[: row.index(eos_id) + 1]
                out.append(row)
    finally:
        model.train(was_training)
    return out


def decode_completion(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """Text of generated ids up to (not including) the first EOS."""
    eos_id = tokenizer.eos_token_id
    ids = list(ids)
    if eos_id is not None and eos_id in ids:
        ids = ids[: ids.index(eos_id)]
    return tokenizer.decode(ids, skip_special_tokens=True)


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
    return [decode_completion(tokenizer, g)
            for g in generate_token_ids(model, tokenizer, ids, max_new_tokens, batch_size, **kwargs)]
