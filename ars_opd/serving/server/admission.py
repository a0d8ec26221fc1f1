"""What the bundled server runs next and what it refuses: the queue of waiting rows, the batches they form,
and how long a new request would wait.

A batch runs until its longest row ends (no continuous batching), so what a batch costs is its generating
rows times the longest ``max_tokens`` among them, its *token budget*, not its number of rows: 64 rows of 8
tokens are a short batch, 64 rows of 2,048 tokens hold everyone behind them for minutes. ``RowQueue.take``
forms batches in arrival order up to ``max_batch_size`` rows and, when ``max_batch_tokens`` is set, up to
that budget; under pushback, once steps are timed, also to half the wait limit (below); a row that would
break a limit starts the next batch (no row overtakes another, so a long one cannot be starved). One
generating row alone always fits: a budget smaller than one request's ``max_tokens`` slows nothing but that
request. Scoring rows (``ScoreJob``: one forward, no decoding steps) count against ``max_batch_size`` only.

Rows whose client has gone (``cancelled``) are dropped as the queue reaches them, never computed.

``Throughput`` estimates a new request's wait for its answer, which the engine compares with
``max_queue_s`` before queueing it (over: 429 with Retry-After): the running batch's rest, plus every batch
the queue would form up to and including the request's own (``plan``), each timed by a model of a decoding
step (a fixed part as large as 16 rows' and a part per row, scaled to the last few batches and the running
one) times the steps it should run. The fixed part matters: timed in tokens per second, small batches look
slow, so a server that pushed back would estimate the small batches it was left with as slower still, and
refuse more. What it assumes: that the rows ahead run as far towards their longest ``max_tokens`` as recent
batches did and that the speed holds; a machine that slows down after a request was admitted can still
make it outlast the client's timeout, which is why the limit is a fraction of that timeout. Before the
first timed step there is no estimate, and nothing is refused. Batches are kept to half the limit as the
model times them: a request that waits out one running batch and runs in the next is then answered within
it, where on a machine too slow for whole batches every queued request would be refused.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ars_opd.serving.server.jobs import Job, ScoreJob

Row = Job | ScoreJob


@dataclass(frozen=True)
class Limits:
    """What one batch may hold: ``max_rows`` rows; a token budget of ``max_tokens`` (None: any); and, given
    ``batch_s`` (the seconds a batch of (generating rows, longest max_tokens) should take), ``max_s`` seconds."""

    max_rows: int
    max_tokens: int | None = None
    max_s: float | None = None
    batch_s: Callable[[int, int], float] | None = None


class _Batch:
    """Rows gathered for one batch under the limits, in order."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.rows: list[Row] = []
        self.generating = 0
        self.longest = 0

    def fits(self, row: Row) -> bool:
        limits = self.limits
        if not self.rows:
            return True
        if len(self.rows) >= limits.max_rows:
            return False
        if isinstance(row, ScoreJob) or self.generating == 0:
            return True
        rows, longest = self.generating + 1, max(self.longest, row.max_tokens)
        if limits.max_tokens is not None and rows * longest > limits.max_tokens:
            return False
        return limits.max_s is None or limits.batch_s is None or limits.batch_s(rows, longest) <= limits.max_s

    def add(self, row: Row) -> None:
        self.rows.append(row)
        if isinstance(row, Job):
            self.generating += 1
            self.longest = max(self.longest, row.max_tokens)

    @property
    def budget(self) -> int:
        """Generating rows × the longest ``max_tokens``: the decoding slots the batch may take."""
        return self.generating * self.longest


def budget(rows: Iterable[Row]) -> int:
    """The token budget of a batch of ``rows``: its generating rows × the longest ``max_tokens`` among them."""
    batch = _Batch(Limits(1 << 62))
    for row in rows:
        batch.add(row)
    return batch.budget


def plan(rows: Iterable[Row], limits: Limits) -> list[tuple[int, int]]:
    """The batches ``rows`` would form, in order, taken as ``RowQueue.take`` takes them (cancelled rows left
    out): for each its generating rows and their longest ``max_tokens``."""
    shapes, batch = [], _Batch(limits)
    for row in rows:
        if row.cancelled:
            continue
        if not batch.fits(row):
            shapes.append((batch.generating, batch.longest))
            batch = _Batch(limits)
        batch.add(row)
    if batch.rows:
        shapes.append((batch.generating, batch.longest))
    return shapes


class RowQueue:
    """Rows waiting for a batch, in arrival order (used from the event loop only)."""

    def __init__(self):
        self._rows: deque[Row] = deque()
        self._waiting = asyncio.Event()

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Row]:
        return iter(self._rows)

    def put(self, row: Row) -> None:
        self._rows.append(row)
        self._waiting.set()

    async def wait(self) -> None:
        """Return once a row waits."""
        while not self._rows:
            self._waiting.clear()
            await self._waiting.wait()

    def take(self, limits: Limits) -> tuple[list[Row], int]:
        """The next batch from the head of the queue, and how many cancelled rows were dropped on the way."""
        batch, dropped = _Batch(limits), 0
        while self._rows:
            row = self._rows[0]
            if row.cancelled:
                self._rows.popleft()
                dropped += 1
            elif batch.fits(row):
                batch.add(self._rows.popleft())
            else:
                break
        return batch.rows, dropped

    def drain(self) -> list[Row]:
        """Every waiting row, taken out."""
        rows = list(self._rows)
        self._rows.clear()
        return rows


# -- how long the queue would take ----------------------------------------------------------------------------


