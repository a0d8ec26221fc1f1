"""What the training engine asks of a task (SFT, OPD): its micro-batches and their summed token loss.

The engine (``ars_opd.training.loop``) owns the optimisation: the global token normalisation, clipping,
the optimiser step, the log. A task owns the data and the loss: for each step it hands this worker its
micro-batches (SFT: slices of the data; OPD: rollouts) with their loss-token counts, and for each micro-batch
the *summed* token loss, so that the engine alone decides the normaliser. The task interface depends on
nothing of the engine, so a task module need not import the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class MicroBatch:
    """Tensors for one forward/backward, and how many loss tokens they hold."""

    tensors: dict[str, torch.Tensor]
    n_tokens: int  # positions with a loss target
    n_sequences: int
    n_real_tokens: int = 0  # non-padding positions (for the padding fraction)
    meta: dict[str, tuple[float, float]] = field(default_factory=dict)  # task metric (sum, count) pairs
    flops: float = 0.0  # estimated FLOPs of everything done for this micro-batch (ars_opd.training.budget)
    generated_tokens: int = 0  # tokens sampled from the student for it


class TrainingTask(Protocol):
    """What the engine needs from SFT or OPD."""

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        """This worker's micro-batches for ``step`` (``model`` is the unwrapped module, e.g. for rollouts)."""

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed per-token loss over the batch's valid tokens (0-dim, fp32, with grad) and metric sums."""

    def metric_names(self) -> list[str]:
        """Task metrics reported per step; each is a (sum, count) pair reduced over all workers."""
