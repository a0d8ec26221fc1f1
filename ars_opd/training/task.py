"""What the training engine asks of a task (SFT, OPD): its micro-batches and their summed token loss.

The engine (``ars_opd.training.loop``) owns the optimisation: the global token normalisation, clipping,
the optimiser step, the log. A task owns the data and the loss: for each step it hands this worker its
micro-batches (SFT: slices of the data; OPD: rollouts) with their loss-token counts, and for each micro-batch
the *summed* token loss, so that the engine alone decides the normaliser. The task interface depends on
nothing of the engine, so a task module need not import the engine.

Besides the task, the caller of the engine (``Trainer.build``, then ``fit``) hands it two small records,
defined here (below both the engine and the stage workers that call it): ``RunIdentity``, what tells the
run from another (its fingerprints, which a checkpoint must match to resume, and the budget its starting
model already spent), and ``RunHooks``, what the run calls or shows besides the task (extra log columns, an
injected fault, the progress bar).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import torch

from ars_opd.training.faults import Fault


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
    units: int | None = None
    """What the step's loss averages over, counted in this micro-batch: the task's ``loss_sum`` is a sum over
    these. None: its loss tokens (the global token mean); OPD's per-sequence normalisation counts sequences
    and sums each sequence's token mean."""

    @property
    def loss_units(self) -> int:
        return self.n_tokens if self.units is None else self.units


class TrainingTask(Protocol):
    """What the engine needs from SFT or OPD."""

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        """This worker's micro-batches for ``step`` (``model`` is the unwrapped module, e.g. for rollouts)."""

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed loss over the batch's ``loss_units`` (its valid tokens unless the task counts otherwise; 0-dim,
        fp32, with grad) and metric sums."""

    def metric_names(self) -> list[str]:
        """Task metrics reported per step; each is a (sum, count) pair reduced over all workers."""

    def teacher_tokens(self, step: int) -> int:
        """Tokens the teacher generated for the text the whole world first trains on at ``step``, as the run
        charges them (``ars_opd.training.data_cost``); the same on every rank. Called once per step, in order."""

    # optional: ``check_step(step, metrics)``, called on every rank with the step's reduced columns (the same on
    # every rank) after the backward and before the update; raising there stops the run without that update
    # (OPD's lag-0 check of the rollout engine, ``ars_opd.rollouts.version_check.check_lag0``)


class RunIdentity(NamedTuple):
    """What tells a run from another (``ars_opd.training.checkpoint``, ``ars_opd.training.budget``)."""

    fingerprint: str  # the run's configuration and inputs: a checkpoint resumes only a run of the same one
    layout_fingerprint: str | None = None  # the same but the worker layout: what a resharded resume matches
    budget_start: dict | None = None  # the budget the starting model already spent (None: from scratch)


class RunHooks(NamedTuple):
    """What the run calls or shows besides the task."""

    on_step: Callable[[int], dict] | None = None  # extra columns for a step's log row, from its step number
    fault: Fault | None = None  # the injected fault as this rank sees it (``ars_opd.training.faults``)
    progress: bool = True  # a progress bar on rank 0
