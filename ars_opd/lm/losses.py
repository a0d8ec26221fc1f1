"""Next-token cross-entropy as a pure tensor function (no I/O, no globals); trainers call it.

Like every loss of the pipeline it returns a *sum* over valid tokens together with the valid-token
count, never a mean: the caller divides by the global token count of the whole optimiser step (the loss
normalisation contract in docs/design.md), so the loss is the same however the global batch is split
across workers and accumulation micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ars_opd.lm.batching import IGNORE_INDEX


def causal_lm_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over positions whose label is not -100.

    logits: (B, T, V) for input positions; labels: (B, T) aligned with the inputs (unshifted), -100 where
    no loss is wanted. Position t's logits predict labels[t + 1]. Returns (loss_sum, n_tokens), both
    0-dim; cross-entropy is taken in fp32 whatever the logits' dtype.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits (B, T, V) and labels (B, T), got {tuple(logits.shape)}, {tuple(labels.shape)}")
    shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    loss_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    n_tokens = (shift_labels != IGNORE_INDEX).sum()
    return loss_sum, n_tokens
