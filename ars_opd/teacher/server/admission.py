"""What the bundled server runs next: the queue of waiting rows and the batches they form.

A batch runs until its longest row ends (no continuous batching), so what a batch costs is its generating
rows times the longest ``max_tokens`` among them, its *token budget*, not its number of rows: 64 rows of 8
tokens are a short batch, 64 rows of 2,048 tokens hold everyone behind them for minutes. ``RowQueue.take``
forms batches in arrival order up to ``max_batch_size`` rows and, when ``max_batch_tokens`` is set, up to
that budget; a row that would break either limit starts the next batch (no row overtakes another, so a long
one cannot be starved). One generating row alone always fits: a budget smaller than one request's
``max_tokens`` slows nothing but that request. Scoring rows (``ScoreJob``: one forward, no decoding steps)
count against ``max_batch_size`` only.

Rows whose client has gone (``cancelled``) are dropped as the queue reaches them, never computed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Iterable, Iterator

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
