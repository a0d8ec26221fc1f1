"""Next-token cross-entropy as pure tensor functions (no I/O, no globals); trainers call them.

Like every loss of the pipeline they return a *sum* over valid tokens together with the valid-token count,
never a mean: the caller divides by the global token count of the whole optimiser step (the loss
normalisation contract in docs/design.md), so the loss is the same however the global batch is split
across workers and accumulation micro-batches.

- ``causal_lm_loss_from_hidden``: what SFT and evaluation use: from the last hidden states through the
  output head in chunks of positions (``ars_opd.lm.head``), so no (tokens × vocabulary) tensor exists;
- ``causal_lm_token_loss_sum``: the same quantity from full logits (the built-in teacher's training at its
  ~140-token vocabulary, and the reference the chunked form is tested against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ars_opd.lm.batching import IGNORE_INDEX
from ars_opd.lm.head import OutputHead, RowTerms, chunked_head_loss, select_rows


def causal_lm_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over positions whose label is not -100.

    logits: (B, T, V) for input positions; labels: (B, T) aligned with the inputs (unshifted), -100 where
    no loss is wanted. Position t's logits predict labels[t + 1]. Returns (loss_sum, n_tokens), both
    0-dim; cross-entropy is taken in fp32 whatever the logits' dtype.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits (B, T, V) and labels (B, T), got {tuple(logits.shape)}, {tuple(labels.shape)}"
        )
    shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    loss_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    n_tokens = (shift_labels != IGNORE_INDEX).sum()
    return loss_sum, n_tokens


def cross_entropy_terms(targets: torch.Tensor) -> RowTerms:
    """Per-row −log softmax(z)[y] and its gradient softmax(z) − onehot(y), for targets (M,)."""

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        y = targets[start:end, None]  # (c, 1)
        lse = torch.logsumexp(z, -1)  # (c,)
        value = lse - z.gather(-1, y).squeeze(-1)
        if not need_grad:
            return value, None
        grad = z.sub_(lse[:, None]).exp_()  # softmax, in place of the chunk's logits
        grad.scatter_add_(-1, y, torch.full_like(y, -1.0, dtype=grad.dtype))
        return value, grad

    return terms


def shifted_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (B, T) of the positions whose next label counts, their targets (M,)) for unshifted labels (B, T)."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    mask[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return mask, labels[:, 1:][mask[:, :-1]]


def causal_lm_loss_from_hidden(
    hidden: torch.Tensor, head: OutputHead, labels: torch.Tensor, chunk_size: int = 256
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy from last hidden states (B, T, H) and the output head.

    labels: (B, T) unshifted, -100 where no loss is wanted (as in ``causal_lm_token_loss_sum``; targets must be
    ids below ``head.vocab``). Returns (loss_sum: 0-dim fp32 with grad to the hidden states and the head,
    n_tokens). A batch without any label gives a zero loss that still reaches the graph.
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden (B, T, H) and labels (B, T), got {tuple(hidden.shape)}, {tuple(labels.shape)}"
        )
    mask, targets = shifted_targets(labels)
    if targets.numel() == 0:  # zero, yet every parameter stays in the graph (DDP expects each one's gradient)
        return hidden.sum() * 0.0 + head.weight.sum() * 0.0, 0
    if int(targets.max()) >= head.vocab:
        raise ValueError(f"a label id ({int(targets.max())}) is outside the scored vocabulary of {head.vocab} ids")
    loss = chunked_head_loss(select_rows(hidden, mask), head, cross_entropy_terms(targets), chunk_size)
    return loss, int(targets.numel())
