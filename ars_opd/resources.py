"""What a stage cost: its wall time and the peak memory of its whole process tree, one JSON line per run.

A stage's memory is not its own process's: the training stages fork data-parallel workers (through a forkserver,
a child of the stage), teacher_gen and OPD start servers. So ``PeakMemory`` samples, every ``interval`` seconds in
a daemon thread, the resident set of the stage process and every descendant (read from ``/proc``: each task's
``children`` list and each process's ``VmRSS``), and keeps the largest sum. Sampling can miss a spike shorter
than the interval; a stage lasting seconds or more is measured to within its working set. Where ``/proc`` is
missing (not Linux), the process's own ``ru_maxrss`` is recorded instead and the line says so.

``record_stage`` appends ``{stage, started, wall_s, peak_rss_mb, memory, ok}`` to the stage log
(``paths.stage_runs``, outside DVC's outputs and git: a record of runs, not a result). Reports quote the latest
successful line of each stage (``latest_runs``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from pathlib import Path


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants now."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _rss_bytes(p)
        stack += _children(p)
    return total


class PeakMemory:
    """The largest resident set of this process's tree, sampled in a daemon thread while in a ``with`` block."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.peak = 0
        self.proc = os.path.isdir(f"/proc/{os.getpid()}/task")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            self.peak = max(self.peak, tree_rss_bytes(pid))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "PeakMemory":
        if self.proc:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.proc:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, tree_rss_bytes(os.getpid()))

    @property
    def peak_bytes(self) -> int:
        if self.proc:
            return self.peak
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def record_stage(stage: str, started: float, wall_s: float, memory: PeakMemory, ok: bool, log: str | Path) -> None:
    """Append one stage run to ``log`` (created with its directory); never fails the stage."""
    line = {
        "stage": stage,
        "started": round(started, 3),
        "wall_s": round(wall_s, 2),
        "peak_rss_mb": round(memory.peak_bytes / 2**20, 1),
        "memory": "process tree, sampled" if memory.proc else "this process only (ru_maxrss)",
        "ok": ok,
    }
    from ars_opd.seeding import cpu_kernels_in_use

    kernels = cpu_kernels_in_use()
    if kernels is not None:
        line["cpu_kernels"] = kernels  # the instruction set torch dispatched to (base.cpu_kernels caps it)
    try:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError as e:
        print(f"warning: could not record the stage's run in {log}: {e}", file=sys.stderr)


def latest_runs(log: str | Path) -> dict[str, dict]:
    """The latest successful run of each stage in ``log`` ({} when there is none)."""
    out: dict[str, dict] = {}
    path = Path(log)
    if not path.is_file():
        return out
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a torn last line of a killed run
        if line.get("ok"):
            out[line["stage"]] = line
    return out


def timed(stage: str, main, log: str | Path) -> None:
    """Run ``main()`` measuring its wall time and peak memory, and record it (also when it fails)."""
    started, t0 = time.time(), time.perf_counter()
    ok, memory = False, PeakMemory()
    try:
        with memory:
            main()
        ok = True
    finally:
        record_stage(stage, started, time.perf_counter() - t0, memory, ok, log)
