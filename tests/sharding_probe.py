"""Worker functions for tests/test_sharding_statistics.py (importable by forked and spawned workers: tests/ is on
their sys.path): the FSDP statistics at one worker, and the reductions the sharded hook refuses."""

from __future__ import annotations

import torch

from ars_opd.config import ParallelConfig, SFTConfig
from ars_opd.training.distributed import init_worker, shutdown_worker
from ddp_probe import FixedTask, tiny_model


def _tokenizer():
    from ars_opd.data import synthetic
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    return build_char_word_tokenizer(synthetic.instruction_words())


def one_worker_probe(job: dict) -> dict:
    """``job["steps"]`` engine steps (``Trainer.step``) of the same tiny model and batches at K = 1 under each
    strategy, with its consistency hook: each step's pre-clip norm, statistics and noise-scale terms."""
    from ars_opd.lm.optim import make_optimizer, make_scheduler
    from ars_opd.training.checkpoint import TrainerState
    from ars_opd.training.consistency import ConsistencyHook
    from ars_opd.training.loop import Trainer
    from ars_opd.training.sharding import ShardedConsistencyHook
    from ars_opd.training.wrapping import wrap_model

    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        tok = _tokenizer()
        cfg = SFTConfig(steps=job["steps"], warmup_steps=0, global_batch_size=8, micro_batch_size=1, lr=1e-2)
        out = {}
        for strategy in ("ddp", "fsdp"):
            model = tiny_model(tok)
            wrapped = wrap_model(model, ctx, ParallelConfig(workers=1, strategy=strategy), cfg)
            hook = (ShardedConsistencyHook if strategy == "fsdp" else ConsistencyHook)(1)
            hook.attach(wrapped)
            task = FixedTask(job["batches"], ctx, tok.pad_token_id, False)
            opt = make_optimizer(model, cfg)
            sched = make_scheduler(opt, cfg, cfg.steps)
            state, rows = TrainerState(), []
            for _ in range(job["steps"]):
                r = Trainer(
                    model=wrapped,
                    task=task,
                    opt=opt,
                    sched=sched,
                    ctx=ctx,
                    cfg=cfg,
                    state=state,
                    monitor=hook,
                    fault=None,
                    drift_every=0,
                ).step()
                rows.append(
                    {
                        "grad_norm": r.grad_norm,
                        "consistency": r.consistency,
                        "noise": list(r.noise_scale),
                        "reductions": hook.reductions,
                    }
                )
                state.step += 1
            out[strategy] = {"rows": rows, "params": sum(p.numel() for p in model.parameters())}
            del wrapped
        return out
    finally:
        shutdown_worker()


def reduction_probe(job: dict) -> str | None:
    """One backward of a sharded tiny model under the sharded hook, its reduction set up as ``job["case"]``:
    ``default`` (FSDP's own: AVG in fp32), ``fp16`` (an fp16 reduce dtype, which FSDP pre-divides) or
    ``force_sum`` (``set_force_sum_reduction_for_comms``). The hook's refusal message, or None."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ars_opd.training.loop import Trainer
    from ars_opd.training.sharding import (
        ShardedConsistencyHook,
        UnreadableReductionError,
        decoder_layers,
        fsdp_modules,
    )

    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        tok = _tokenizer()
        model = tiny_model(tok)
        reduce_dtype = torch.float16 if job["case"] == "fp16" else None
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if job["case"] == "force_sum":
            for module in fsdp_modules(model):
                module.set_force_sum_reduction_for_comms(True)
        hook = ShardedConsistencyHook(ctx.world_size)
        hook.attach(model)
        hook.begin_step(0)
        task = FixedTask(job["batches"], ctx, tok.pad_token_id, False)
        cfg = SFTConfig(steps=1, warmup_steps=0, global_batch_size=8, micro_batch_size=1)
        try:
            Trainer(model=model, task=task, ctx=ctx, cfg=cfg).accumulate(task.micro)
        except UnreadableReductionError as e:
            return str(e)
        return None
    finally:
        shutdown_worker()
