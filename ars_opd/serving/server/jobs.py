"""The rows waiting in the bundled server's queue, and the events that answer them.

A request handler submits one row per completion (``Job``) or per scored prompt (``ScoreJob``) and then
listens on the row's ``events`` queue in its own event loop, while the generation thread fills the row and
posts to it: ``Progress`` as a completion grows, a ``RowScores`` for a scored prompt, ``Failure`` when the
engine cannot answer. They live apart from the engine because both sides use them: the engine's threads
write them, the HTTP handlers read them, and neither needs the other's code to do so.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Progress:
    """A row's completion so far (already cut at a stop string); ``finish_reason`` set on the last one."""

    text: str
    completion_tokens: int
    finish_reason: str | None


@dataclass
class Failure:
    """A request the engine could not answer: the HTTP status and message its handler sends."""

    status: int
    message: str


class _Answered:
    """A queued row whose request handler listens on ``events`` in its event loop ``loop``."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    done: bool

    def post(self, event) -> None:
        """Hand an event to the request's handler from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def fail(self, status: int, message: str) -> None:
        self.done = True
        self.post(Failure(status, message))


@dataclass(eq=False)
class ScoreJob(_Answered):
    """One prompt of a scoring request: its row in a scoring batch, answered with one ``RowScores`` event."""

    prompt_ids: list[int]
    top_k: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    done: bool = False
    cancelled: bool = False


@dataclass(eq=False)
class Job(_Answered):
    """One request's row in a batch. The generation thread writes the token fields, the handler reads events."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    completion_ids: list[int] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False
    """Set by the handler when it stops listening (client gone); the row is then dropped."""
    stop_ids: frozenset[int] = frozenset()
    """Token ids that end this row besides the model's EOS ids (``stop_token_ids``)."""
    logprobs: list[float] | None = None
    """When a list: the generation thread appends each sampled token's raw log-probability (log-softmax of
    the logits at temperature 1, fp32) as the row grows."""
