"""Every batch layout of the pipeline in one place: token lists in, tensors out.

- ``pad_left``: prompts for generation (every row's next token in the same column);
- ``pad_right_with_labels``: prompt + completion rows for cross-entropy, labels -100 on prompt and padding;
- ``pack_sequences``: the padding-free form of the same rows (several sequences per row, positions restart,
  sequence boundaries for a varlen attention that stops at them; no (L × L) mask);
- ``build_rollout_batch``: prompt + sampled completion rows for scoring, each completion kept up to and
  including its first EOS, with the mask of the positions whose next token is a completion token.

Two token rules every stage shares live here too. The pad id (``pad_token_id``): the tokenizer's pad token,
else its EOS (Llama-3-style tokenizers have no pad token); padding is never read, so any real id serves.
The end of a completion (``cut_at_first_eos``): the first of *any* EOS id. A model may stop at several
(its ``generation_config.eos_token_id`` list, e.g. Qwen2.5-Instruct's ``<|im_end|>`` and
``<|endoftext|>``: ``ars_opd.lm.generation.eos_token_ids``), and the same set ends a completion in the
rollouts, in evaluation and in the loss mask.

Masks come from lengths, never from comparing ids with the pad id, so everything here is correct when
pad == EOS (as in many chat models). Labels are *unshifted* (aligned with ``input_ids``); the losses shift.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

IGNORE_INDEX = -100

EosIds = int | Collection[int] | None  # one EOS id, several (any of them ends a completion), or none


def eos_set(eos: EosIds) -> frozenset[int]:
    """The EOS ids of ``eos`` as a set (empty for None)."""
    if eos is None:
        return frozenset()
    return frozenset((eos,) if isinstance(eos, int) else (int(e) for e in eos))


def pad_token_id(tokenizer) -> int:
    """The id every batch of the pipeline pads with: the tokenizer's pad token, else its EOS token.

    Padding is never read (masks come from lengths, labels are -100 there), so pad == EOS is correct; a
    tokenizer with neither token is refused, since a batch of unequal rows needs some real id to pad with.
    """
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    raise ValueError(
        "the tokenizer has neither a pad token nor an EOS token, so batches of unequal rows cannot be padded "
        "and completions cannot end: set its eos_token (and, optionally, pad_token) in tokenizer_config.json"
    )


def cut_at_first_eos(ids: Sequence[int], eos: EosIds) -> tuple[list[int], bool]:
    """Tokens up to and including the first EOS (the first of any id in ``eos``), and whether there was one."""
    ids = list(ids)
    ends = eos_set(eos)
    for i, t in enumerate(ids):
        if t in ends:
            return ids[: i + 1], True
    return ids, False


def pad_left(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (input_ids, attention_mask), both (B, T)."""
    if not seqs:
        raise ValueError("pad_left needs at least one sequence")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids, mask


def pad_right_with_labels(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Concatenate prompt+completion, right-pad; labels are the completion tokens, -100 elsewhere.

    Returns ``input_ids``, ``attention_mask``, ``labels``, each (B, T).
    """
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"need equal, non-zero numbers of prompts and completions, got {len(prompts)}, {len(completions)}"
        )
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        n = len(p) + len(c)
        ids[i, :n] = torch.as_tensor(list(p) + list(c), dtype=torch.long)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.as_tensor(list(c), dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the shifted next-token loss (labels aligned with inputs)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def pack_sequences(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pack_length: int,
    pad_id: int,
    full_rows: bool = False,
) -> dict[str, torch.Tensor]:
    """Pack sequences in order into rows of ``pack_length``; each sequence stays whole within one row.

    Rows are as long as the longest one, or with ``full_rows`` all ``pack_length`` long (fixed shapes for
    torch.compile). Returns input_ids, labels and position_ids (R, L), positions restarting at 0 for each
    sequence, and
    cu_seq_lens (S + 1,) int32: the boundaries of the S segments in the flattened (R·L) token stream, where a
    row's trailing padding is a segment of its own (its positions also start at 0). No attention mask: the
    attention of ``ars_opd.lm.attention`` keeps each token inside its segment without an (L × L) mask.
    """
    rows: list[list[tuple[Sequence[int], Sequence[int]]]] = [[]]
    used = 0
    for p, c in zip(prompts, completions):
        n = len(p) + len(c)
        if n > pack_length:
            raise ValueError(f"a sequence of {n} tokens does not fit pack_length {pack_length}")
        if used + n > pack_length:
            rows.append([])
            used = 0
        rows[-1].append((p, c))
        used += n
    R, L = len(rows), pack_length if full_rows else max(sum(len(p) + len(c) for p, c in row) for row in rows)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    labels = torch.full((R, L), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    bounds = [0]
    for r, row in enumerate(rows):
        t = 0
        for p, c in row:
            n = len(p) + len(c)
            ids[r, t : t + n] = torch.as_tensor(list(p) + list(c))
            labels[r, t + len(p) : t + n] = torch.as_tensor(list(c))
            pos[r, t : t + n] = torch.arange(n)
            t += n
            bounds.append(r * L + t)
        if t < L:  # the row's padding: one segment that attends only to itself and carries no label
            pos[r, t:] = torch.arange(L - t)
            bounds.append((r + 1) * L)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "cu_seq_lens": torch.tensor(bounds, dtype=torch.int32),
    }


def build_rollout_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int, eos_id: EosIds
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows for scoring, the completion cut after its first EOS (the first of
    any id in ``eos_id``: one id or the model's set).

    Returns input_ids, attention_mask (B, T); loss_mask (B, T) True at the positions whose next token is a
    completion token (EOS included); targets (B, T) those next tokens (-100 elsewhere); lengths and has_eos
    (B,).
    """
    if not prompts or len(prompts) != len(completions):
        raise ValueError("need equal, non-zero numbers of prompts and completions")
    ends = eos_set(eos_id)
    cut = [cut_at_first_eos(c, ends) for c in completions]
    width = max(len(p) + len(c) for p, (c, _) in zip(prompts, cut))
    B = len(prompts)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width), dtype=torch.bool)
    targets = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
    for i, (p, (c, _)) in enumerate(zip(prompts, cut)):
        if not p:
            raise ValueError("empty prompt")
        n = len(p) + len(c)
        ids[i, :n] = torch.as_tensor(list(p) + c, dtype=torch.long)
        attn[i, :n] = 1
        if c:
            loss_mask[i, len(p) - 1 : n - 1] = True
            targets[i, len(p) - 1 : n - 1] = torch.as_tensor(c, dtype=torch.long)
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss_mask,
        "targets": targets,
        "lengths": torch.tensor([len(c) for c, _ in cut]),
        "has_eos": torch.tensor([e for _, e in cut]),
    }


def sequence_weights(loss_mask: torch.Tensor) -> torch.Tensor:
    """(M,) fp32 over the True entries of ``loss_mask`` (B, T), in row-major order: 1 / the number of scored
    positions of each one's row, so that a sum of weighted token losses is the sum of each row's token mean."""
    length = loss_mask.sum(1, keepdim=True).expand_as(loss_mask)
    return 1.0 / length[loss_mask].float()


def in_first_half(loss_mask: torch.Tensor) -> torch.Tensor:
    """(M,) bool over the True entries of ``loss_mask`` (B, T), in row-major order (the order a loss's M scored
    rows come in): whether each is in the first half of its row's scored positions, i.e. the j-th (from 0) of L
    with 2j < L (of an odd L the middle one goes to the first half)."""
    ordinal = loss_mask.long().cumsum(1) - 1
    length = loss_mask.sum(1, keepdim=True)
    return (2 * ordinal < length)[loss_mask]
