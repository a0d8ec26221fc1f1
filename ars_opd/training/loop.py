"""The training engine shared by SFT and OPD: data-parallel workers, one global token-mean loss, explicit clipping.

The student is DDP-wrapped (``ddp.strategy: ddp``) or sharded with FSDP2 (``fsdp``,
``ars_opd.training.sharding``; the wrapping is ``ars_opd.training.wrapping``); the steps below are the same
for both (FSDP2's reduce-scatter averages over the workers as DDP's all-reduce does, and ``no_sync`` is its
``set_requires_gradient_sync``).

One optimiser step, on every worker k of K:

1. the task builds this worker's micro-batches for the step (SFT: slices of the data; OPD: rollouts);
2. the valid-token count of the *whole* global batch is all-reduced before any backward (with the count of
   what the task's loss averages over when that is not tokens: ``MicroBatch.loss_units``, e.g. OPD's
   completions under ``opd.loss_normalisation: sequence``, whose count then takes N_global's place below);
3. each micro-batch's summed token loss is back-propagated scaled by ``K / N_global``, the last one
   outside ``no_sync`` so DDP all-reduces once. DDP's all-reduce averages over the K workers, so the
   reduced gradient is the gradient of (sum of every token loss of the step) / N_global, whatever the
   split into workers and micro-batches (tested: 1x8, 2x4 and 2x2 with accumulation 2 agree within the
   bound of fp32 rounding, ``tests/tolerances.py``).
   The ``K`` is the explicit inverse of DDP's documented mean; no implicit framework scaling is relied on
   (docs/design.md, "Loss normalisation");
4. the pre-clip norm of the reduced gradient is logged; it is clipped to ``max_grad_norm`` unless that is
   null (``noclip``); a non-finite loss or gradient skips the step (counted) or stops the run, by param;
5. AdamW step, LR schedule step; one all-gather of a few scalars per worker for the log.

This module holds that step and the run around it on one object, ``Trainer``: the worker's context, the
wrapped student, the task, the optimizer and schedule, the counters, the monitor, the fault and the strategy
live on it, so its parts take what is theirs and nothing else (``accumulate``, ``optimizer_step``, ``step``;
``fit``, the run, with its ``Checkpoints``). What they call on keeps its own rule in its own module of
``ars_opd.training``: ``wrapping`` (DDP or FSDP2), ``step_gather`` (the step's one all-gather), ``drift``
(the replica check), ``task`` (the task interface, the run's identity and hooks), ``step_log``,
``noise_scale``, ``budget``, ``snapshots``, ``checkpoint`` and ``batch_plan`` (batch split and data position).

What this module leaves out: tensor parallelism, mixed-precision loss scaling (bf16 needs none),
gradient checkpointing, and the loss itself (tasks provide it; see ``ars_opd.training.sft``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ars_opd.config import ParallelConfig, TrainingPaths, TrainLoopConfig
from ars_opd.lm.optim import autocast_context, clip_gradients, make_optimizer, make_scheduler
from ars_opd.training.budget import BudgetTotals
from ars_opd.training.checkpoint import Checkpoints, TrainerState
from ars_opd.training.consistency import ConsistencyHook, consistency_metrics, noise_scale_terms
from ars_opd.training.distributed import WorkerContext, gather_floats
from ars_opd.training.drift import check_drift
from ars_opd.training.faults import Fault
from ars_opd.training.noise_scale import NoiseScale
from ars_opd.training.sharding import ShardedConsistencyHook, publishable
from ars_opd.training.snapshots import run_snapshot_dir, save_snapshot
from ars_opd.training.step_gather import Accumulated, StepColumns
from ars_opd.training.step_log import StepLogger, StepResult, StepRows, run_summary
from ars_opd.training.task import MicroBatch, RunHooks, RunIdentity, TrainingTask
from ars_opd.training.wrapping import no_sync, unwrapped, wrap_model


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``nonfinite: stop`` (or too many skipped steps)."""


class FitResult(NamedTuple):
    state: TrainerState
    rows: list[dict]  # the per-step log (rank 0's view; identical values on every rank)
    totals: dict  # the cumulative budget from scratch
    model: torch.nn.Module | None  # the trained student whole, to publish (rank 0; None on other ranks when sharded)


