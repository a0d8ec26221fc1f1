"""Resumable training checkpoints, keyed on everything that determines the run.

A checkpoint (every ``checkpoint_every`` steps and at the end) holds the weights (safetensors), the
optimizer and scheduler state, every worker's RNG state, the counters and the per-step log so far, and
the run's fingerprint: its configuration (less what a resume may change, such as a server's address or a
timeout: ``ars_opd.training.worker.RESUMABLE_KEYS``), the content of its training data and the source of this
package. A rerun with the same fingerprint resumes from the latest checkpoint (the data position follows
from the step number, ``ars_opd.training.batch_plan``); one with another configuration, other data or
changed code starts afresh and says so, so a rerun never publishes a model of other inputs. DVC reruns a
stage exactly when such inputs change. Loading uses ``torch.load(weights_only=True)``; resumed runs are
bit-identical to uninterrupted ones on CPU (tested). A run builds one ``Checkpoints`` (its directory,
model, optimizer, schedule, fingerprints and strategy), then calls ``resume()`` once and ``save(state, rows)``
at each checkpoint step.

Formats. Under DDP rank 0 writes the whole model (``model.safetensors``) and optimizer (``optimizer.pt``).
A sharded student (``ddp.strategy: fsdp``) is saved by every rank through ``torch.distributed.checkpoint``
(``dcp/``: each rank its shards, keyed by parameter name), which loads into any layout: FSDP at another
world size, DDP, or one worker (resharding).

Machines. The checkpoint directory is rank 0's: rank 0 alone decides whether to resume and from which
checkpoint (``Checkpoints.resume``; the decision is broadcast, so a rank that sees another directory, or none,
on another machine follows it instead of diverging), and under DDP rank 0 alone reads and writes it: the
other ranks' RNG states are gathered to it when saving, and on a resume it sends every rank the weights,
the optimizer and scheduler state, its RNG state and the log. So a DDP run over several machines needs no
shared filesystem (its checkpoints are on rank 0's machine, as its outputs are). A sharded checkpoint is
written by every rank (DCP: each rank its own shards), so under fsdp the directory must be one directory
shared by every machine; that is checked before the first step (``require_shared``: rank 0 writes a
token there that every rank must read back), and refused naming the ranks and hosts that cannot see it.

Another layout. A checkpoint whose run differs only in how the workers are laid out (``LAYOUT_KEYS``:
worker count, strategy, device, backend, threads, DDP buckets) starts afresh by default, as any other
configuration does: at another world size the same global batches are summed in another order (fp32
rounding) and OPD's rollouts are drawn by other per-rank generators, so the result is not the same run's.
``ddp.reshard_resume: true`` resumes it instead, resharded (``dcp/`` into any layout; a DDP checkpoint into
DDP or one worker), says so, and records it in the manifest; ranks beyond the old world keep their fresh
RNG state.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ars_opd.artifacts import code_fingerprint, dumps_canonical, read_jsonl, write_json, write_jsonl
from ars_opd.config import ConfigError
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.sharding import is_sharded

STEPS_LOG = "steps.jsonl"
LATEST = "latest.json"
DCP_DIR = "dcp"
# ddp keys that change how the work is laid out over workers, not what is trained (see the module doc)
LAYOUT_KEYS = (
    "workers",
    "strategy",
    "device",
    "backend",
    "threads_per_worker",
    "bucket_cap_mb",
    "gradient_as_bucket_view",
    "timeout_s",
    "reshard_resume",
)


def config_fingerprint(obj: Any) -> str:
    """Fingerprint of a training run for its checkpoints: ``obj`` (configuration, data hashes) plus the
    package source, so that a checkpoint is never resumed under other data or other code."""
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


def layout_free(ddp: dict) -> dict:
    """The ddp section without its layout keys: what must match for a resharded resume."""
    return {k: v for k, v in ddp.items() if k not in LAYOUT_KEYS}


@dataclass
class TrainerState:
    step: int = 0  # next step to run
    clipped_steps: int = 0
    skipped_steps: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    resumed_from: int | None = None
    resharded_from: dict | None = None  # {"workers", "strategy"} of a checkpoint of another layout


@dataclass(kw_only=True)
class Checkpoints:
    """One run's checkpoints, built once (by keyword) with what every save and the resume need: the directory
    (rank 0's), the worker's context, the student (unwrapped: whole, or sharded in place), its optimizer and
    schedule, the run's fingerprints, the strategy and how many to keep. Then ``resume()`` once before the
    first step and ``save(state, rows)`` at each checkpoint step; all ranks call both."""

    directory: Path
    ctx: WorkerContext
    model: torch.nn.Module
    opt: Any
    sched: Any
    fingerprint: str  # the run's configuration and inputs: what a checkpoint must match to resume
    layout_fingerprint: str | None = None  # the same but the worker layout (``LAYOUT_KEYS``): a resharded resume
    strategy: str = "ddp"
    reshard: bool = False  # ddp.reshard_resume: resume a checkpoint of another layout of the same run
    keep: int = 2  # checkpoint_every's directories kept (the latest ones of this run)

    def save(self, state: TrainerState, steps_log: list[dict]) -> None:
        """All workers call this. Rank 0 writes the checkpoint (every rank's RNG state gathered to it, and the
        weights and optimizer under DDP); a sharded student's every rank writes its own shards (DCP) into the
        directory ``resume`` found shared. Atomic switch of ``latest``."""
        from safetensors.torch import save_model

        ctx, model, ckpt_dir, fingerprint = self.ctx, self.model, self.directory, self.fingerprint
        final = ckpt_dir / f"step_{state.step:07d}"
        tmp = ckpt_dir / f".step_{state.step:07d}.tmp"
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        rng = [None] * ctx.world_size if ctx.is_main else None
        dist.gather_object(_rng_state(), rng, dst=0)  # every rank's RNG state, written by rank 0 (module doc)
        if ctx.is_main:
            for rank, rng_state in enumerate(rng):
                torch.save(rng_state, tmp / f"rng_rank{rank}.pt")
        dist.barrier()
        sharded = is_sharded(model)
        if sharded:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            dcp.save(
                {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, self.opt)},
                checkpoint_id=str(tmp / DCP_DIR),
            )
        if ctx.is_main:
            if not sharded:
                save_model(model, str(tmp / "model.safetensors"))
                torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
            torch.save(self.sched.state_dict(), tmp / "scheduler.pt")
            saved = {k: v for k, v in state.__dict__.items() if k != "resharded_from"}
            write_json(
                tmp / "state.json",
                {
                    **saved,
                    "fingerprint": fingerprint,
                    "world_size": ctx.world_size,
                    "layout_fingerprint": self.layout_fingerprint,
                    "strategy": self.strategy,
                    "format": DCP_DIR if sharded else "safetensors",
                },
            )
            write_jsonl(tmp / STEPS_LOG, steps_log)
        dist.barrier()
        if ctx.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest_tmp = ckpt_dir / f".{LATEST}.tmp"
            write_json(latest_tmp, {"step": state.step, "dir": final.name, "fingerprint": fingerprint})
            os.replace(latest_tmp, ckpt_dir / LATEST)
            for p in superseded(ckpt_dir, fingerprint, self.keep):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()

    def resume(self) -> tuple[Found | None, TrainerState, list[dict]]:
        """All ranks call: the checkpoint resumed (None: none matches), the run's state and its log so far (a
        fresh state and an empty log when none matches); rank 0 says why it resumes or starts afresh.

        Rank 0 alone looks for the checkpoint, in its own ``directory``, and every rank follows its decision
        (other ranks may see another directory, or none, on another machine). A sharded student first checks
        that every rank sees rank 0's directory (``require_shared``), since each rank writes its own shards."""
        ctx, ckpt_dir = self.ctx, self.directory
        state, history = TrainerState(), []
        if ctx.is_main:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
        if is_sharded(self.model) and ctx.world_size > 1:
            require_shared(ckpt_dir, ctx)
        found, why = None, ""
        if ctx.is_main:
            found, why = find_checkpoint(
                ckpt_dir, self.fingerprint, ctx.world_size, self.layout_fingerprint, self.reshard, self.strategy
            )
        found, why = _broadcast((found, why), ctx)
        if found is not None:
            state, history = load_checkpoint(found.path, ctx, self.model, self.opt, self.sched)
            state.resharded_from = found.resharded_from
        if ctx.is_main and (found is not None or why != "no checkpoint"):
            print(f"checkpoints: {why}", flush=True)
        return found, state, history


