"""What one rank contributes to a step, and the layout of the step's one all-gather of it.

``Trainer.accumulate`` (``ars_opd.training.loop``) returns this rank's ``Accumulated``: its summed loss
and tokens, the global token count (and the loss's units: tokens, unless the task counts sequences), the task's
metric sums and its budget. ``Trainer.step`` packs that with the
consistency monitor's local statistics into one float64 row per worker (``StepColumns.pack``), all-gathers
the rows once, and reads the (K, columns) matrix by the same column names, so the layout is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch


class Accumulated(NamedTuple):
    """One rank's view of a step's forward/backward passes."""

    local_sum: float  # summed token loss of this rank's micro-batches
    local_tokens: int  # their loss tokens
    global_tokens: int  # loss tokens of the whole global batch (the normaliser)
    metrics: dict[str, tuple[float, float]]  # task metric (sum, count) pairs
    flops: float  # estimated FLOPs of the micro-batches processed
    generated: int  # tokens sampled for them
    local_units: int  # what the loss averages over in this rank's micro-batches (MicroBatch.loss_units)
    global_units: int  # the same for the whole global batch (the normaliser): global_tokens unless the task counts
    # otherwise (OPD's per-sequence normalisation counts sequences)


@dataclass(frozen=True)
class StepColumns:
    """The columns of the step's one all-gather, a float64 row per worker: ``pack`` builds this worker's row
    and the gathered (K, 8 + 2M) matrix is read by the same names, so the layout is written once. The task's
    M metrics follow as (sum, count) pairs, in its ``metric_names`` order."""

    metric_names: tuple[str, ...]

    LOSS_SUM: ClassVar[int] = 0  # summed token loss of the worker's micro-batches
    TOKENS: ClassVar[int] = 1  # their loss tokens
    GRAD_SQ: ClassVar[int] = 2  # ‖g_k‖²
    GRAD_DOT: ClassVar[int] = 3  # ⟨g_k, ḡ⟩, or NaN
    FLOPS: ClassVar[int] = 4  # estimated FLOPs of the micro-batches processed
    GENERATED: ClassVar[int] = 5  # tokens sampled for them
    PROCESSED: ClassVar[int] = 6  # their non-padding tokens
    UNITS: ClassVar[int] = 7  # what the worker's loss sum is over (its loss tokens unless the task counts otherwise)
    METRICS: ClassVar[int] = 8  # the first task metric's sum; its count follows, then the next pair

    def metric_sum(self, i: int) -> int:
        return self.METRICS + 2 * i

    def metric_count(self, i: int) -> int:
        return self.METRICS + 2 * i + 1

    def pack(self, acc: Accumulated, stats: torch.Tensor, processed: int, device: torch.device) -> torch.Tensor:
        """This worker's row: its pieces concatenated in column order, each one converted to float64."""
        f64 = {"dtype": torch.float64, "device": device}
        row = torch.cat(
            [
                torch.tensor([acc.local_sum, float(acc.local_tokens)], **f64),  # LOSS_SUM, TOKENS
                stats.to(**f64),  # GRAD_SQ, GRAD_DOT
                torch.tensor([acc.flops, float(acc.generated), float(processed)], **f64),  # FLOPS..PROCESSED
                torch.tensor([float(acc.local_units)], **f64),  # UNITS
                torch.tensor([x for n in self.metric_names for x in acc.metrics.get(n, (0.0, 0.0))], **f64),
            ]
        )
        width = self.metric_sum(len(self.metric_names))
        if row.numel() != width:  # e.g. a monitor's stats of another length: every later column would shift
            raise ValueError(f"the step's gathered row has {row.numel()} columns, its layout {width}")
        return row
