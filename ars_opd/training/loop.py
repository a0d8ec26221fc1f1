"""The training engine shared by SFT and OPD: data-parallel workers, one global token-mean loss, explicit clipping.

The student is DDP-wrapped (``ddp.strategy: ddp``) or sharded with FSDP2 (``fsdp``,
``ars_opd.training.sharding``); the steps below are the same for both (FSDP2's reduce-scatter averages
over the workers as DDP's all-reduce does, and ``no_sync`` is its ``set_requires_gradient_sync``).

One optimiser step, on every worker k of K:

1. the task builds this worker's micro-batches for the step (SFT: slices of the data; OPD: rollouts);
2. the valid-token count of the *whole* global batch is all-reduced before any backward;
3. each micro-batch's summed token loss is back-propagated scaled by ``K / N_global``, the last one
   outside ``no_sync`` so DDP all-reduces once. DDP's all-reduce averages over the K workers, so the
   reduced gradient is the gradient of (sum of every token loss of the step) / N_global, whatever the
   split into workers and micro-batches (tested: 1x8, 2x4 and 2x2 with accumulation 2 agree to 1e-6).
   The ``K`` is the explicit inverse of DDP's documented mean; no implicit framework scaling is relied on
   (docs/design.md, "Loss normalisation");
4. the pre-clip norm of the reduced gradient is logged; it is clipped to ``max_grad_norm`` unless that is
   null (``noclip``); a non-finite loss or gradient skips the step (counted) or stops the run, by param;
5. AdamW step, LR schedule step; one all-gather of a few scalars per worker for the log.

The per-step log (``steps.jsonl``, rank 0) holds one JSON line per step with the per-worker columns.
Columns whose name ends in ``_s`` are wall-clock seconds: they go to DVCLive (``dvc plots``,
``dvc exp show``) but not into ``steps.jsonl``, so an identical retrain writes an identical log and DVC
reruns nothing downstream of it. Checkpoints: ``ars_opd.training.checkpoint``; batch split and data
position: ``ars_opd.training.geometry``.

What this module leaves out: tensor parallelism, mixed-precision loss scaling (bf16 needs none),
gradient checkpointing, and the loss itself (tasks provide it; see ``ars_opd.training.sft``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ars_opd.config import DDPConfig, TrainLoopConfig
from ars_opd.models.adapters import save_trained
from ars_opd.training.budget import FIELDS, write_budget
from ars_opd.training.checkpoint import TrainerState, find_checkpoint, load_checkpoint, save_checkpoint
from ars_opd.training.consistency import ConsistencyHook, consistency_metrics, noise_scale_terms
from ars_opd.training.distributed import WorkerContext, gather_floats
from ars_opd.training.drift import fingerprint, mismatched_ranks
from ars_opd.training.faults import Fault
from ars_opd.training.optim import autocast_context, clip_gradients, make_optimizer, make_scheduler
from ars_opd.training.sharding import ShardedConsistencyHook, full_state_dict, is_sharded, no_gradient_sync, shard_model


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``nonfinite: stop`` (or too many skipped steps)."""


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


class TrainingTask(Protocol):
    """What the engine needs from SFT or OPD."""

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        """This worker's micro-batches for ``step`` (``model`` is the unwrapped module, e.g. for rollouts)."""

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed per-token loss over the batch's valid tokens (0-dim, fp32, with grad) and metric sums."""

    def metric_names(self) -> list[str]:
        """Task metrics reported per step; each is a (sum, count) pair reduced over all workers."""


def is_timing(column: str) -> bool:
    """Wall-clock columns (seconds): logged to DVCLive, kept out of ``steps.jsonl``."""
    return column.endswith("_s")


@dataclass
class StepResult:
    loss: float
    tokens: int
    grad_norm: float
    clip_coef: float
    clipped: bool
    skipped: bool
    worker_loss: list[float]
    worker_tokens: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    consistency: dict = field(default_factory=dict)
    noise_scale: tuple[float, float] = (float("nan"), float("nan"))  # (|G|², tr Σ) estimates of the step
    drift: list[int] | None = None  # ranks whose replica differs (None: not checked this step)
    budget: dict = field(default_factory=dict)  # this step's flops, tokens_trained/processed/generated
    # host seconds of each part of the monitor this step (hook, stats, metrics, noise_scale; drift and
    # drift_gather on a check step): what bench/consistency_overhead.py breaks the overhead into; not logged
    monitor_s: dict[str, float] = field(default_factory=dict)


