"""The optimiser setup every training loop shares: AdamW, warmup + cosine schedule, explicit clipping.

Used by the data-parallel engine (SFT, OPD) and by the models stage's single-process teacher training,
each with its own params section (both are ``OptimConfig``s).

- AdamW with weight decay on matrices only (biases and norms are not decayed);
- the learning rate is a pure function of the step: linear warmup to the peak, cosine down to
  ``min_lr_ratio`` of it at the last step;
- clipping is explicit: ``clip_gradients`` returns the pre-clip global norm and the coefficient applied
  (``max_grad_norm: null`` never clips), so callers log both; over sharded (FSDP2) gradients the norm is
  that of the whole gradient (torch reduces it over the shards);
- precision: bf16 autocast on CUDA (``precision: auto``), fp32 on CPU; losses are taken in fp32 anyway.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ars_opd.config import OptimConfig


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
    )


def make_scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    )


def clip_gradients(params: list[torch.nn.Parameter], max_grad_norm: float | None) -> tuple[float, float]:
    """(pre-clip global L2 norm, clip coefficient applied). Clips in place unless ``max_grad_norm`` is None
    or the norm is not finite (the caller decides what a non-finite step means)."""
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    # sharded gradients (FSDP2 DTensors) give a replicated DTensor: the norm of the whole reduced gradient
    norm = (total.full_tensor() if hasattr(total, "full_tensor") else total).item()
    coef = 1.0
    if math.isfinite(norm) and max_grad_norm is not None:
        coef = min(1.0, max_grad_norm / (norm + 1e-6))
        if coef < 1.0:
            torch.nn.utils.clip_grads_with_norm_(
                params, max_grad_norm, total if hasattr(total, "full_tensor") else torch.tensor(norm)
            )
    return norm, coef


def autocast_context(precision: str, device: torch.device):
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