@dataclass(kw_only=True)
class Trainer:
    """One worker's training run: the engine's state on one object, built by keyword.

    ``Trainer.build`` makes it for a run (it wraps the student, attaches the consistency monitor, makes the
    optimizer and the schedule) and ``fit`` trains it; a probe or a benchmark builds one from pieces of its
    own (a hand-wrapped model, no optimizer) and calls ``step`` or ``accumulate`` directly.
    """

    ctx: WorkerContext
    model: torch.nn.Module  # the model the steps run: DDP-wrapped, or sharded in place (ars_opd.training.wrapping)
    task: TrainingTask
    cfg: TrainLoopConfig
    opt: Any = None
    sched: Any = None
    state: TrainerState = field(default_factory=TrainerState)
    monitor: ConsistencyHook | None = None
    fault: Fault | None = None  # the injected fault as this rank sees it (``ars_opd.training.faults``)
    drift_every: int = 0  # the replica check's period (0: never)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the strategy, the monitor's settings
    hooks: RunHooks = RunHooks()
    publish: torch.nn.Module | None = None  # sharded: rank 0's unsharded CPU copy, loaded whenever it publishes
    run: RunIdentity | None = None  # set by ``fit``: the fingerprints its checkpoints match

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped student (what the optimizer holds and the checkpoints save)."""
        return unwrapped(self.model)

    @classmethod
    def build(
        cls,
        ctx: WorkerContext,
        model: torch.nn.Module,
        task: TrainingTask,
        cfg: TrainLoopConfig,
        parallel: ParallelConfig,
        hooks: RunHooks = RunHooks(),
    ) -> Trainer:
        """The run's trainer for ``model`` (unwrapped, on ``ctx.device``; ``ddp.strategy: fsdp`` shards it in
        place, and rank 0 then keeps an unsharded CPU copy to publish from)."""
        sharded = parallel.strategy == "fsdp"
        publish = copy.deepcopy(model).cpu() if sharded and ctx.is_main else None  # rank 0 writes snapshots from it
        wrapped = wrap_model(model, ctx, parallel, cfg)
        monitor = None
        if parallel.consistency:
            monitor = (ShardedConsistencyHook if sharded else ConsistencyHook)(
                ctx.world_size, gram_every=parallel.gram_every
            )
            monitor.attach(wrapped)
        opt = make_optimizer(model, cfg)
        return cls(
            ctx=ctx,
            model=wrapped,
            task=task,
            cfg=cfg,
            opt=opt,
            sched=make_scheduler(opt, cfg, cfg.steps),
            monitor=monitor,
            fault=hooks.fault,
            drift_every=0 if sharded else parallel.drift_check_every,  # no replicas to compare (training.sharding)
            parallel=parallel,
            hooks=hooks,
            publish=publish,
        )

    def accumulate(self, micro: list[MicroBatch]) -> Accumulated:
        """Forward/backward every micro-batch of the step with the global token normalisation (or the task's
        units: ``MicroBatch.loss_units``, e.g. OPD's sequences under ``opd.loss_normalisation: sequence``).

        After it returns, every parameter's ``.grad`` holds the reduced gradient of the global token-mean loss.
        An injected fault (``ars_opd.training.faults``) may skip micro-batches (their tokens still counted) or
        scale this rank's loss in the backward.
        """
        ctx, cfg, fault, step = self.ctx, self.cfg, self.fault, self.state.step
        local_tokens = sum(b.n_tokens for b in micro)
        local_units = sum(b.loss_units for b in micro)  # tokens, unless the task averages over sequences
        counts = torch.tensor([float(local_tokens), float(local_units)], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(counts)  # before any backward: the normaliser of the whole global batch
        global_tokens, global_units = (int(c) for c in counts.tolist())
        if global_tokens == 0 or global_units == 0:
            raise ValueError(
                "a step's global batch holds no loss tokens (every completion masked); check the "
                "data and the prompt/completion budgets"
            )
        scale = ctx.world_size / global_units  # DDP averages over workers: x K undoes that mean, / N normalises
        if fault is not None:
            scale *= fault.loss_factor(step)
        local_sum, flops, generated = 0.0, 0.0, 0
        metric_sums: dict[str, list[float]] = {}
        for i, batch in enumerate(micro):
            if fault is not None and fault.drops(step, i, len(micro)):
                continue
            flops += batch.flops
            generated += batch.generated_tokens
            last = i == len(micro) - 1
            # the backward too inside no_sync: DDP decides at the forward, FSDP2 at the backward (autocast:
            # forward only)
            with contextlib.nullcontext() if last else no_sync(self.model):
                with autocast_context(cfg.precision, ctx.device):
                    loss_sum, metrics = self.task.loss_sum(self.model, batch)
                (loss_sum.float() * scale).backward()
            local_sum += loss_sum.detach().float().item()
            for k, v in list(metrics.items()) + list(batch.meta.items()):
                acc = metric_sums.setdefault(k, [0.0, 0.0])
                acc[0] += v[0]
                acc[1] += v[1]
        if not micro:
            raise ValueError("a worker got no micro-batches for the step")
        return Accumulated(
            local_sum,
            local_tokens,
            global_tokens,
            {k: (v[0], v[1]) for k, v in metric_sums.items()},
            flops,
            generated,
            local_units,
            global_units,
        )

    def optimizer_step(self, loss: float) -> tuple[float, float, bool, bool]:
        """Clip (or not), check finiteness, step. Returns (pre-clip norm, clip coef, clipped, skipped)."""
        cfg, state, opt = self.cfg, self.state, self.opt
        params = [p for p in self.module.parameters() if p.grad is not None]
        finite = math.isfinite(loss)
        norm, clip_coef = clip_gradients(params, cfg.max_grad_norm if finite else None)
        finite = finite and math.isfinite(norm)
        clipped = clip_coef < 1.0
        skipped = False
        if not finite:
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            if cfg.nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite {what} ({loss if what == 'loss' else norm}) at step {state.step}; "
                    "set nonfinite: skip to skip such steps, or lower the learning rate"
                )
            skipped = True
            state.skipped_steps += 1
            if state.skipped_steps > cfg.max_skipped_steps:
                raise NonFiniteError(
                    f"{state.skipped_steps} steps skipped for non-finite values (limit "
                    f"max_skipped_steps = {cfg.max_skipped_steps}); the run is diverging"
                )
            opt.zero_grad(set_to_none=True)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
            if clipped:
                state.clipped_steps += 1
        with warnings.catch_warnings():  # a skipped step still advances the schedule: lr stays a function of step
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            self.sched.step()
        return norm, clip_coef, clipped, skipped

    def step(self) -> StepResult:
        """One optimiser step of ``state.step`` (the module doc's five parts); the caller advances the step."""
        ctx, task, state, monitor, fault = self.ctx, self.task, self.state, self.monitor, self.fault
        model = self.module
        if fault is not None:
            fault.perturb(model, state.step)
        monitor_s = {}
        check = self.drift_every and state.step % self.drift_every == 0
        drift = check_drift(model, self.opt, ctx, monitor_s) if check else None
        micro = task.micro_batches(state.step, model)
        if monitor is not None:
            monitor.begin_step(state.step)
        acc = self.accumulate(micro)
        global_tokens = acc.global_tokens
        names = task.metric_names()
        t0 = time.perf_counter()
        stats = monitor.local_stats(ctx.device) if monitor is not None else torch.full((2,), float("nan"))
        stats_s = time.perf_counter() - t0
        processed = sum(b.n_real_tokens for b in micro)
        columns = StepColumns(tuple(names))
        gathered = gather_floats(columns.pack(acc, stats, processed, ctx.device), ctx.device)  # the one gather
        t0 = time.perf_counter()
        gram = monitor.gram() if monitor is not None else None
        stats_s += time.perf_counter() - t0
        loss = gathered[:, columns.LOSS_SUM].sum().item() / acc.global_units
        metrics = {}
        for i, n in enumerate(names):
            s, c = gathered[:, columns.metric_sum(i)].sum().item(), gathered[:, columns.metric_count(i)].sum().item()
            metrics[n] = s / c if c else float("nan")
        worker_metrics = {}  # the task's columns it also wants per worker (each worker's own sum / count)
        for n in getattr(task, "worker_metric_names", tuple)():
            i = names.index(n)
            sums, counts = gathered[:, columns.metric_sum(i)].tolist(), gathered[:, columns.metric_count(i)].tolist()
            worker_metrics[n] = [s / c if c else float("nan") for s, c in zip(sums, counts)]
        check = getattr(task, "check_step", None)
        if check is not None:  # the task may refuse the step from its reduced columns, before the update
            check(state.step, metrics)
        norm, coef, clipped, skipped = self.optimizer_step(loss)
        worker_tokens = [int(t) for t in gathered[:, columns.TOKENS].tolist()]
        worker_units = [int(u) for u in gathered[:, columns.UNITS].tolist()]  # = worker_tokens unless per sequence
        worker_loss = [
            s / u if u else float("nan") for s, u in zip(gathered[:, columns.LOSS_SUM].tolist(), worker_units)
        ]
        budget = {
            "flops": gathered[:, columns.FLOPS].sum().item(),
            "tokens_generated": int(gathered[:, columns.GENERATED].sum().item()),
            "tokens_processed": int(gathered[:, columns.PROCESSED].sum().item()),
            "tokens_trained": global_tokens,
            "teacher_tokens": task.teacher_tokens(state.step),  # the same on every rank: no column to gather
        }
        consistency, noise = {}, (float("nan"), float("nan"))
        if monitor is not None:
            # ‖ḡ‖ is the pre-clip norm of the reduced gradient (identical on every worker)
            t0 = time.perf_counter()
            consistency = consistency_metrics(
                worker_loss,
                gathered[:, columns.GRAD_SQ].tolist(),
                gathered[:, columns.GRAD_DOT].tolist(),
                norm * norm,
                gram,
            )
            t1 = time.perf_counter()
            # each worker's batch size in the units its loss averages over (tokens, or sequences)
            noise = noise_scale_terms(gathered[:, columns.GRAD_SQ].tolist(), worker_units, norm * norm)
            monitor_s.update(
                hook=monitor.host_seconds(), stats=stats_s, metrics=t1 - t0, noise_scale=time.perf_counter() - t1
            )
        state.tokens_seen += global_tokens
        return StepResult(
            loss=loss,
            tokens=global_tokens,
            grad_norm=norm,
            clip_coef=coef,
            clipped=clipped,
            skipped=skipped,
            worker_loss=worker_loss,
            worker_tokens=worker_tokens,
            metrics=metrics,
            worker_metrics=worker_metrics,
            consistency=consistency,
            noise_scale=noise,
            drift=drift,
            budget=budget,
            monitor_s=monitor_s,
        )

    def fit(self, out: TrainingPaths, run: RunIdentity) -> FitResult:
        """Train for ``cfg.steps`` optimiser steps, resuming if possible.

        ``out`` is the stage's outputs: checkpoints in ``out.checkpoints``, the step log in ``out.steps``, DVCLive
        in ``out.live``. Every ``cfg.snapshot_every`` steps rank 0 keeps the weights (``ars_opd.training.snapshots``).
        A checkpoint resumes when it matches ``run``'s fingerprints (``ars_opd.training.checkpoint``).
        Returns the final state, the per-step log (rank 0's view; identical values on every rank), the
        cumulative budget from scratch (``run.budget_start``: the starting model's) and the student to publish
        (under fsdp rank 0's copy, loaded with the gathered weights).
        """
        from tqdm.auto import tqdm

        ctx, cfg, model = self.ctx, self.cfg, self.module
        self.run = run
        ckpt_dir = Path(out.checkpoints)
        checkpoints = Checkpoints(
            directory=ckpt_dir,
            ctx=ctx,
            model=model,
            opt=self.opt,
            sched=self.sched,
            fingerprint=run.fingerprint,
            layout_fingerprint=run.layout_fingerprint,
            strategy=self.parallel.strategy,
            reshard=self.parallel.reshard_resume,
            keep=cfg.keep_checkpoints,
        )
        found, state, history = checkpoints.resume()
        self.state = state
        logger = StepLogger(Path(out.steps), Path(out.live), enabled=ctx.is_main)
        logger.replay(history)
        totals = BudgetTotals.from_log(run.budget_start or {}, history)
        rows = StepRows(self.parallel, self.fault, NoiseScale.from_log(self.parallel.noise_scale_ema, history), totals)
        snapshots = run_snapshot_dir(
            ckpt_dir, run.fingerprint, found.fingerprint if found is not None else None, ctx.is_main, cfg.snapshot_every
        )
        bar = tqdm(
            total=cfg.steps,
            initial=state.step,
            desc="train",
            unit="step",
            disable=not (self.hooks.progress and ctx.is_main),
            mininterval=1.0,
            dynamic_ncols=True,
        )
        try:
            while state.step < cfg.steps:
                t0 = time.perf_counter()
                lr = self.opt.param_groups[0]["lr"]  # the rate this step uses (step() advances the schedule)
                result = self.step()
                step_s = time.perf_counter() - t0
                state.train_seconds += step_s
                row = rows.row(state, result, lr, step_s)
                if self.hooks.on_step is not None:
                    row.update(self.hooks.on_step(state.step) or {})
                logger.log(row)
                state.step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", gnorm=f"{result.grad_norm:.2f}", refresh=False)
                if cfg.snapshot_every and state.step % cfg.snapshot_every == 0:
                    weights = publishable(model, self.publish)  # sharded: a collective, every rank gathers
                    if ctx.is_main:
                        save_snapshot(snapshots, weights, state.step, totals.totals)
                if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                    checkpoints.save(state, logger.rows)  # this step's state, with the log so far
            if found is None or state.resumed_from != cfg.steps or found.resharded_from is not None:
                checkpoints.save(state, logger.rows)
            logger.summary(run_summary(logger.rows, state, totals))
            final = publishable(model, self.publish)  # sharded: a collective, every rank gathers
        finally:
            bar.close()
            logger.close()
        return FitResult(state, logger.rows, dict(totals.totals), final)
