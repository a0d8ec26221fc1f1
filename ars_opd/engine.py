"""The training engine shared by SFT and OPD: DDP workers, one global token-mean loss, exact resume.

One optimiser step, on every worker k of K:

1. the task builds this worker's micro-batches for the step (SFT: slices of the data; OPD: rollouts);
2. the valid-token count of the *whole* global batch is all-reduced before any backward (DESIGN §3);
3. each micro-batch's summed token loss is back-propagated scaled by ``K / N_global``, the last one
   outside ``no_sync`` so DDP all-reduces once. DDP's all-reduce averages over the K workers, so the
   reduced gradient is the gradient of (sum of every token loss of the step) / N_global, whatever the
   split into workers and micro-batches (tested: 1x8, 2x4 and 2x2 with accumulation 2 agree to 1e-6).
   The ``K`` is the explicit inverse of DDP's documented mean; no implicit framework scaling is relied on;
4. the pre-clip norm of the reduced gradient is logged; it is clipped to ``max_grad_norm`` unless that is
   null (``noclip``); a non-finite loss or gradient skips the step (counted) or stops the run, by param;
5. AdamW step, LR schedule step; one all-gather of a few scalars per worker for the log.

Checkpoints (every ``checkpoint_every`` steps and at the end) hold the weights (safetensors), optimizer and
scheduler state, every worker's RNG state, the counters, the per-step log so far, and a fingerprint of
the run: configuration, the content of the training data and the source of this package. A rerun with the
same fingerprint resumes from the latest one (the data position follows from the step number); one with
another configuration, other data or changed code starts afresh and says so. (Keying on the row count
alone let a rerun after new teacher completions "resume" from the old run's final step and publish the
old model as the new one; DVC reruns a stage exactly when such inputs change.) Loading uses
``torch.load(weights_only=True)``. Resumed runs are bit-identical to uninterrupted ones on CPU (tested).

Precision: fp32 on CPU; bf16 autocast on CUDA (``precision: auto``); losses are always taken in fp32.

What this module leaves out: FSDP/tensor parallelism, mixed-precision loss scaling (bf16 needs none),
gradient checkpointing, and the loss itself (tasks provide it; see ``ars_opd.sft``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ars_opd.artifacts import dumps_canonical, files_sha256, write_json
from ars_opd.config import DDPConfig, TrainLoopConfig
from ars_opd.consistency import ConsistencyHook, consistency_metrics
from ars_opd.distributed import WorkerContext, gather_floats
from ars_opd.schedules import warmup_cosine
from ars_opd.seeding import derive_seed

STEPS_LOG = "steps.jsonl"
LATEST = "latest.json"


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient under ``nonfinite: stop`` (or too many skipped steps)."""


class BatchConfigError(ValueError):
    """The global batch does not split into workers and micro-batches, or the data is too small."""


# --------------------------------------------------------------------------------------------------
# tasks


@dataclass
class MicroBatch:
    """Tensors for one forward/backward, and how many loss tokens they hold."""

    tensors: dict[str, torch.Tensor]
    n_tokens: int  # positions with a loss target
    n_sequences: int
    n_real_tokens: int = 0  # non-padding positions (for the padding fraction)
    meta: dict[str, tuple[float, float]] = field(default_factory=dict)  # task metric (sum, count) pairs


class TrainingTask(Protocol):
    """What the engine needs from SFT or OPD."""

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        """This worker's micro-batches for ``step`` (``model`` is the unwrapped module, e.g. for rollouts)."""

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed per-token loss over the batch's valid tokens (0-dim, fp32, with grad) and metric sums."""

    def metric_names(self) -> list[str]:
        """Task metrics reported per step; each is a (sum, count) pair reduced over all workers."""


# --------------------------------------------------------------------------------------------------
# seeds and batch geometry