def wrap_ddp(model: torch.nn.Module, ctx: WorkerContext, ddp_cfg: DDPConfig) -> DDP:
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               bucket_cap_mb=ddp_cfg.bucket_cap_mb, gradient_as_bucket_view=ddp_cfg.gradient_as_bucket_view)


def wrap_model(model: torch.nn.Module, ctx: WorkerContext, ddp_cfg: DDPConfig, cfg: TrainLoopConfig):
    """The model the engine trains: DDP-wrapped (``ddp.strategy: ddp``) or sharded in place (``fsdp``)."""
    if ddp_cfg.strategy == "fsdp":
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and ctx.device.type == "cuda")
        return shard_model(model, ctx.device, bf16)
    return wrap_ddp(model, ctx, ddp_cfg)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The trained module itself: DDP's ``.module``; a sharded model is its own."""
    return model.module if isinstance(model, DDP) else model


def _no_sync(model: torch.nn.Module):
    return no_gradient_sync(model) if is_sharded(model) else model.no_sync()


class Accumulated(NamedTuple):
    """One rank's view of a step's forward/backward passes."""

    local_sum: float  # summed token loss of this rank's micro-batches
    local_tokens: int  # their loss tokens
    global_tokens: int  # loss tokens of the whole global batch (the normaliser)
    metrics: dict[str, tuple[float, float]]  # task metric (sum, count) pairs
    flops: float  # estimated FLOPs of the micro-batches processed
    generated: int  # tokens sampled for them


def accumulate_gradients(ddp_model: DDP, task: TrainingTask, micro: list[MicroBatch], ctx: WorkerContext,
                         cfg: TrainLoopConfig, fault: Fault | None = None, step: int = 0) -> Accumulated:
    """Forward/backward every micro-batch of the step with the global token normalisation.

    After it returns, every parameter's ``.grad`` holds the reduced gradient of the global token-mean loss.
    An injected fault (``ars_opd.training.faults``) may skip micro-batches (their tokens still counted) or
    scale this rank's loss in the backward.
    """
    local_tokens = sum(b.n_tokens for b in micro)
    counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(counts)  # before any backward: the normaliser of the whole global batch
    global_tokens = int(counts.item())
    if global_tokens == 0:
        raise ValueError("a step's global batch holds no loss tokens (every completion masked); check the "
                         "data and the prompt/completion budgets")
    scale = ctx.world_size / global_tokens  # DDP averages over workers: x K undoes that mean, / N normalises
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
        # the backward too inside no_sync: DDP decides at the forward, FSDP2 at the backward (autocast: forward only)
        with contextlib.nullcontext() if last else _no_sync(ddp_model):
            with autocast_context(cfg.precision, ctx.device):
                loss_sum, metrics = task.loss_sum(ddp_model, batch)
            (loss_sum.float() * scale).backward()
        local_sum += loss_sum.detach().float().item()
        for k, v in list(metrics.items()) + list(batch.meta.items()):
            acc = metric_sums.setdefault(k, [0.0, 0.0])
            acc[0] += v[0]
            acc[1] += v[1]
    if not micro:
        raise ValueError("a worker got no micro-batches for the step")
    return Accumulated(local_sum, local_tokens, global_tokens, {k: (v[0], v[1]) for k, v in metric_sums.items()},
                       flops, generated)


def optimizer_step(model: torch.nn.Module, opt, sched, cfg: TrainLoopConfig, loss: float,
                   state: TrainerState) -> tuple[float, float, bool, bool]:
    """Clip (or not), check finiteness, step. Returns (pre-clip norm, clip coef, clipped, skipped)."""
    params = [p for p in model.parameters() if p.grad is not None]
    finite = math.isfinite(loss)
    norm, clip_coef = clip_gradients(params, cfg.max_grad_norm if finite else None)
    finite = finite and math.isfinite(norm)
    clipped = clip_coef < 1.0
    skipped = False
    if not finite:
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        if cfg.nonfinite == "stop":
            raise NonFiniteError(f"non-finite {what} ({loss if what == 'loss' else norm}) at step {state.step}; "
                                 "set nonfinite: skip to skip such steps, or lower the learning rate")
        skipped = True
        state.skipped_steps += 1
        if state.skipped_steps > cfg.max_skipped_steps:
            raise NonFiniteError(f"{state.skipped_steps} steps skipped for non-finite values (limit "
                                 f"max_skipped_steps = {cfg.max_skipped_steps}); the run is diverging")
        opt.zero_grad(set_to_none=True)
    else:
        opt.step()
        opt.zero_grad(set_to_none=True)
        if clipped:
            state.clipped_steps += 1
    with warnings.catch_warnings():  # a skipped step still advances the schedule: lr stays a function of step
        warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
        sched.step()
    return norm, clip_coef, clipped, skipped


