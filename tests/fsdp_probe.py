"""Worker functions for the FSDP tests (importable by spawned workers: tests/ is on their sys.path)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ars_opd.config import SFTConfig
from ars_opd.training.distributed import gather_floats, init_worker, shutdown_worker
from ddp_probe import FixedTask, brute_force_statistics, monitored_step, tiny_model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _brute_force(plain, task, ctx) -> dict:
    """Every statistic from all-gathered flattened local gradients of an unsharded copy of the weights."""
    local_tokens = sum(b.n_tokens for b in task.micro)
    n = torch.tensor([float(local_tokens)], dtype=torch.float64)
    dist.all_reduce(n)
    scale = ctx.world_size / n.item()
    plain.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for b in task.micro:
        ls, _ = task.loss_sum(plain, b)
        (ls * scale).backward()
        loss_sum += ls.item()
    flat = torch.cat([p.grad.reshape(-1) for p in plain.parameters() if p.grad is not None]).double()
    parts = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(parts, flat)
    losses = gather_floats([loss_sum / local_tokens], ctx.device)[:, 0].tolist()
    plain.zero_grad(set_to_none=True)
    return brute_force_statistics(torch.stack(parts), losses)


def fsdp_consistency_probe(job: dict) -> list:
    """The sharded hook's statistics and a brute force on the same weights and batches, for a few SGD steps."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        from ars_opd.data import synthetic
        from ars_opd.models.tokenizer import build_char_word_tokenizer
        from ars_opd.training.sharding import ShardedConsistencyHook, shard_model

        tok = build_char_word_tokenizer(synthetic.instruction_words())
        model, plain = tiny_model(tok), tiny_model(tok)
        shard_model(model, ctx.device, bf16=False)
        cfg = SFTConfig(steps=job["steps"], warmup_steps=0, global_batch_size=8, micro_batch_size=1)
        task = FixedTask(job["batches"], ctx, tok.pad_token_id, job.get("identical", False))
        hook = ShardedConsistencyHook(ctx.world_size)
        hook.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

        def reduced_grads():  # each parameter's reduced gradient gathered whole from its shards
            return [_full(p.grad) for p in model.parameters() if p.grad is not None]

        out = []
        for step in range(job["steps"]):
            plain.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
            brute = _brute_force(plain, task, ctx)
            hook.begin_step(step)
            out.append(monitored_step(model, hook, task, ctx, cfg, brute, reduced_grads))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return out
    finally:
        shutdown_worker()