def scenario_seeds(scenario: str, seed: int, rank: int) -> tuple[int, int]:
    """(sampler seed, RNG seed) of a worker under a consistency scenario (DESIGN §5).

    S1-1 strict: one seed everywhere (disjoint, identically shuffled shards; identical RNG streams).
    S1-2 mild: rank 0 uses another seed for both; the other ranks the baseline.
    S1-3 significant: every rank's seeds depend on its rank.
    """
    if scenario == "S1-1":
        return seed, seed
    if scenario == "S1-2":
        return (derive_seed(seed, "rank0-differs"),) * 2 if rank == 0 else (seed, seed)
    if scenario == "S1-3":
        s = derive_seed(seed, f"rank-{rank}")
        return s, s
    raise ValueError(f"unknown scenario {scenario!r}; allowed: S1-1, S1-2, S1-3")


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
        if global_batch % workers:
            raise BatchConfigError(f"{section}.global_batch_size = {global_batch} does not divide by "
                                   f"ddp.workers = {workers}")
        if (global_batch // workers) % micro_batch:
            raise BatchConfigError(f"{section}.global_batch_size / ddp.workers = {global_batch // workers} "
                                   f"does not divide by {section}.micro_batch_size = {micro_batch}")
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
        raise BatchConfigError(f"{n_items} training rows cannot fill one step of {geometry.global_batch} "
                               f"sequences over {geometry.workers} workers; lower the global batch size")
    epoch, k = divmod(step, steps_per_epoch)
    shard = epoch_shard(n_items, epoch, sampler_seed, rank, geometry.workers)
    return shard[k * geometry.per_worker:(k + 1) * geometry.per_worker]


# --------------------------------------------------------------------------------------------------
# checkpoints


def code_fingerprint() -> str:
    """sha256 over this package's Python sources (relative names and bytes, sorted)."""
    return files_sha256(Path(__file__).resolve().parent, (".py",))[0]


def config_fingerprint(obj: Any) -> str:
    """Fingerprint of a training run for its checkpoints: ``obj`` (configuration, data hashes) plus the
    package source, so that a checkpoint is never resumed under other data or other code."""
    import hashlib

    return hashlib.sha256(dumps_canonical({"run": obj, "code": code_fingerprint()}).encode()).hexdigest()[:16]


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


@dataclass
class TrainerState:
    step: int = 0  # next step to run
    clipped_steps: int = 0
    skipped_steps: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    resumed_from: int | None = None


def save_checkpoint(ckpt_dir: Path, ctx: WorkerContext, model: torch.nn.Module, opt, sched,
                    state: TrainerState, fingerprint: str, steps_log: list[dict], keep: int) -> None:
    """All workers call this; weights/optimizer from rank 0, RNG from every rank; atomic switch of ``latest``."""
    from safetensors.torch import save_model

    final = ckpt_dir / f"step_{state.step:07d}"
    tmp = ckpt_dir / f".step_{state.step:07d}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{ctx.rank}.pt")
    if ctx.is_main:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        write_json(tmp / "state.json", {**state.__dict__, "fingerprint": fingerprint, "world_size": ctx.world_size})
        with open(tmp / STEPS_LOG, "w") as f:
            for row in steps_log:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    if ctx.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = ckpt_dir / f".{LATEST}.tmp"
        write_json(latest_tmp, {"step": state.step, "dir": final.name, "fingerprint": fingerprint})
        os.replace(latest_tmp, ckpt_dir / LATEST)
        old = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())[:-keep]
        for p in old:
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


def find_checkpoint(ckpt_dir: Path, fingerprint: str, world_size: int) -> tuple[Path | None, str]:
    """The latest checkpoint if it matches this run's configuration, else (None, why not)."""
    latest = ckpt_dir / LATEST
    if not latest.exists():
        return None, "no checkpoint"
    info = json.loads(latest.read_text())
    path = ckpt_dir / info["dir"]
    if info.get("fingerprint") != fingerprint:
        return None, f"checkpoint at step {info['step']} was made with another configuration, other data or other code; starting afresh"
    state = json.loads((path / "state.json").read_text())
    if state.get("world_size") != world_size:
        return None, f"checkpoint was made with {state.get('world_size')} workers, not {world_size}; starting afresh"
    return path, f"resuming from step {info['step']}"


def load_checkpoint(path: Path, ctx: WorkerContext, model: torch.nn.Module, opt, sched) -> tuple[TrainerState, list[dict]]:
    from safetensors.torch import load_model

    load_model(model, str(path / "model.safetensors"), device=str(ctx.device))
    opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=ctx.device))
    sched.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(torch.load(path / f"rng_rank{ctx.rank}.pt", weights_only=True))
    raw = json.loads((path / "state.json").read_text())
    state = TrainerState(**{k: raw[k] for k in TrainerState.__dataclass_fields__})
    state.resumed_from = state.step
    steps_log = [json.loads(line) for line in (path / STEPS_LOG).read_text().splitlines() if line.strip()]
    return state, steps_log


# --------------------------------------------------------------------------------------------------
# the loop


def make_optimizer(model: torch.nn.Module, cfg: TrainLoopConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def autocast_context(cfg: TrainLoopConfig, device: torch.device):
    use_bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
    if use_bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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


def wrap_ddp(model: torch.nn.Module, ctx: WorkerContext, ddp_cfg: DDPConfig) -> DDP:
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
               bucket_cap_mb=ddp_cfg.bucket_cap_mb, gradient_as_bucket_view=ddp_cfg.gradient_as_bucket_view)