def check_drift(model: torch.nn.Module, opt, ctx: WorkerContext, seconds: dict | None = None) -> list[int]:
    """All ranks call: all-gather every rank's fingerprint; the ranks that differ from the majority.

    ``seconds`` (optional) gets the time of this rank's fingerprint (``drift``) and of the all-gather and
    comparison (``drift_gather``), apart: the gather also waits for the slowest rank, a wait that the step's
    next collective would otherwise take.
    """
    t0 = time.perf_counter()
    local = fingerprint(model, opt).to(ctx.device)
    if seconds is not None and local.is_cuda:
        torch.cuda.synchronize(local.device)  # the fingerprint's time, not its launch (.cpu() waits below anyway)
    t1 = time.perf_counter()
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local)
    found = mismatched_ranks(torch.stack(parts).cpu())
    if seconds is not None:
        seconds.update(drift=t1 - t0, drift_gather=time.perf_counter() - t1)
    return found


def train_step(ddp_model: DDP, task: TrainingTask, opt, sched, ctx: WorkerContext, cfg: TrainLoopConfig,
               state: TrainerState, monitor: ConsistencyHook | None = None, fault: Fault | None = None,
               drift_every: int = 0) -> StepResult:
    model = unwrapped(ddp_model)
    if fault is not None:
        fault.perturb(model, state.step)
    monitor_s = {}
    drift = check_drift(model, opt, ctx, monitor_s) if drift_every and state.step % drift_every == 0 else None
    micro = task.micro_batches(state.step, model)
    if monitor is not None:
        monitor.begin_step(state.step)
    acc = accumulate_gradients(ddp_model, task, micro, ctx, cfg, fault, state.step)
    global_tokens = acc.global_tokens
    names = task.metric_names()
    t0 = time.perf_counter()
    stats = monitor.local_stats(ctx.device) if monitor is not None else torch.full((2,), float("nan"))
    stats_s = time.perf_counter() - t0
    processed = sum(b.n_real_tokens for b in micro)
    vec = torch.cat([torch.tensor([acc.local_sum, float(acc.local_tokens)], dtype=torch.float64, device=ctx.device),
                     stats.to(device=ctx.device, dtype=torch.float64),
                     torch.tensor([acc.flops, float(acc.generated), float(processed)], dtype=torch.float64,
                                  device=ctx.device),
                     torch.tensor([x for n in names for x in acc.metrics.get(n, (0.0, 0.0))],
                                  dtype=torch.float64, device=ctx.device)])
    gathered = gather_floats(vec, ctx.device)  # (K, 7 + 2M): the one per-step gather
    t0 = time.perf_counter()
    gram = monitor.gram() if monitor is not None else None
    stats_s += time.perf_counter() - t0
    loss = gathered[:, 0].sum().item() / global_tokens
    norm, coef, clipped, skipped = optimizer_step(model, opt, sched, cfg, loss, state)
    worker_tokens = [int(t) for t in gathered[:, 1].tolist()]
    worker_loss = [s / t if t else float("nan") for s, t in zip(gathered[:, 0].tolist(), worker_tokens)]
    metrics = {}
    for i, n in enumerate(names):
        s, c = gathered[:, 7 + 2 * i].sum().item(), gathered[:, 8 + 2 * i].sum().item()
        metrics[n] = s / c if c else float("nan")
    budget = {"flops": gathered[:, 4].sum().item(), "tokens_generated": int(gathered[:, 5].sum().item()),
              "tokens_processed": int(gathered[:, 6].sum().item()), "tokens_trained": global_tokens}
    consistency, noise = {}, (float("nan"), float("nan"))
    if monitor is not None:
        # ‖ḡ‖ is the pre-clip norm of the reduced gradient (identical on every worker)
        t0 = time.perf_counter()
        consistency = consistency_metrics(worker_loss, gathered[:, 2].tolist(), gathered[:, 3].tolist(),
                                          norm * norm, gram)
        t1 = time.perf_counter()
        noise = noise_scale_terms(gathered[:, 2].tolist(), worker_tokens, norm * norm)
        monitor_s.update(hook=monitor.host_seconds(), stats=stats_s, metrics=t1 - t0,
                         noise_scale=time.perf_counter() - t1)
    state.tokens_seen += global_tokens
    return StepResult(loss, global_tokens, norm, coef, clipped, skipped, worker_loss, worker_tokens, metrics,
                      consistency, noise, drift, budget, monitor_s)


