"""Resumable training checkpoints, keyed on everything that determines the run.

A checkpoint (every ``checkpoint_every`` steps and at the end) holds the weights (safetensors), the
optimizer and scheduler state, every worker's RNG state, the counters and the per-step log so far, and
the run's fingerprint: its configuration, the content of its training data and the source of this
package. A rerun with the same fingerprint resumes from the latest checkpoint (the data position follows
from the step number, ``ars_opd.training.batch_plan``); one with another configuration, other data or
changed code starts afresh and says so, so a rerun never publishes a model of other inputs. DVC reruns a
stage exactly when such inputs change. Loading uses ``torch.load(weights_only=True)``; resumed runs are
bit-identical to uninterrupted ones on CPU (tested).

Formats. Under DDP rank 0 writes the whole model (``model.safetensors``) and optimizer (``optimizer.pt``).
A sharded student (``ddp.strategy: fsdp``) is saved by every rank through ``torch.distributed.checkpoint``
(``dcp/``: each rank its shards, keyed by parameter name), which loads into any layout: FSDP at another
world size, DDP, or one worker (resharding).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ars_opd.artifacts import dumps_canonical, files_sha256, read_jsonl, write_json, write_jsonl
from ars_opd.training.distributed import WorkerContext

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


def code_fingerprint() -> str:
    """sha256 over this package's Python sources (relative names and bytes, sorted)."""
    return files_sha256(Path(__file__).resolve().parents[1], (".py",))[0]


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


def _sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def save_checkpoint(
    ckpt_dir: Path,
    ctx: WorkerContext,
    model: torch.nn.Module,
    opt,
    sched,
    state: TrainerState,
    fingerprint: str,
    steps_log: list[dict],
    keep: int,
    layout_fingerprint: str | None = None,
    strategy: str = "ddp",
) -> None:
    """All workers call this; weights/optimizer from rank 0 (DDP) or from every rank (sharded, DCP), RNG from
    every rank; atomic switch of ``latest``."""
    from safetensors.torch import save_model

    final = ckpt_dir / f"step_{state.step:07d}"
    tmp = ckpt_dir / f".step_{state.step:07d}.tmp"
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{ctx.rank}.pt")
    sharded = _sharded(model)
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=str(tmp / DCP_DIR),
        )
    if ctx.is_main:
        if not sharded:
            save_model(model, str(tmp / "model.safetensors"))
            torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        saved = {k: v for k, v in state.__dict__.items() if k != "resharded_from"}
        write_json(
            tmp / "state.json",
            {
                **saved,
                "fingerprint": fingerprint,
                "world_size": ctx.world_size,
                "layout_fingerprint": layout_fingerprint,
                "strategy": strategy,
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
        for p in superseded(ckpt_dir, fingerprint, keep):
            shutil.rmtree(p, ignore_errors=True)
    dist.barrier()


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


def load_checkpoint(
    path: Path, ctx: WorkerContext, model: torch.nn.Module, opt, sched
) -> tuple[TrainerState, list[dict]]:
    raw = json.loads((path / "state.json").read_text())
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

        load_model(model, str(path / "model.safetensors"), device=str(ctx.device))
        opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location=ctx.device))
    sched.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng = path / f"rng_rank{ctx.rank}.pt"
    if rng.exists():  # a rank beyond a resharded checkpoint's world keeps its fresh state
        _set_rng_state(torch.load(rng, weights_only=True))
    state = TrainerState(**{k: raw[k] for k in TrainerState.__dataclass_fields__ if k in raw})
    state.resumed_from = state.step
    return state, read_jsonl(path / STEPS_LOG)


def resume_checkpoint(
    ckpt_dir: Path,
    ctx: WorkerContext,
    model: torch.nn.Module,
    opt,
    sched,
    fingerprint: str,
    layout_fingerprint: str | None,
    reshard: bool,
    strategy: str,
) -> tuple[Found | None, TrainerState, list[dict]]:
    """All ranks call: the checkpoint resumed (None: none matches), the run's state and its log so far (a
    fresh state and an empty log when none matches); rank 0 says why it resumes or starts afresh."""
    state, history = TrainerState(), []
    if ctx.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    found, why = find_checkpoint(ckpt_dir, fingerprint, ctx.world_size, layout_fingerprint, reshard, strategy)
    if found is not None:
        state, history = load_checkpoint(found.path, ctx, model, opt, sched)
        state.resharded_from = found.resharded_from
    if ctx.is_main and (found is not None or why != "no checkpoint"):
        print(f"checkpoints: {why}", flush=True)
    return found, state, history
