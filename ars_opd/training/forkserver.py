"""The forkserver that CPU workers are forked from (``ars_opd.training.distributed.launch``), without torch.

This module imports the standard library only, so a training stage can start the forkserver first thing
(``start_early``, from ``stages``): it then imports the engine on one core while the stage's own process
imports the same on the other, and the stage's first launch finds it ready instead of waiting ~20 s.

A forkserver's children inherit its environment and stdout/stderr, those of the moment it started, so
``use_forkserver`` starts a new one whenever either has changed since: the workers see the launching
process's environment as it is at each launch, as spawned ones would (also what libraries read only once,
at import).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
from multiprocessing import forkserver as _mp_forkserver

# what the forkserver imports before it forks any worker: the whole engine (torch and transformers included)
WORKER_PRELOAD = ("ars_opd.training.worker",)
# (environment, stdout/stderr identity) the running forkserver was started under; None before the first
_started_under: tuple | None = None
_TORCH_OWN = ("TORCHELASTIC_", "TORCHINDUCTOR_CACHE_DIR")


def usable() -> bool:
    """Whether this Python's multiprocessing has the forkserver parts used here (CPython 3.8 on)."""
    return hasattr(_mp_forkserver, "_forkserver") and hasattr(_mp_forkserver._forkserver, "_stop")


def _stdio_identity() -> tuple:
    out = []
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            out.append((st.st_dev, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def _now() -> tuple:
    # not counted as a change: variables torch sets in this process on its own, which a worker sets alike
    # (elastic's TORCHELASTIC_* during a launch, handed to the workers by elastic itself; inductor's cache
    # directory, TORCHINDUCTOR_CACHE_DIR, the first time anything asks for it), and pytest's name of the
    # running test, new for every test
    env = sorted((k, v) for k, v in os.environ.items() if not k.startswith(_TORCH_OWN) and k != "PYTEST_CURRENT_TEST")
    return tuple(env), _stdio_identity()


def use_forkserver() -> bool:
    """Make the forkserver's children see this process's environment and stdio as they are now: keep the
    running forkserver if it was started under the same ones, else stop it (the next launch starts a new
    one, which imports ``WORKER_PRELOAD`` first). True when the running one was kept."""
    global _started_under
    now = _now()
    kept = _started_under == now
    if _started_under is not None and not kept:
        _stop_running()
    multiprocessing.set_forkserver_preload(list(WORKER_PRELOAD))
    _started_under = now
    return kept


def _stop_running() -> None:
    """Stop the running forkserver and forget it, without waiting for its children. multiprocessing's own
    stop closes the forkserver's "alive" pipe and waits for it to exit, but every child it forked holds a
    copy of that pipe, so the forkserver outlives (and the stop waits for) any child still running: a
    worker left over from an earlier launch would block every later launch for good. Terminating it first
    makes the wait its own exit; a child, if any, runs on unaffected."""
    _terminate()
    _mp_forkserver._forkserver._stop()


def _terminate() -> None:
    """SIGTERM the running forkserver, if any, and return at once (a forkserver already gone is no error)."""
    pid = getattr(_mp_forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def start_early(threads_per_worker: int) -> None:
    """Start the forkserver now, under the environment ``launch`` will have (it sets ``OMP_NUM_THREADS`` to
    the threads per worker unless set), and return at once: the forkserver imports the engine on its own."""
    if not usable():
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, threads_per_worker)))
    use_forkserver()
    _mp_forkserver.ensure_running()
    atexit.register(_stop_at_exit)


def _stop_at_exit() -> None:
    """Stop the forkserver when this process exits, without waiting for it: one still importing the engine
    (a stage that failed before it launched any worker) would otherwise keep the stage's stdout and stderr
    open, and whoever reads them (DVC, a test, a pipe) waiting, until its imports finish."""
    _terminate()
