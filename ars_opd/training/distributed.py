"""Starting data-parallel workers and talking between them (torch.distributed only).

``launch(fn, job, workers)`` runs ``fn(job)`` on ``workers`` processes through torch's elastic launch API
(the engine behind ``torchrun``), on this machine, with a c10d rendezvous on 127.0.0.1 and a free port,
and returns rank 0's result. So ``dvc repro`` needs no extra launcher. One worker (``workers == 1``) runs
``fn(job)`` in this process instead, in a world of one on a private in-memory store (``init_worker``): the
same code on the same data, so the same result bit for bit (tested), without a spawned interpreter's
start-up (re-importing torch and transformers) or a second resident process. When the current process already
is a worker of an outside launcher (``torchrun``/``accelerate launch`` set ``WORLD_SIZE``, e.g. for
multi-node runs), ``fn`` runs here directly and the launcher's world is used.

How workers start. On CPU they are forked from a *forkserver*: a clean process, started once per launching
process, that has imported the engine (torch, transformers, ``ars_opd.training.worker``) and nothing else;
so a launch costs a fork instead of an interpreter that re-imports torch and transformers (about 20 s of
CPU per worker on the 2-core CI machine). The forkserver has run no torch op, so no OpenMP pool is copied
into a child (forking a process that has used one can hang the child's first parallel op). A child of the
forkserver inherits the forkserver's environment and stdout/stderr, not the launching process's current
ones; so the forkserver is started again whenever either has changed since (``forkserver.use_forkserver``): a
worker sees exactly the environment a spawned one would (also what libraries read once, at import). With
CUDA visible, workers are spawned (a fresh interpreter each), because a process that has touched CUDA must
not fork and the engine's imports may touch it. ``launch(..., start_method="spawn")`` asks for that on CPU too.

``init_worker`` joins the process group (gloo on CPU, NCCL on CUDA by default) and pins the device and
CPU threads. ``gather_floats`` all-gathers a few scalars per worker in one call.

A worker's exception reaches the caller of ``launch`` as itself (pickled to the launcher, which re-raises it
from a ``WorkerFailedError`` carrying the worker's traceback), as it would in one process or under an
outside launcher: so a stage reports a worker's ``ConfigError`` or ``EndpointError`` as a message alone
(``stages.run_stage``), and elastic's own log of that failure, a second traceback, is left out. An
exception that does not pickle, or a worker killed by a signal, fails as a ``WorkerFailedError``.

What this module leaves out: model parallelism, fault-tolerant restarts
(``max_restarts=0``: a failed worker fails the stage, which then resumes from its checkpoint).
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import socket
import tempfile
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ars_opd.config import launched_externally  # noqa: F401  (where workers ask it)
from ars_opd.lm.precision import resolve_device
from ars_opd.training import forkserver


class WorkerFailedError(RuntimeError):
    """A data-parallel worker raised; the message carries its error."""


@dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_and_capture(fn: Callable[[Any], Any], job: Any, error_dir: str | None = None) -> Any:
    try:
        return fn(job)
    except BaseException as e:  # elastic reports only "exitcode 1" for a plain raise; keep the message
        import traceback

        rank = os.environ.get("RANK", "?")
        text = traceback.format_exc()
        if error_dir is not None and isinstance(e, Exception):
            _save_error(e, text, Path(error_dir) / f"{rank}.pickle")
        raise WorkerFailedError(f"worker {rank}: {type(e).__name__}: {e}\n{text}") from e


def _save_error(error: Exception, text: str, path: Path) -> None:
    """Pickle a worker's exception and traceback for the launcher, if the exception round-trips (its class
    importable, its constructor's arguments kept); else nothing, and the launcher falls back."""
    try:
        blob = pickle.dumps({"error": error, "traceback": text})
        pickle.loads(blob)
    except Exception:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, path)  # whole or absent: the launcher may look as soon as the process exits


def _load_error(path: Path) -> dict | None:
    try:
        return pickle.loads(path.read_bytes())
    except Exception:  # absent (killed by a signal, not picklable) or not loadable here
        return None


class _QuietWhenReraised(logging.Filter):
    """Drops torch's reports of a failed worker when that worker left its exception for the launcher to
    re-raise, so the stage reports the error once: elastic's "failed (exitcode ...)" (with a traceback of its
    own; it names the worker by local rank, the global rank here on one node) and "Terminating process"
    for each of the others, stopped because of it."""

    def __init__(self, error_dir: str):
        super().__init__()
        self.error_dir = Path(error_dir)

    def filter(self, record: logging.LogRecord) -> bool:
        message, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if message.startswith("failed (exitcode") and len(args) >= 2:
            return not (self.error_dir / f"{args[1]}.pickle").exists()
        if message.startswith("Terminating process"):
            return not any(self.error_dir.glob("*.pickle"))
        return True