def superseded(ckpt_dir: Path, fingerprint: str, keep: int) -> list[Path]:
    """The checkpoint directories to delete once a run of ``fingerprint`` has saved one: all but its own
    ``keep`` latest, and every one of another run (``latest`` now names this run's, so none of them can be
    resumed) or without a readable state. By the run, not by step number alone: a rerun with fewer steps
    (another configuration in the same directory) must not lose its checkpoint to an older run's higher
    steps."""
    own, other = [], []
    for p in sorted(d for d in ckpt_dir.glob("step_*") if d.is_dir()):
        try:
            mine = json.loads((p / "state.json").read_text()).get("fingerprint") == fingerprint
        except (OSError, ValueError):
            mine = False
        (own if mine else other).append(p)
    return other + own[: max(0, len(own) - keep)]


@dataclass(frozen=True)
class Found:
    """A checkpoint to resume, and from which layout (None: this run's own)."""

    path: Path
    why: str
    resharded_from: dict | None = None
    fingerprint: str = ""  # the fingerprint it was saved under (its snapshots' directory)


def find_checkpoint(
    ckpt_dir: Path,
    fingerprint: str,
    world_size: int,
    layout_fingerprint: str | None = None,
    reshard: bool = False,
    strategy: str = "ddp",
) -> tuple[Found | None, str]:
    """The latest checkpoint if it matches this run's configuration, else (None, why not). With ``reshard``,
    one of another layout of the same run (``layout_fingerprint``) is returned as a ``Found`` with
    ``resharded_from`` set."""
    latest = ckpt_dir / LATEST
    if not latest.exists():
        return None, "no checkpoint"
    info = json.loads(latest.read_text())
    path = ckpt_dir / info["dir"]
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as e:  # removed or torn by hand or by another tool: nothing to resume
        return (
            None,
            f"{latest.name} names {info['dir']}, whose state cannot be read ({type(e).__name__}); starting afresh",
        )
    same_run = layout_fingerprint is not None and state.get("layout_fingerprint") == layout_fingerprint
    layout = {"workers": state.get("world_size"), "strategy": state.get("strategy", "ddp")}
    if info.get("fingerprint") == fingerprint and state.get("world_size") == world_size:
        why = f"resuming from step {info['step']}"
        return Found(path, why, None, fingerprint), why
    if same_run and reshard:
        if state.get("format") != DCP_DIR and strategy == "fsdp":
            return None, (
                f"checkpoint at step {info['step']} holds whole DDP weights, which do not load into a "
                "sharded student; starting afresh"
            )
        why = (
            f"resuming from step {info['step']}, resharded from {layout['workers']} {layout['strategy']} "
            f"worker(s) to {world_size} {strategy} worker(s) (ddp.reshard_resume)"
        )
        return Found(path, why, layout, info.get("fingerprint", "")), why
    if same_run:
        return None, (
            f"checkpoint at step {info['step']} was made by {layout['workers']} {layout['strategy']} "
            f"worker(s), not {world_size} {strategy}; starting afresh (ddp.reshard_resume: true would "
            "resume it resharded)"
        )
    if info.get("fingerprint") != fingerprint:
        return (
            None,
            f"checkpoint at step {info['step']} was made with another configuration, other data or other code; "
            "starting afresh",
        )
    return None, f"checkpoint was made with {state.get('world_size')} workers, not {world_size}; starting afresh"