TIMED_STEPS = 4  # a batch's own speed is read once this many steps ran (the first, with the prompts, untimed)
# A decoding step's fixed part, in rows: SmolLM2-135M on 2 CPU threads took 89, 178 and 320 ms a step at 8, 32
# and 64 rows, 3.7 ms x (16 + rows) within 7%. A GPU's is larger: there this overprices big batches.
FIXED_ROWS = 16


@dataclass
class _Running:
    started: float
    rows: int
    longest: int
    steps: int = 0
    first_step: float = 0.0
    """When the first step (the prompts' forward and the first token) ended: later steps are timed from it."""

    def step_s(self, now: float) -> float | None:
        """Seconds per decoding step so far, the first (with the prompts' forward) left out."""
        return (now - self.first_step) / (self.steps - 1) if self.steps >= 2 else None


class Throughput:
    """How long the engine's batches take, measured on its last few batches and the running one.

    A decoding step of a batch of ``rows`` rows takes ``c × (FIXED_ROWS + rows)``: a fixed part (the weights
    are read once per step whatever the batch) as large as ``FIXED_ROWS`` rows' own arithmetic, with ``c``
    fitted to the recent batches' seconds per step, weighted by their steps. The ratio is not fitted: the
    batches a server runs under load are of few sizes and their times noisy, and a fit that takes small
    batches' steps as mostly per-row work prices bigger batches far too high, so that a server that pushed
    back, left with small batches, would allow only smaller ones (a smoke run ended with batches of one to
    seven rows). Steps are timed from the end of a batch's first, whose forward over the prompts would make
    early readings of a running batch slow (a smoke run pushed back its whole second wave on them); a batch
    is timed at ``share × longest max_tokens`` steps, ``share`` being how far recent batches ran to their
    longest ``max_tokens`` (rows end early at EOS), its prompts' forward not counted. A batch cut short by
    clients that left still times its steps. ``clock``: monotonic seconds (a test passes its own).
    """

    WINDOW = 8  # batches: a machine that slows down shows within a few batches (and the running one at once)

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._done: deque[tuple[int, int, float, int]] = deque(maxlen=self.WINDOW)  # rows, steps, s, longest
        self.running: _Running | None = None

    def record(self, rows: int, steps: int, seconds: float, longest: int = 0) -> None:
        """A finished batch: ``rows`` generating rows ran ``steps`` decoding steps in ``seconds`` after their
        first; ``longest``: their longest ``max_tokens`` when it ran to its end (0 when cut short by clients
        that left)."""
        if rows > 0 and steps > 0 and seconds > 0:
            self._done.append((rows, steps, seconds, longest))

    def begin(self, rows: int, longest: int) -> None:
        self.running = _Running(self.clock(), rows, longest)

    def step(self) -> None:
        """One decoding step of the running batch (called on the generation thread)."""
        running = self.running
        if running is not None:
            running.steps += 1
            if running.steps == 1:
                running.first_step = self.clock()

    def end(self, complete: bool) -> None:
        """The running batch is over; ``complete``: no row of it was stopped because its client left."""
        running, self.running = self.running, None
        if running is not None and running.steps >= 2:
            seconds = self.clock() - running.first_step
            self.record(running.rows, running.steps - 1, seconds, running.longest if complete else 0)

    def step_model(self) -> tuple[float, float] | None:
        """(fixed_s, per_row_s) of a decoding step, from the recent batches and the running one's steps so far;
        None before any step was timed."""
        points = [(rows, seconds / steps, steps) for rows, steps, seconds, _ in self._done]
        running = self.running
        if running is not None and running.steps >= TIMED_STEPS:  # a slower machine shows before the batch ends
            points.append((running.rows, running.step_s(self.clock()), running.steps - 1))
        if not points:
            return None
        per_row = sum(t * w for _, t, w in points) / sum((FIXED_ROWS + r) * w for r, _, w in points)
        return FIXED_ROWS * per_row, per_row

    def share(self) -> float:
        """How far recent batches ran to their longest ``max_tokens`` (1 before any ran to its end)."""
        longest = sum(d[3] for d in self._done)
        ran = sum(d[1] + 1 for d in self._done if d[3])  # the timed steps and the first
        return min(1.0, ran / longest) if longest else 1.0

    def batch_s(self, rows: int, longest: int, model: tuple[float, float]) -> float:
        fixed, per_row = model
        return max(1.0, self.share() * longest) * (fixed + per_row * rows)

    def running_left_s(self, model: tuple[float, float]) -> float:
        """Seconds until the running batch ends (0 when none runs): after ``TIMED_STEPS`` steps at its own speed,
        before that as ``model`` says, less the time spent."""
        running = self.running
        if running is None:
            return 0.0
        now = self.clock()
        if running.steps < TIMED_STEPS:
            return max(0.0, self.batch_s(running.rows, running.longest, model) - (now - running.started))
        steps_left = max(self.share() * running.longest - running.steps, 1.0)
        return steps_left * running.step_s(now)

    def limits(self, max_rows: int, max_tokens: int | None, max_s: float | None) -> Limits:
        """A batch's limits: with ``max_s`` and a timed step, also at most ``max_s`` seconds as the model says."""
        model = self.step_model() if max_s is not None else None
        if model is None:
            return Limits(max_rows, max_tokens)
        return Limits(max_rows, max_tokens, max_s, lambda rows, longest: self.batch_s(rows, longest, model))

    def estimate_s(self, queued: Iterable[Row], row: Row, limits: Limits) -> float | None:
        """Seconds until ``row`` would be answered if queued now behind ``queued``: the running batch's rest, then
        every batch the queue forms under ``limits`` up to and including ``row``'s. None before any step was
        timed."""
        model = self.step_model()
        if model is None:
            return None
        ahead = plan([*queued, row], limits)
        return self.running_left_s(model) + sum(self.batch_s(rows, longest, model) for rows, longest in ahead)