def default_start_method() -> str:
    """``forkserver`` on CPU, ``spawn`` where CUDA is visible (see the module's docstring)."""
    return "spawn" if torch.cuda.is_available() or not forkserver.usable() else "forkserver"


def launch(
    fn: Callable[[Any], Any],
    job: Any,
    workers: int,
    threads_per_worker: int = 1,
    in_process: bool = True,
    start_method: str | None = None,
) -> Any:
    """Run ``fn(job)`` on ``workers`` local processes (or here, under an outside launcher); rank 0's result.

    ``in_process``: one worker runs here (``False`` starts it like any other count, as before).
    ``start_method``: ``forkserver`` or ``spawn``; None picks ``default_start_method()``.
    """
    if launched_externally():
        return fn(job)
    if workers == 1 and in_process:
        return _run_here(fn, job, threads_per_worker)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, threads_per_worker)))
    method = start_method or default_start_method()
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', not {method!r}")
    if method == "forkserver":
        forkserver.use_forkserver()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_configs={"join_timeout": 120},
        max_restarts=0,
        monitor_interval=0.2,
        start_method=method,
        local_addr="127.0.0.1",
    )
    logs = [
        logging.getLogger(name)
        for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    ]
    with tempfile.TemporaryDirectory(prefix="ars-opd-workers-") as error_dir:
        quiet = _QuietWhenReraised(error_dir)
        for log in logs:
            log.addFilter(quiet)
        try:
            results = elastic_launch(config, _run_and_capture)(fn, job, error_dir)
        except ChildFailedError as e:
            rank, first = e.get_first_failure()
            saved = _load_error(Path(error_dir) / f"{rank}.pickle")
            if saved is None:
                message = first.message if isinstance(first.message, str) else str(first.message)
                raise WorkerFailedError(f"a data-parallel worker failed: {message[-4000:]}") from None
            # the worker's own exception, as if raised here; its traceback travels in the cause
            raise saved["error"] from WorkerFailedError(f"worker {rank} failed:\n{saved['traceback']}")
        finally:
            for log in logs:
                log.removeFilter(quiet)
    return results[0]


def _run_here(fn: Callable[[Any], Any], job: Any, threads: int) -> Any:
    """``fn(job)`` as the only worker, in this process: this process's thread count and RNG states are
    restored afterwards (the worker sets both as a spawned one would), so a caller sees no side effect."""
    import random

    saved = (
        torch.get_num_threads(),
        torch.get_rng_state(),
        random.getstate(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )
    if dist.is_initialized():
        raise RuntimeError(
            "a training stage started in-process while this process already belongs to a "
            "process group; launch it from a process outside any group"
        )
    # a spawned worker starts with OMP_NUM_THREADS threads (``launch`` sets it to ``threads`` unless set);
    # ``init_worker`` sets ``threads`` when it is > 0, and for 0 the same default applies here
    torch.set_num_threads(max(1, threads) if threads > 0 else int(os.environ.get("OMP_NUM_THREADS") or 1))
    try:
        return fn(job)
    finally:
        torch.set_num_threads(saved[0])
        torch.set_rng_state(saved[1])
        random.setstate(saved[2])
        if saved[3] is not None:
            torch.cuda.set_rng_state_all(saved[3])


def init_worker(
    device: str = "auto", backend: str = "auto", threads: int = 1, timeout_s: float = 600.0
) -> WorkerContext:
    """Join (or create, for a single process) the default process group; pin device and threads."""
    if threads > 0:
        torch.set_num_threads(threads)
    if not dist.is_initialized():
        dev = resolve_device(device)
        chosen = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ:
            dist.init_process_group(chosen, timeout=timedelta(seconds=timeout_s))
        else:  # a single in-process worker: a world of one on a private in-memory store. The environment
            # is left alone, so that a later launch() in this process is not mistaken for an outside launcher.
            dist.init_process_group(
                chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s)
            )
    dev = resolve_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return WorkerContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        device=dev,
        backend=dist.get_backend(),
    )


def shutdown_worker() -> None:
    """Destroy the process group, after collecting what no one references any more: a DDP model in a reference
    cycle (its hooks hold it) is freed only by the cyclic collector, and its reducer destroyed after the group
    can block for good (a thread join in ProcessGroupGloo's destructor; seen in CI). A model still referenced
    must be dropped by its holder before this (``run_worker`` drops its trainer)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def gather_floats(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """All-gather one small fp64 vector per worker -> (world_size, len) on CPU, in rank order."""
    local = torch.as_tensor(values, dtype=torch.float64).reshape(-1).to(device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return torch.stack(out).cpu()
