"""Resumable training checkpoints, keyed on everything that determines the run.

A checkpoint (every ``checkpoint_every`` steps and at the end) holds the weights (safetensors), the
optimizer and scheduler state, every worker's RNG state, the counters and the per-step log so far, and
the run's fingerprint: its configuration, the content of its training data and the source of this
package. A rerun with the same fingerprint resumes from the latest checkpoint (the data position follows
from the step number, ``ars_opd.training.geometry``); one with another configuration, other data or
changed code starts afresh and says so, so a rerun never publishes a model of other inputs. DVC reruns a
stage exactly when such inputs change. Loading uses ``torch.load(weights_only=True)``; resumed runs are
bit-identical to uninterrupted ones on CPU (tested).
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
        write_jsonl(tmp / STEPS_LOG, steps_log)
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
    return state, read_jsonl(path / STEPS_LOG)