class _Slot(NamedTuple):
    """A tensor's place in a broadcast state dict: what the other ranks allocate before receiving it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _broadcast(obj: Any, ctx: WorkerContext) -> Any:
    """Rank 0's ``obj`` (picklable, small) on every rank."""
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _broadcast_tensors(tree: Any, ctx: WorkerContext) -> Any:
    """Rank 0's nested state (dicts, lists, tuples of tensors and plain values: an optimizer's state dict) on
    every rank: the structure pickled once, then each tensor by ``dist.broadcast`` on ``ctx.device``."""
    tensors: list[torch.Tensor] = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return _Slot(len(tensors) - 1, tuple(x.shape), x.dtype)
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, list):
            return [strip(v) for v in x]
        if isinstance(x, tuple):
            return tuple(strip(v) for v in x)
        return x

    def fill(x):
        if isinstance(x, _Slot):
            if ctx.is_main:
                t = tensors[x.index].to(ctx.device)
            else:
                t = torch.empty(x.shape, dtype=x.dtype, device=ctx.device)
            dist.broadcast(t, src=0)
            return t
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        if isinstance(x, tuple):
            return tuple(fill(v) for v in x)
        return x

    return fill(_broadcast(strip(tree) if ctx.is_main else None, ctx))


def _broadcast_module(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers into every rank's ``model``, in place (a tied tensor once)."""
    seen = set()
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            dist.broadcast(t.data, src=0)


def load_checkpoint(
    path: Path, ctx: WorkerContext, model: torch.nn.Module, opt, sched
) -> tuple[TrainerState, list[dict]]:
    """All ranks call. Rank 0 reads the checkpoint (the path is rank 0's) and sends every rank what it needs:
    the state, the log, the scheduler, each rank's RNG state, and under DDP the weights and the optimizer
    state. A sharded checkpoint's shards are read by every rank through DCP (the directory is shared)."""
    raw = _broadcast(json.loads((path / "state.json").read_text()) if ctx.is_main else None, ctx)
    if raw.get("format") == DCP_DIR:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        target = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(target, checkpoint_id=str(path / DCP_DIR))  # into this run's layout, whatever it is
        set_model_state_dict(model, target["model"])
        set_optimizer_state_dict(model, opt, target["optim"])
    else:
        from safetensors.torch import load_model

        if ctx.is_main:
            load_model(model, str(path / "model.safetensors"), device=str(ctx.device))
        _broadcast_module(model)
        saved = torch.load(path / "optimizer.pt", weights_only=True, map_location=ctx.device) if ctx.is_main else None
        opt.load_state_dict(_broadcast_tensors(saved, ctx))
    schedule = torch.load(path / "scheduler.pt", weights_only=True) if ctx.is_main else None
    sched.load_state_dict(_broadcast(schedule, ctx))
    rng = None
    if ctx.is_main:  # a rank beyond a resharded checkpoint's world keeps its fresh state (None)
        files = [path / f"rng_rank{r}.pt" for r in range(ctx.world_size)]
        rng = [torch.load(f, weights_only=True) if f.exists() else None for f in files]
    mine = [None]
    dist.scatter_object_list(mine, rng, src=0)
    if mine[0] is not None:
        _set_rng_state(mine[0])
    state = TrainerState(**{k: raw[k] for k in TrainerState.__dataclass_fields__ if k in raw})
    state.resumed_from = state.step
    return state, _broadcast(read_jsonl(path / STEPS_LOG) if ctx.is_main else None, ctx)


def require_shared(ckpt_dir: Path, ctx: WorkerContext) -> None:
    """All ranks call: refuse, on every rank, a checkpoint directory that some rank does not share with rank 0.
    Rank 0 writes a token of its own into ``ckpt_dir``; every rank reads it back; the ranks that cannot are
    named with their hosts. Without the check, a rank on a machine that does not mount rank 0's directory
    met a FileNotFoundError at the first checkpoint, after the work up to it."""
    # rank 0's directory, as rank 0 names it: a relative path means another directory on another machine
    token, where = _broadcast((uuid.uuid4().hex, str(ckpt_dir.resolve())) if ctx.is_main else None, ctx)
    probe = ckpt_dir / f".shared-check-{token}"
    if ctx.is_main:
        probe.write_text(token)
    dist.barrier()
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (seen, socket.gethostname()))
    dist.barrier()  # every rank has looked before rank 0 removes it
    if ctx.is_main:
        probe.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(everyone) if not ok]
    if blind:
        raise ConfigError(
            "ddp.strategy",
            f"fsdp writes every rank's shards into the checkpoint directory {where} (rank 0's, on "
            f"{everyone[0][1]}), which {', '.join(blind)} cannot see: mount one shared directory at that path "
            "on every machine (or set the stage's paths.*_checkpoints to one), or use ddp.strategy: ddp, "
            "whose checkpoints rank 0 writes alone",
        )