class StepLogger:
    """Rank 0's per-step record: one JSON line per step (per-worker columns included) and DVCLive scalars.

    The JSONL log is the rich record pandas reads later; DVCLive gets the scalars that ``dvc plots`` and
    ``dvc exp show`` read. On resume the checkpoint's log is replayed into both, so neither holds steps
    from after the checkpoint of an interrupted run.
    """

    SCALARS = ("loss", "lr", "grad_norm", "clip_coef", "tokens", "step_s")
    SUMMARY_EVERY_S = 5.0  # DVCLive's metrics.json is rewritten at most this often while training

    def __init__(self, steps_path: Path, live_dir: Path, enabled: bool):
        self.enabled = enabled
        self.rows: list[dict] = []
        self._file = None
        self._live = None
        self._next_summary = 0.0
        if enabled:
            from dvclive import Live

            steps_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(steps_path, "w")
            self._live = Live(dir=str(live_dir), save_dvc_exp=False, dvcyaml=None, resume=False)
            # Live.next_step() also streams to DVC Studio and, to do so, re-reads every plot file on every
            # step, even with Studio not configured: a cost that grows with the step count (measured ~25 ms a
            # step by 300 steps of 22 scalars, as much as an SFT step of the default). So next_step() runs
            # only when Studio is configured; otherwise each step appends its plot rows and the summary is
            # rewritten every few seconds and at the end. (An unknown DVCLive keeps next_step().)
            skipped = getattr(self._live, "_studio_events_to_skip", None)
            self._studio = skipped is None or "data" not in skipped

    def log(self, row: dict) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        self._file.write(json.dumps({k: v for k, v in row.items() if not is_timing(k)}) + "\n")
        self._file.flush()
        self._live.step = row["step"]
        for k, v in row.items():
            if (k in self.SCALARS or k.startswith(("task/", "consistency/", "gns/"))) and isinstance(v, (int, float)) \
                    and not isinstance(v, bool) and math.isfinite(v):
                self._live.log_metric(f"train/{k}", v, plot=True)
        if self._studio:
            self._live.next_step()
            return
        self._live.step = row["step"] + 1  # what next_step() leaves: the summary's step counts steps done
        if time.monotonic() >= self._next_summary:
            self._live.make_summary()
            self._next_summary = time.monotonic() + self.SUMMARY_EVERY_S

    def replay(self, rows: list[dict]) -> None:
        for row in rows:
            self.log(row)

    def summary(self, metrics: dict) -> None:
        if self.enabled:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._live.summary[k] = v
            self._live.make_summary()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._live.end()


class NoiseScale:
    """B_simple = tr Σ / |G|² with numerator and denominator smoothed separately (EMA) before dividing;
    a pure function of the logged per-step terms, so a resumed run rebuilds it from its log."""

    def __init__(self, ema: float):
        self.ema, self.g2, self.trace = ema, None, None

    def update(self, g2: float, trace: float) -> float:
        if math.isfinite(g2) and math.isfinite(trace):
            a = self.ema
            self.g2 = g2 if self.g2 is None else a * self.g2 + (1 - a) * g2
            self.trace = trace if self.trace is None else a * self.trace + (1 - a) * trace
        return self.trace / self.g2 if self.g2 else float("nan")


class BudgetTotals:
    """The run's cumulative budget from scratch (``ars_opd.training.budget``): the starting model's budget plus
    every logged step's costs, so a resumed run rebuilds it from its log."""

    def __init__(self, start: dict):
        self.totals = {k: start.get(k, 0) for k in FIELDS}

    def update(self, step_budget: dict) -> dict:
        self.totals["steps"] += 1
        for k in FIELDS[1:]:
            self.totals[k] += step_budget.get(k, 0)
        return {f"budget/{k}_total": v for k, v in self.totals.items()}


