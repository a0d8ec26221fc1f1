"""How the engine holds the student: DDP-wrapped (``ddp.strategy: ddp``) or sharded in place with FSDP2 (``fsdp``).

The step (``ars_opd.training.loop``) is written once for both strategies; the few places where they differ
are here: the wrapping itself (``wrap_model``), the module the optimiser and the log see (``unwrapped``), and
the context in which a backward accumulates without the gradient reduction (``no_sync``). The sharding
itself, and what FSDP2 needs beyond this, is ``ars_opd.training.sharding``.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ars_opd.config import ParallelConfig, TrainLoopConfig
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.sharding import is_sharded, no_gradient_sync, shard_model


def wrap_ddp(model: torch.nn.Module, ctx: WorkerContext, ddp_cfg: ParallelConfig) -> DDP:
    return DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=ddp_cfg.bucket_cap_mb,
        gradient_as_bucket_view=ddp_cfg.gradient_as_bucket_view,
    )


def wrap_model(model: torch.nn.Module, ctx: WorkerContext, ddp_cfg: ParallelConfig, cfg: TrainLoopConfig):
    """The model the engine trains: DDP-wrapped (``ddp.strategy: ddp``) or sharded in place (``fsdp``)."""
    if ddp_cfg.strategy == "fsdp":
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and ctx.device.type == "cuda")
        return shard_model(model, ctx.device, bf16, ddp_cfg.fsdp_reshard_after_forward)
    return wrap_ddp(model, ctx, ddp_cfg)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The trained module itself: DDP's ``.module``; a sharded model is its own."""
    return model.module if isinstance(model, DDP) else model


def no_sync(model: torch.nn.Module):
    """A context whose backwards accumulate local gradients without reducing them: DDP's ``no_sync``, or
    FSDP2's ``set_requires_gradient_sync(False)`` for a sharded model."""
    return no_gradient_sync(model) if is_sharded(model) else model.no_sync()
