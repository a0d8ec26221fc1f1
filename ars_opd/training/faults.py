"""Deliberate data-parallel faults (``ddp.inject``): a testing aid that proves the consistency detector works.

Each fault is a real class of silent data-parallel bug, switched on at ``start_step`` on one ``rank`` with a
``magnitude``; nothing else about the run changes (its random draws come from generators of their own, so
the global RNG streams, and therefore every other rank's batches, stay those of the healthy run):

- ``label_noise``: a fraction of the rank's target tokens is replaced by uniform random token ids (a
  corrupted shard). SFT only: it acts on the labels.
- ``shard_skew``: a fraction of the rank's items is replaced by items of a single task (a broken shuffle or
  filter); at magnitude 1 the rank sees only that task.
- ``loss_scale``: the rank's loss is multiplied by the factor in the backward only, so the logged loss is
  the true one (a per-rank gradient-accumulation scaling bug: it shows in the gradient, not the loss).
- ``drop_microbatch``: the rank skips its first ``magnitude`` micro-batches of each step but still counts
  their tokens in the step's normaliser (a dropped micro-batch whose tokens are still counted).
- ``param_desync``: at ``start_step`` the rank's weights get a one-off perturbation ε·RMS(p)·N(0, 1). DDP
  syncs gradients, never weights, so the replicas stay apart from then on.
"""

from __future__ import annotations

import torch

from ars_opd.config import InjectConfig
from ars_opd.lm.batching import IGNORE_INDEX
from ars_opd.seeding import derive_seed


class Fault:
    """The injected fault as one rank sees it; every method is a no-op when the fault does not apply."""

    def __init__(self, cfg: InjectConfig, stage: str, rank: int, seed: int):
        self.cfg = cfg
        self.on = cfg.kind is not None and stage in cfg.stages
        self.mine = self.on and rank == cfg.rank
        self.seed = derive_seed(seed, f"fault-{cfg.kind}")

    def active(self, step: int) -> bool:
        """The fault is on at ``step`` (on some rank): what the step log records."""
        return self.on and step >= self.cfg.start_step

    def _hits(self, kind: str, step: int) -> bool:
        return self.mine and self.cfg.kind == kind and step >= self.cfg.start_step

    def _generator(self, step: int, what: str) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, f"{what}-{step}"))

    # -- data faults (the task calls these) --------------------------------------------------------------

    def select(self, step: int, indices: list[int], item_tasks: list[str | None]) -> list[int]:
        """shard_skew: replace round(magnitude · n) of this step's items by items of one task."""
        if not self._hits("shard_skew", step):
            return indices
        tasks = sorted({t for t in item_tasks if t is not None})
        if not tasks:
            raise ValueError("shard_skew needs items with a task label (e.g. data.source: synthetic)")
        task = self.cfg.task or tasks[0]
        pool = [i for i, t in enumerate(item_tasks) if t == task]
        if not pool:
            raise ValueError(f"ddp.inject.task {task!r} matches no item; tasks present: {tasks}")
        n = round(self.cfg.magnitude * len(indices))
        g = self._generator(step, "skew")
        drawn = [pool[i] for i in torch.randint(len(pool), (n,), generator=g).tolist()]
        return drawn + list(indices[n:])

    def corrupt_labels(self, labels: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
        """label_noise: replace a ``magnitude`` fraction of the valid labels by random ids (a new tensor)."""
        if not self._hits("label_noise", step):
            return labels
        g = self._generator(step, "labels")
        valid = labels != IGNORE_INDEX  # (B, T)
        hit = valid & (torch.rand(labels.shape, generator=g) < self.cfg.magnitude).to(labels.device)
        noise = torch.randint(vocab, labels.shape, generator=g).to(labels.device)
        return torch.where(hit, noise, labels)

    # -- gradient faults (the engine calls these) --------------------------------------------------------

    def loss_factor(self, step: int) -> float:
        """loss_scale: the factor on this rank's loss in the backward (1.0 when off)."""
        return self.cfg.magnitude if self._hits("loss_scale", step) else 1.0

    def drops(self, step: int, index: int, n_micro: int) -> bool:
        """drop_microbatch: whether this rank skips micro-batch ``index`` of the step's ``n_micro``."""
        if not self._hits("drop_microbatch", step):
            return False
        if n_micro - int(self.cfg.magnitude) < 1:
            raise ValueError(
                f"drop_microbatch with magnitude {int(self.cfg.magnitude)} needs more micro-batches "
                f"per step than that (this rank has {n_micro}): raise the global batch or lower "
                "the micro-batch size"
            )
        return index < int(self.cfg.magnitude)  # never the last one: it carries DDP's all-reduce

    @torch.no_grad()
    def perturb(self, model: torch.nn.Module, step: int) -> None:
        """param_desync: at ``start_step``, add ε·RMS(p)·N(0, 1) to every parameter of this rank."""
        if not (self.mine and self.cfg.kind == "param_desync" and step == self.cfg.start_step):
            return
        g = self._generator(step, "desync")
        for p in model.parameters():
            rms = p.detach().float().pow(2).mean().sqrt()
            noise = torch.randn(p.shape, generator=g).to(device=p.device, dtype=torch.float32)
            p.add_((self.cfg.magnitude * rms * noise).to(p.dtype))
