"""Asking a teacher for chat completions (the ``teacher_gen`` stage): bounded concurrency, no lost work.

``ask_all`` sends every request whose key is not yet in the ``TeacherCache`` with ``openai.AsyncOpenAI``,
at most ``concurrency`` in flight (a fixed pool of worker coroutines pulling from one iterator, so memory
does not grow with the number of prompts). Each answer goes to the cache the moment it arrives.

Requests, retries and errors are the shared HTTP layer's (``ars_opd.teacher.client.endpoint``: ``post_json``,
``with_retries``, ``preflight``), so this client retries as every other one does; here an empty
``choices`` is retried too. A 429 (an endpoint's pushback: its queue would outlast the timeout, or a rate
limit) also takes one request out of flight: the worker that got it hands its prompt on, to be asked first,
after the retry-after, by another worker, and leaves (the last worker waits the retry-after out instead).
The requests beyond what the endpoint answers in time then stop coming back as 429s, each of which is a
request; after twice as many answers as are in flight with no 429, one more is (up to ``concurrency``), so
a slow spell does not slow the rest of the run. A quarter of the workers start at once and the rest with
the first answer: by then an endpoint that batches has timed its first (small) batch, and can push back
what it cannot answer in time rather than queue it unknowingly.
An answer with no text (empty or whitespace content) is a failure (``empty_completion``), not an answer: it
is never cached, so it cannot be served again as if it were one. Every final failure is returned with its
reason and HTTP status. 401/403 abort the whole run (the key is wrong for every request), and so does a run
whose first ``abort_after`` results are all failures: a misconfigured endpoint is reported in seconds, not
after hours.

What this module leaves out: streaming (answers are short and wanted whole), logprobs, tool calls.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

import openai
from tqdm.auto import tqdm

from ars_opd.teacher.client.cache import TeacherCache
from ars_opd.teacher.client.endpoint import (
    AUTH_STATUS,
    ClientSettings,
    EndpointError,
    FinalError,
    RetryableError,
    make_client,
    post_json,
    preflight,
    with_retries,
)


@dataclass(frozen=True)
class TeacherRequest:
    """One question: ``body`` goes to ``chat.completions.create``; ``identity`` is what was hashed into ``key``."""

    key: str
    body: dict
    identity: dict


@dataclass
class Failure:
    key: str
    reason: str
    attempts: int
    status: int | None = None  # HTTP status of a final refusal, else None


@dataclass
class AskSummary:
    requested: int = 0
    already_cached: int = 0
    completed: int = 0
    failures: list[Failure] = field(default_factory=list)
    retries: int = 0
    pushed_back: int = 0
    """Answers 429 (the endpoint's pushback or rate limit), each retried after its retry-after."""
    concurrency: int = 0
    """Requests in flight at the end: the configured concurrency (at most the prompts asked), less one per 429
    that a worker left on, plus one per calm spell since (``ask_all``)."""
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return len(self.failures)


class _PushedBack(Exception):
    """A 429: the endpoint cannot answer in time what is in flight. The worker hands its prompt on and leaves."""

    def __init__(self, wait_s: float | None):
        super().__init__("http_429")
        self.wait_s = wait_s


def count_by_reason(reasons: Iterable[str]) -> dict[str, int]:
    """How many failures of each kind (the part of a reason before its first ':'), sorted by kind."""
    out: dict[str, int] = {}
    for reason in reasons:
        kind = reason.split(":", 1)[0]
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


async def _ask_once(client: openai.AsyncOpenAI, body: dict) -> dict:
    resp = await post_json(client, "/chat/completions", body)
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices:
        raise RetryableError("empty_choices")
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message") if isinstance(first.get("message"), dict) else {}
    content = message.get("content")
    if not isinstance(content, str):
        raise RetryableError("malformed_response: choices[0].message.content is not a string")
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else None
    return {
        "content": content,
        "finish_reason": first.get("finish_reason"),
        "model": resp.get("model"),
        "usage": {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens")}
        if usage
        else None,
    }


async def ask_all(
    items: Iterable[TeacherRequest],
    cache: TeacherCache,
    settings: ClientSettings,
    progress: bool = True,
    client: openai.AsyncOpenAI | None = None,
    check_endpoint: bool = True,
) -> AskSummary:
    """Ask for every request whose key is not in ``cache``; store answers as they arrive.

    Each ``body`` is passed to ``chat.completions.create`` as is (model, messages, sampling params).
    Requests sharing a key are asked once. Returns counts, retries and the final failures with reasons.
    """
    summary = AskSummary()
    pending: list[TeacherRequest] = []
    seen: set[str] = set()
    for req in items:
        if req.key in seen:
            continue
        seen.add(req.key)
        summary.requested += 1
        if req.key in cache:
            summary.already_cached += 1
        else:
            pending.append(req)
    if not pending:
        return summary
    own_client = client is None
    client = client or make_client(settings)
    t0 = time.perf_counter()
    bar = None  # made after the preflight: an endpoint error is then the only thing printed
    abort: list[EndpointError] = []
    results_seen = 0
    queue = iter(pending)
    later: deque[tuple[float, TeacherRequest]] = deque()  # pushed back: asked first, not before the time
    summary.concurrency = most = min(settings.limits.concurrency, len(pending))
    alive = summary.concurrency  # workers not ended, those waiting to start included
    first_response = asyncio.Event()
    tasks: list[asyncio.Task] = []
    calm = 0  # answers since the last 429

    async def handle(req: TeacherRequest) -> bool:
        """Ask for ``req`` until it has a result; False when it was pushed back and handed on (its worker
        leaves: one request fewer in flight)."""
        nonlocal results_seen, calm
        key = req.key

        def count_retry(e: RetryableError) -> None:
            summary.retries += 1
            summary.pushed_back += e.reason.startswith("http_429")

        async def ask() -> dict:
            try:
                return await _ask_once(client, req.body)
            except RetryableError as e:
                if e.reason.startswith("http_"):
                    first_response.set()
                if e.reason.startswith("http_429") and alive > 1:  # the last worker waits it out instead
                    raise _PushedBack(e.wait_s) from None
                raise

        while True:
            try:
                answer, attempt = await with_retries(ask, settings, count_retry)
            except _PushedBack as p:
                count_retry(RetryableError("http_429"))
                summary.concurrency -= 1
                calm = 0
                later.append((time.monotonic() + (p.wait_s or 0.0), req))
                return False
            except FinalError as e:
                summary.failures.append(Failure(key, e.reason, e.attempts, e.status))
                if e.status in AUTH_STATUS:
                    abort.append(
                        EndpointError(
                            f"the teacher endpoint rejected the request ({e.reason}); "
                            "check the API key variable named by teacher_gen.api_key_env"
                        )
                    )
                break
            except RetryableError as e:
                summary.failures.append(Failure(key, e.reason, e.attempts))
                break
            if not answer["content"].strip():  # not an answer: left out of the cache
                summary.failures.append(
                    Failure(key, f"empty_completion: finish_reason {answer['finish_reason']!r}", attempt)
                )
                break
            cache.put(key, req.identity, answer)
            summary.completed += 1
            grow()
            break
        results_seen += 1
        first_response.set()
        if results_seen == settings.abort_after and summary.completed == 0 and not abort:
            reasons = sorted({f.reason for f in summary.failures})[:3]
            abort.append(
                EndpointError(
                    f"the first {results_seen} teacher requests all failed ({reasons}); "
                    "stopping instead of failing every prompt"
                )
            )
        bar.update(1)
        if summary.failures:
            bar.set_postfix(failed=summary.failed, retries=summary.retries, refresh=False)
        return True

    def grow() -> None:
        """One more in flight after twice as many answers as are in flight with no 429 among them (up to the
        concurrency asked): a slow spell that pushed requests back does not slow the rest of the run."""
        nonlocal calm, alive
        calm += 1
        if calm >= 2 * summary.concurrency and summary.concurrency < most:
            calm = 0
            summary.concurrency += 1
            alive += 1
            tasks.append(asyncio.create_task(worker(late=False)))

    async def next_request() -> TeacherRequest | None:
        if later:
            not_before, req = later.popleft()
            await asyncio.sleep(max(0.0, not_before - time.monotonic()))
            return req
        return next(queue, None)

    async def worker(late: bool) -> None:
        nonlocal alive
        try:
            if late:
                await first_response.wait()
            while not abort and (req := await next_request()) is not None:
                if not await handle(req):
                    return
        finally:
            alive -= 1

    try:
        if check_endpoint:
            await preflight(client, pending[0].body["model"])
        bar = tqdm(
            total=len(pending),
            desc="teacher",
            unit="req",
            disable=not progress,
            mininterval=0.5,
            smoothing=0.05,
            dynamic_ncols=True,
        )
        # a quarter at once, the rest with the first answer: an endpoint that batches has timed its steps by
        # then, and can push back the excess instead of finding it queued behind a first batch slower than expected
        tasks.extend(asyncio.create_task(worker(late=i >= (alive + 3) // 4)) for i in range(alive))
        done = 0
        while done < len(tasks):  # workers added meanwhile join the list
            await tasks[done]
            done += 1
    finally:
        for task in tasks:
            task.cancel()  # a no-op for finished ones; the others when this run ends early
        if bar is not None:
            bar.close()
        summary.seconds = time.perf_counter() - t0
        if own_client:
            await client.close()
    if abort:
        abort[0].summary = summary
        raise abort[0]
    return summary