def accumulate_gradients(ddp_model: DDP, task: TrainingTask, micro: list[MicroBatch], ctx: WorkerContext,
                         cfg: TrainLoopConfig) -> tuple[float, int, int, dict[str, tuple[float, float]]]:
    """Forward/backward every micro-batch of the step with the global token normalisation.

    Returns (local loss sum, local tokens, global tokens, local metric sums). After it returns, every
    parameter's ``.grad`` holds the reduced gradient of the global token-mean loss.
    """
    local_tokens = sum(b.n_tokens for b in micro)
    counts = torch.tensor([float(local_tokens)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(counts)  # before any backward: the normaliser of the whole global batch
    global_tokens = int(counts.item())
    if global_tokens == 0:
        raise ValueError("a step's global batch holds no loss tokens (every completion masked); check the "
                         "data and the prompt/completion budgets")
    scale = ctx.world_size / global_tokens  # DDP averages over workers: x K undoes that mean, / N normalises
    local_sum = 0.0
    metric_sums: dict[str, list[float]] = {}
    for i, batch in enumerate(micro):
        last = i == len(micro) - 1
        with (contextlib.nullcontext() if last else ddp_model.no_sync()), autocast_context(cfg, ctx.device):
            loss_sum, metrics = task.loss_sum(ddp_model, batch)
        (loss_sum.float() * scale).backward()
        local_sum += loss_sum.detach().float().item()
        for k, v in list(metrics.items()) + list(batch.meta.items()):
            acc = metric_sums.setdefault(k, [0.0, 0.0])
            acc[0] += v[0]
            acc[1] += v[1]
    if not micro:
        raise ValueError("a worker got no micro-batches for the step")
    return local_sum, local_tokens, global_tokens, {k: (v[0], v[1]) for k, v in metric_sums.items()}


def optimizer_step(model: torch.nn.Module, opt, sched, cfg: TrainLoopConfig, loss: float,
                   state: TrainerState) -> tuple[float, float, bool, bool]:
    """Clip (or not), check finiteness, step. Returns (pre-clip norm, clip coef, clipped, skipped)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0).item()
    finite = math.isfinite(norm) and math.isfinite(loss)
    clip_coef, clipped = 1.0, False
    if finite and cfg.max_grad_norm is not None:
        clip_coef = min(1.0, cfg.max_grad_norm / (norm + 1e-6))
        clipped = clip_coef < 1.0
        if clipped:
            torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, torch.tensor(norm))
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


def train_step(ddp_model: DDP, task: TrainingTask, opt, sched, ctx: WorkerContext, cfg: TrainLoopConfig,
               state: TrainerState, monitor: ConsistencyHook | None = None) -> StepResult:
    model = ddp_model.module
    micro = task.micro_batches(state.step, model)
    if monitor is not None:
        monitor.begin_step(state.step)
    local_sum, local_tokens, global_tokens, metric_sums = accumulate_gradients(ddp_model, task, micro, ctx, cfg)
    names = task.metric_names()
    stats = monitor.local_stats(ctx.device) if monitor is not None else torch.full((2,), float("nan"))
    vec = torch.cat([torch.tensor([local_sum, float(local_tokens)], dtype=torch.float64, device=ctx.device),
                     stats.to(device=ctx.device, dtype=torch.float64),
                     torch.tensor([x for n in names for x in metric_sums.get(n, (0.0, 0.0))],
                                  dtype=torch.float64, device=ctx.device)])
    gathered = gather_floats(vec, ctx.device)  # (K, 4 + 2M): the one per-step gather
    gram = monitor.gram() if monitor is not None else None
    loss = gathered[:, 0].sum().item() / global_tokens
    norm, coef, clipped, skipped = optimizer_step(model, opt, sched, cfg, loss, state)
    worker_tokens = [int(t) for t in gathered[:, 1].tolist()]
    worker_loss = [s / t if t else float("nan") for s, t in zip(gathered[:, 0].tolist(), worker_tokens)]
    metrics = {}
    for i, n in enumerate(names):
        s, c = gathered[:, 4 + 2 * i].sum().item(), gathered[:, 5 + 2 * i].sum().item()
        metrics[n] = s / c if c else float("nan")
    consistency = {}
    if monitor is not None:
        # ‖ḡ‖ is the pre-clip norm of the reduced gradient (identical on every worker)
        consistency = consistency_metrics(worker_loss, gathered[:, 2].tolist(), gathered[:, 3].tolist(),
                                          norm * norm, gram)
    state.tokens_seen += global_tokens
    return StepResult(loss, global_tokens, norm, coef, clipped, skipped, worker_loss, worker_tokens, metrics,
                      consistency)


def set_seeds(rng_seed: int) -> None:
    random.seed(rng_seed)
    torch.manual_seed(rng_seed)


class StepLogger:
    """Rank 0's per-step record: one JSON line per step (per-worker columns included) and DVCLive scalars.

    The JSONL log is the rich record pandas reads later; DVCLive gets the scalars that ``dvc plots`` and
    ``dvc exp show`` read. On resume the checkpoint's log is replayed into both, so neither holds steps
    from after the checkpoint of an interrupted run.
    """

    SCALARS = ("loss", "lr", "grad_norm", "clip_coef", "tokens", "step_s")

    def __init__(self, out_dir: Path, live_dir: Path, enabled: bool):
        self.enabled = enabled
        self.rows: list[dict] = []
        self._file = None
        self._live = None
        if enabled:
            from dvclive import Live

            out_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(out_dir / STEPS_LOG, "w")
            self._live = Live(dir=str(live_dir), save_dvc_exp=False, dvcyaml=None, resume=False)

    def log(self, row: dict) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for k, v in row.items():
            if (k in self.SCALARS or k.startswith(("task/", "consistency/"))) and isinstance(v, (int, float)) \
                    and not isinstance(v, bool) \
                    and math.isfinite(v):
                self._live.log_metric(f"train/{k}", v, plot=True)
        self._live.step = row["step"]
        self._live.next_step()

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


def fit(ctx: WorkerContext, model: torch.nn.Module, task: TrainingTask, cfg: TrainLoopConfig,
        ddp_cfg: DDPConfig, fingerprint: str, ckpt_dir: Path, out_dir: Path, live_dir: Path,
        progress: bool = True, on_step=None) -> tuple[TrainerState, list[dict]]:
    """Train ``model`` (unwrapped, on ``ctx.device``) for ``cfg.steps`` optimiser steps, resuming if possible.

    Returns the final state and the per-step log (rank 0's view; identical values on every rank).
    """
    from tqdm.auto import tqdm

    ddp_model = wrap_ddp(model, ctx, ddp_cfg)
    monitor = None
    if ddp_cfg.consistency:
        monitor = ConsistencyHook(ctx.world_size, gram_every=ddp_cfg.gram_every)
        monitor.attach(ddp_model)
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio))
    state, history = TrainerState(), []
    if ctx.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    path, why = find_checkpoint(ckpt_dir, fingerprint, ctx.world_size)
    if path is not None:
        state, history = load_checkpoint(path, ctx, model, opt, sched)
    if ctx.is_main and (path is not None or why != "no checkpoint"):
        print(f"checkpoints: {why}", flush=True)
    logger = StepLogger(out_dir, live_dir, enabled=ctx.is_main)
    logger.replay(history)
    bar = tqdm(total=cfg.steps, initial=state.step, desc="train", unit="step", disable=not (progress and ctx.is_main),
               mininterval=1.0, dynamic_ncols=True)
    try:
        while state.step < cfg.steps:
            t0 = time.perf_counter()
            lr = opt.param_groups[0]["lr"]  # the rate this step uses (train_step advances the schedule)
            result = train_step(ddp_model, task, opt, sched, ctx, cfg, state, monitor)
            step_s = time.perf_counter() - t0
            state.train_seconds += step_s
            row = {
                "step": state.step, "loss": result.loss, "tokens": result.tokens,
                "lr": lr, "grad_norm": result.grad_norm, "clip_coef": result.clip_coef,
                "clipped": result.clipped, "clipped_total": state.clipped_steps, "skipped": result.skipped,
                "skipped_total": state.skipped_steps, "step_s": round(step_s, 5),
                "worker_loss": result.worker_loss, "worker_tokens": result.worker_tokens,
                "scenario": ddp_cfg.scenario,
                **{f"task/{k}": v for k, v in result.metrics.items()},
                **{f"consistency/{k}": v for k, v in result.consistency.items()},
            }
            if on_step is not None:
                row.update(on_step(state.step) or {})
            logger.log(row)
            state.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{result.loss:.4f}", gnorm=f"{result.grad_norm:.2f}", refresh=False)
            if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.steps:
                save_checkpoint(ckpt_dir, ctx, model, opt, sched, state, fingerprint, logger.rows, cfg.keep_checkpoints)
        if path is None or state.resumed_from != cfg.steps:
            save_checkpoint(ckpt_dir, ctx, model, opt, sched, state, fingerprint, logger.rows, cfg.keep_checkpoints)
        tail = [r["loss"] for r in logger.rows[-10:] if math.isfinite(r["loss"])]
        summary = {
            "final_loss": logger.rows[-1]["loss"] if logger.rows else float("nan"),
            "final_loss_mean10": sum(tail) / len(tail) if tail else float("nan"),
            "steps": state.step, "clipped_steps": state.clipped_steps, "skipped_steps": state.skipped_steps,
            "tokens": state.tokens_seen,
            "tokens_per_s": state.tokens_seen / state.train_seconds if state.train_seconds else float("nan"),
        }
        logger.summary(summary)
    finally:
        bar.close()
        logger.close()
    return state, logger.rows