def save_snapshot(snapshot_dir: Path, model: torch.nn.Module, step: int, totals: dict) -> None:
    """Rank 0: the weights after ``step`` steps and the budget spent to reach them (a learning-curve point)."""
    final = snapshot_dir / f"step_{step:07d}"
    tmp = snapshot_dir / f".step_{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_trained(model, tmp)  # a plain (merged) model, adapter or not: evaluation reads it as one
    write_budget(tmp, totals)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


class FitResult(NamedTuple):
    state: TrainerState
    rows: list[dict]  # the per-step log (rank 0's view; identical values on every rank)
    totals: dict  # the cumulative budget from scratch
    model: torch.nn.Module | None  # the trained student whole, to publish (rank 0; None on other ranks when sharded)


def fit(ctx: WorkerContext, model: torch.nn.Module, task: TrainingTask, cfg: TrainLoopConfig,
        ddp_cfg: DDPConfig, run_fingerprint: str, ckpt_dir: Path, steps_path: Path, live_dir: Path,
        progress: bool = True, on_step=None, fault: Fault | None = None,
        budget_start: dict | None = None, layout_fingerprint: str | None = None) -> FitResult:
    """Train ``model`` (unwrapped, on ``ctx.device``) for ``cfg.steps`` optimiser steps, resuming if possible.

    Every ``cfg.snapshot_every`` steps rank 0 keeps the weights in ``snapshot_dir(ckpt_dir, fingerprint)``
    (learning-curve points, kept with the checkpoints so that a resumed run still has its earlier ones).
    Returns the final state, the per-step log (rank 0's view; identical values on every rank), the
    cumulative budget from scratch (``budget_start``: the starting model's) and the student to publish.
    ``ddp.strategy: fsdp`` shards ``model`` in place (``ars_opd.training.sharding``); rank 0 then keeps an
    unsharded CPU copy, loaded with the gathered weights whenever it publishes (snapshots, the end).
    """
    from tqdm.auto import tqdm

    sharded = ddp_cfg.strategy == "fsdp"
    publish = copy.deepcopy(model).cpu() if sharded and ctx.is_main else None  # rank 0 writes snapshots from it
    ddp_model = wrap_model(model, ctx, ddp_cfg, cfg)
    monitor = None
    if ddp_cfg.consistency:
        monitor = (ShardedConsistencyHook if sharded else ConsistencyHook)(ctx.world_size, gram_every=ddp_cfg.gram_every)
        monitor.attach(ddp_model)
    drift_every = 0 if sharded else ddp_cfg.drift_check_every  # no replicas to compare (training.sharding)
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg, cfg.steps)
    state, history = TrainerState(), []
    if ctx.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    found, why = find_checkpoint(ckpt_dir, run_fingerprint, ctx.world_size, layout_fingerprint,
                                 ddp_cfg.reshard_resume, ddp_cfg.strategy)
    if found is not None:
        state, history = load_checkpoint(found.path, ctx, model, opt, sched)
        state.resharded_from = found.resharded_from
    if ctx.is_main and (found is not None or why != "no checkpoint"):
        print(f"checkpoints: {why}", flush=True)
    logger = StepLogger(steps_path, live_dir, enabled=ctx.is_main)
    logger.replay(history)
    noise_scale = NoiseScale(ddp_cfg.noise_scale_ema)
    totals = BudgetTotals(budget_start or {})
    for row in history:
        noise_scale.update(row.get("gns/g2", float("nan")), row.get("gns/trace", float("nan")))
        totals.update({k: row.get(f"budget/{k}", 0) for k in FIELDS[1:]})
    snapshots = snapshot_dir(ckpt_dir, run_fingerprint)
    earlier = snapshot_dir(ckpt_dir, found.fingerprint) if found is not None and found.fingerprint else snapshots
    if ctx.is_main and earlier != snapshots and earlier.is_dir() and not snapshots.exists():
        os.replace(earlier, snapshots)  # a resharded resume continues the same learning curve
    if ctx.is_main and cfg.snapshot_every:
        for old in ckpt_dir.glob("snapshots/*"):  # another run's learning curve
            if old.name != snapshots.name:
                shutil.rmtree(old, ignore_errors=True)
    bar = tqdm(total=cfg.steps, initial=state.step, desc="train", unit="step", disable=not (progress and ctx.is_main),
               mininterval=1.0, dynamic_ncols=True)
    try:
        while state.step < cfg.steps:
            t0 = time.perf_counter()
            lr = opt.param_groups[0]["lr"]  # the rate this step uses (train_step advances the schedule)
            result = train_step(ddp_model, task, opt, sched, ctx, cfg, state, monitor, fault, drift_every)
            step_s = time.perf_counter() - t0
            state.train_seconds += step_s
            row = {
                "step": state.step, "loss": result.loss, "tokens": result.tokens,
                "lr": lr, "grad_norm": result.grad_norm, "clip_coef": result.clip_coef,
                "clipped": result.clipped, "clipped_total": state.clipped_steps, "skipped": result.skipped,
                "skipped_total": state.skipped_steps, "step_s": round(step_s, 5),
                "worker_loss": result.worker_loss, "worker_tokens": result.worker_tokens,
                "scenario": ddp_cfg.scenario, "strategy": ddp_cfg.strategy,
                "fault": fault.cfg.kind if fault is not None and fault.active(state.step) else None,
                "drift_mismatch": result.drift,  # null: not checked this step; []: every replica identical
                **{f"task/{k}": v for k, v in result.metrics.items()},
                **{f"consistency/{k}": v for k, v in result.consistency.items()},
                "gns/g2": result.noise_scale[0], "gns/trace": result.noise_scale[1],
                "gns/b_simple": noise_scale.update(*result.noise_scale),
                **{f"budget/{k}": v for k, v in result.budget.items()},
                **totals.update(result.budget),
            }
            if on_step is not None:
                row.update(on_step(state.step) or {})
            logger.log(row)
            state.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{result.loss:.4f}", gnorm=f"{result.grad_norm:.2f}", refresh=False)
            if cfg.snapshot_every and state.step % cfg.snapshot_every == 0:
                weights = publishable(model, publish)  # sharded: a collective, every rank gathers
                if ctx.is_main:
                    save_snapshot(snapshots, weights, state.step, totals.totals)
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                save_checkpoint(ckpt_dir, ctx, model, opt, sched, state, run_fingerprint, logger.rows,
                                cfg.keep_checkpoints, layout_fingerprint, ddp_cfg.strategy)
        if found is None or state.resumed_from != cfg.steps or found.resharded_from is not None:
            save_checkpoint(ckpt_dir, ctx, model, opt, sched, state, run_fingerprint, logger.rows, cfg.keep_checkpoints,
                            layout_fingerprint, ddp_cfg.strategy)
        tail = [r["loss"] for r in logger.rows[-10:] if math.isfinite(r["loss"])]
        summary = {
            "final_loss": logger.rows[-1]["loss"] if logger.rows else float("nan"),
            "final_loss_mean10": sum(tail) / len(tail) if tail else float("nan"),
            "steps": state.step, "clipped_steps": state.clipped_steps, "skipped_steps": state.skipped_steps,
            "tokens": state.tokens_seen, "train_seconds": state.train_seconds,
            "tokens_per_s": state.tokens_seen / state.train_seconds if state.train_seconds else float("nan"),
            **{f"budget_{k}_total": v for k, v in totals.totals.items()},
        }
        logger.summary(summary)
        final = publishable(model, publish)  # sharded: a collective, every rank gathers
    finally:
        bar.close()
        logger.close()
    return FitResult(state, logger.rows, dict(totals.totals), final)


def publishable(model: torch.nn.Module, copy_on_main: torch.nn.Module | None) -> torch.nn.Module | None:
    """The trained student as a whole module on rank 0: itself (DDP: every rank holds it whole), or, when
    sharded, rank 0's unsharded CPU copy loaded with the gathered full state dict (every rank must call;
    others get None)."""
    if not is_sharded(model):
        return model
    state = full_state_dict(model)
    if copy_on_main is None:
        return None
    missing, unexpected = copy_on_main.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(copy_on_main, k)}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"the gathered state dict does not fit the student: missing {sorted(set(missing) - tied)}, "
                           f"unexpected {sorted(unexpected)}")
    return copy_on_main


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    """Whether ``key`` names a parameter that shares its tensor with another (a tied head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    return any(other is not key and p is params[key] for other, p in params.items() if other != key)


def snapshot_dir(ckpt_dir: Path, run_fingerprint: str) -> Path:
    """Where a run's learning-curve snapshots wait until the run publishes them with its model."""
    return ckpt_dir / "snapshots" / run_fingerprint
