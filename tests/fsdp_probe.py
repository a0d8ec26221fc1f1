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


def fsdp_fault_probe(job: dict) -> list[dict]:
    """The detection benchmark's fault runs, CI-sized, on the sharded built-in student (K workers, fsdp): SFT
    on reference answers, a healthy trajectory to ``onset``, then each fault of ``job["cases"]`` on rank
    ``job["rank"]`` branched from the state there. Returns each case's step rows (rank 0's log view)."""
    import copy
    import random

    from ars_opd.config import ArchConfig, InjectConfig, ParallelConfig
    from ars_opd.data import synthetic
    from ars_opd.data.prompts import alpaca_messages
    from ars_opd.lm.optim import make_optimizer, make_scheduler
    from ars_opd.models.builtin import build_causal_lm
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.seeding import set_seeds
    from ars_opd.training.batch_plan import BatchGeometry
    from ars_opd.training.checkpoint import TrainerState
    from ars_opd.training.faults import Fault
    from ars_opd.training.loop import Trainer
    from ars_opd.training.sft import SFTTask, encode_sft_rows
    from ars_opd.training.sharding import ShardedConsistencyHook
    from ars_opd.training.worker import WorkerSetup
    from ars_opd.training.wrapping import wrap_model

    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=300)
    try:
        tok = build_char_word_tokenizer(synthetic.instruction_words())
        rows = [
            {"messages": alpaca_messages(r["instruction"], r["input"]), "completion": r["output"], "task": r["task"]}
            for r in synthetic.generate(1000, seed=7)
        ]
        cfg = SFTConfig(**job["sft"])
        data = encode_sft_rows(tok, rows, cfg)
        geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "sft")
        model = build_causal_lm(ArchConfig(**job["arch"]), tok, 3)
        set_seeds(5)
        task = SFTTask(
            data, cfg, WorkerSetup(ctx, tok, geometry, sampler_seed=11, stage_seed=0, fault=None), vocab=len(tok)
        )
        sharded = wrap_model(model, ctx, ParallelConfig(workers=ctx.world_size, strategy="fsdp"), cfg)
        hook = ShardedConsistencyHook(ctx.world_size)
        hook.attach(sharded)
        opt = make_optimizer(model, cfg)
        sched = make_scheduler(opt, cfg, cfg.steps)

        def run(state, until, fault):
            rows = []
            while state.step < until:
                r = Trainer(
                    model=sharded,
                    task=task,
                    opt=opt,
                    sched=sched,
                    ctx=ctx,
                    cfg=cfg,
                    state=state,
                    monitor=hook,
                    fault=fault,
                    drift_every=0,
                ).step()
                rows.append(
                    {
                        "step": state.step,
                        "loss": r.loss,
                        "worker_loss": r.worker_loss,
                        "consistency/worker_grad_norm": r.consistency["worker_grad_norm"],
                        "consistency/worker_cos_to_mean": r.consistency["worker_cos_to_mean"],
                        "drift_mismatch": r.drift,
                    }
                )
                state.step += 1
            return rows

        before = run(TrainerState(), job["onset"], None)
        saved = (
            copy.deepcopy(model.state_dict()),
            copy.deepcopy(opt.state_dict()),
            copy.deepcopy(sched.state_dict()),
            torch.get_rng_state(),
            random.getstate(),
        )
        out = []
        for kind, magnitude in job["cases"]:
            model.load_state_dict(saved[0])
            opt.load_state_dict(copy.deepcopy(saved[1]))
            sched.load_state_dict(saved[2])
            torch.set_rng_state(saved[3])
            random.setstate(saved[4])
            inject = InjectConfig(kind=kind, rank=job["rank"], start_step=job["onset"], magnitude=magnitude)
            task.fault = Fault(inject, "sft", ctx.rank, 13)
            out.append(before + run(TrainerState(step=job["onset"]), job["onset"] + job["fault_steps"], task.fault))
            task.fault = None
        return out
    finally:
        shutdown_worker()


def fsdp_engine_probe(job: dict) -> dict:
    """A sharded student (FSDP2, ``job["bf16"]``: bf16 mixed precision) publishes version 0 to an fp32 engine in
    rank 0's process (``in_process_engine``) and the version check runs: rank 0's sync row, or the refusal."""
    import copy
    from pathlib import Path

    from ars_opd.data import synthetic
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.rollouts.engine_api import EngineError
    from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan
    from ars_opd.training.sharding import shard_model
    from in_process_engine import RecordingEngine

    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        tok = build_char_word_tokenizer(synthetic.instruction_words())
        model = tiny_model(tok)
        with torch.no_grad():  # sharper next-token laws than the init's, where bf16 rounding shows
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(8.0)
        engine = RecordingEngine(copy.deepcopy(model))
        shard_model(model, ctx.device, bf16=job["bf16"])
        plan = RolloutPlan(steps=1, max_lag=0, sync_every=1, sync_dir=Path("unused"), seed=1, rollout_seed=1)
        rollouts = EngineRollouts(engine, plan, spec=None, rank=ctx.rank, world=ctx.world_size, transport=engine)
        try:
            row = rollouts._publish(0, model, ctx.device)
        except EngineError as e:
            return {"error": str(e)}
        finally:
            rollouts.close()
        return {k: v for k, v in row.items() if isinstance(v, (int, float))}
    finally:
        shutdown_worker()
