"""How a step's global batch splits over workers and accumulation micro-batches, and which items each
worker takes at each step.

The data position is a pure function of the step number (a seeded permutation per epoch, dealt
round-robin), so resuming from a checkpoint needs no data-loader state and every worker knows its shard
without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ars_opd.config import batch_split_problem


class BatchConfigError(ValueError):
    """The global batch does not split into workers and micro-batches, or the data is too small."""


@dataclass(frozen=True)
class BatchGeometry:
    """How one optimiser step's global batch splits: per worker, then into micro-batches."""

    global_batch: int
    workers: int
    micro_batch: int

    @property
    def per_worker(self) -> int:
        return self.global_batch // self.workers

    @property
    def accumulation(self) -> int:
        return self.per_worker // self.micro_batch

    @classmethod
    def check(cls, global_batch: int, workers: int, micro_batch: int, section: str) -> "BatchGeometry":
        problem = batch_split_problem(global_batch, workers, micro_batch, section)
        if problem is not None:
            raise BatchConfigError(problem)
        return cls(global_batch, workers, micro_batch)


def epoch_shard(n_items: int, epoch: int, sampler_seed: int, rank: int, world_size: int) -> list[int]:
    """This worker's item indices for an epoch: a seeded permutation, dealt round-robin (drop the tail).

    With one sampler seed on every worker the shards are disjoint and cover all but < world_size items.
    """
    g = torch.Generator().manual_seed(sampler_seed * 100_003 + epoch)
    perm = torch.randperm(n_items, generator=g).tolist()
    usable = (n_items // world_size) * world_size
    return perm[rank:usable:world_size]


def step_indices(step: int, n_items: int, geometry: BatchGeometry, sampler_seed: int, rank: int) -> list[int]:
    """Item indices this worker uses at ``step`` (a pure function of the step: resume needs no data state)."""
    per_shard = n_items // geometry.workers
    steps_per_epoch = per_shard // geometry.per_worker
    if steps_per_epoch == 0:
        raise BatchConfigError(
            f"{n_items} training rows cannot fill one step of {geometry.global_batch} "
            f"sequences over {geometry.workers} workers; lower the global batch size"
        )
    epoch, k = divmod(step, steps_per_epoch)
    shard = epoch_shard(n_items, epoch, sampler_seed, rank, geometry.workers)
    return shard[k * geometry.per_worker : (k + 1) * geometry.per_worker]
