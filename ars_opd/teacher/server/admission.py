"""What the bundled server runs next and what it refuses: the queue of waiting rows, the batches they form,
and how long a new request would wait.

A batch runs until its longest row ends (no continuous batching), so what a batch costs is its generating
rows times the longest ``max_tokens`` among them, its *token budget*, not its number of rows: 64 rows of 8
tokens are a short batch, 64 rows of 2,048 tokens hold everyone behind them for minutes. ``RowQueue.take``
forms batches in arrival order up to ``max_batch_size`` rows and, when ``max_batch_tokens`` is set, up to
that budget; a row that would break either limit starts the next batch (no row overtakes another, so a long
one cannot be starved). One generating row alone always fits: a budget smaller than one request's
``max_tokens`` slows nothing but that request. Scoring rows (``ScoreJob``: one forward, no decoding steps)
count against ``max_batch_size`` only.

Rows whose client has gone (``cancelled``) are dropped as the queue reaches them, never computed.

``Throughput`` estimates a new request's wait for its answer, which the engine compares with
``max_queue_s`` before queueing it (over: 429 with Retry-After): the running batch's rest, plus the budgets
of every batch the queue would form up to and including the request's own (``plan``), at the budget tokens
per second of the last few batches and the running one. What it assumes: that the rows ahead run as long
as recent batches did (their share of the longest ``max_tokens``) and that the speed holds; a machine that
slows down after a request was admitted can still make it outlast the client's timeout, which is why the
limit is a fraction of that timeout. Before the first decoding step there is no estimate, and nothing is
refused.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from ars_opd.teacher.server.jobs import Job, ScoreJob

Row = Job | ScoreJob


class _Batch:
    """Rows gathered for one batch under the limits, in order."""

    def __init__(self, max_rows: int, max_tokens: int | None):
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.rows: list[Row] = []
        self.generating = 0
        self.longest = 0

    def fits(self, row: Row) -> bool:
        if not self.rows:
            return True
        if len(self.rows) >= self.max_rows:
            return False
        if isinstance(row, ScoreJob) or self.max_tokens is None or self.generating == 0:
            return True
        return (self.generating + 1) * max(self.longest, row.max_tokens) <= self.max_tokens

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
    batch = _Batch(1 << 62, None)
    for row in rows:
        batch.add(row)
    return batch.budget


def plan(rows: Iterable[Row], max_rows: int, max_tokens: int | None) -> list[int]:
    """The token budgets of the batches ``rows`` would form, in order, taken as ``RowQueue.take`` takes them
    (cancelled rows left out)."""
    budgets, batch = [], _Batch(max_rows, max_tokens)
    for row in rows:
        if row.cancelled:
            continue
        if not batch.fits(row):
            budgets.append(batch.budget)
            batch = _Batch(max_rows, max_tokens)
        batch.add(row)
    if batch.rows:
        budgets.append(batch.budget)
    return budgets


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

    def take(self, max_rows: int, max_tokens: int | None) -> tuple[list[Row], int]:
        """The next batch from the head of the queue, and how many cancelled rows were dropped on the way."""
        batch, dropped = _Batch(max_rows, max_tokens), 0
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


@dataclass
class _Running:
    started: float
    budget: int
    longest: int
    steps: int = 0

    @property
    def rows(self) -> int:
        return self.budget // max(1, self.longest)


class Throughput:
    """How fast the engine gets through token budgets: budget tokens per second of its last few batches and of
    the running one.

    Measured in the unit the estimate adds up (``budget``), so rows that end early at EOS make the rate look
    higher rather than the estimate wrong. What a batch cut short by clients that left, and the running batch
    so far, count is the decoding slots they ran (rows × steps): their budget would make them look fast.
    ``clock``: a monotonic clock in seconds (a test passes its own).
    """

    WINDOW = 4  # batches: a machine that slows down shows in the rate within a few batches

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        # (tokens counted, seconds, longest max_tokens, steps run); longest 0 for a batch cut short
        self._done: deque[tuple[int, float, int, int]] = deque(maxlen=self.WINDOW)
        self.running: _Running | None = None

    def record(self, tokens: int, seconds: float, longest: int = 0, steps: int = 0) -> None:
        """A finished batch: the tokens it counts for (its budget; the slots it ran when cut short) in
        ``seconds``; for a batch that ran to its end also its longest ``max_tokens`` and the steps it ran
        (fewer when every row ended early)."""
        if tokens > 0 and seconds > 0:
            self._done.append((tokens, seconds, longest, steps))

    def begin(self, budget: int, longest: int) -> None:
        self.running = _Running(self.clock(), budget, longest)

    def step(self) -> None:
        """One decoding step of the running batch (called on the generation thread)."""
        if self.running is not None:
            self.running.steps += 1

    def end(self, complete: bool) -> None:
        """The running batch is over; ``complete``: no row of it was stopped because its client left."""
        running, self.running = self.running, None
        if running is None:
            return
        seconds = self.clock() - running.started
        if complete:
            self.record(running.budget, seconds, running.longest, running.steps)
        else:
            self.record(running.rows * running.steps, seconds)

    def rate(self) -> float | None:
        """Budget tokens per second over the recent batches and the running one; None before any step."""
        tokens, seconds = sum(d[0] for d in self._done), sum(d[1] for d in self._done)
        running = self.running
        if running is not None and running.steps > 0:  # a machine that slows down shows before the batch ends
            tokens, seconds = tokens + running.rows * running.steps, seconds + self.clock() - running.started
        return tokens / seconds if tokens > 0 and seconds > 0 else None

    def running_left_s(self, rate: float) -> float:
        """Seconds until the running batch ends (0 when none runs): after a few steps from its own speed and the
        share of their longest ``max_tokens`` recent batches ran, before that from ``rate``."""
        running = self.running
        if running is None:
            return 0.0
        elapsed = self.clock() - running.started
        if running.steps < 2:  # the first step includes the prompts' forward: too early to time the steps
            return max(0.0, running.budget / rate - elapsed)
        longest = sum(d[2] for d in self._done)
        share = min(1.0, sum(d[3] for d in self._done if d[2]) / longest) if longest else 1.0
        steps_left = max(share * running.longest - running.steps, 1.0)
        return steps_left * elapsed / running.steps

    def estimate_s(self, queued: Iterable[Row], row: Row, max_rows: int, max_tokens: int | None) -> float | None:
        """Seconds until ``row`` would be answered if queued now behind ``queued``: the running batch's rest, then
        every batch the queue forms up to and including ``row``'s, at ``rate``. None before any measurement."""
        rate = self.rate()
        if rate is None:
            return None
        return self.running_left_s(rate) + sum(plan([*queued, row], max_rows, max_tokens)) / rate
