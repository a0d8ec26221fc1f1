"""Asking a teacher for chat completions (the ``teacher_gen`` stage): bounded concurrency, no lost work.

``ask_all`` sends every request whose key is not yet in the ``TeacherCache`` with ``openai.AsyncOpenAI``,
at most ``concurrency`` in flight (a fixed pool of worker coroutines pulling from one iterator, so memory
does not grow with the number of prompts). Each answer goes to the cache the moment it arrives.

Requests, retries and errors are the shared HTTP layer's (``ars_opd.teacher.client.endpoint``: ``post_json``,
``with_retries``, ``preflight``), so this client retries as every other one does; here an empty
``choices`` is retried too. A 429 (an endpoint's pushback: its queue would outlast the timeout, or a rate
limit) also lowers the concurrency by one, at least to one, for the rest of the run: the worker that got it
retires once its prompt is done (a worker retires once, however often its prompt is pushed back), so the
requests beyond what the endpoint answers in time stop coming back as 429s (each of which is a request).
A quarter of the workers start at once and the rest with the first result: by then an endpoint that batches
has timed its first (small) batch, and can push back what it cannot answer in time rather than queue it
unknowingly.
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
    """Requests in flight at the end: the configured concurrency less one per 429 (at least one)."""
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return len(self.failures)


@dataclass
class _Worker:
    retiring: bool = False
    """A 429 came back for one of its requests: it stops once its prompt is done."""


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
    summary.concurrency = min(settings.limits.concurrency, len(pending))
    workers = summary.concurrency
    first_result = asyncio.Event()

    async def handle(req: TeacherRequest, me: _Worker) -> None:
        nonlocal results_seen
        key = req.key

        def count_retry(e: RetryableError) -> None:
            summary.retries += 1
            if e.reason.startswith("http_429"):
                summary.pushed_back += 1
                if not me.retiring:  # past what the endpoint answers in time: one fewer in flight
                    me.retiring = True  # once per worker, however often its prompt is pushed back
                    summary.concurrency = max(1, summary.concurrency - 1)

        while True:
            try:
                answer, attempt = await with_retries(lambda: _ask_once(client, req.body), settings, count_retry)
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
            break
        results_seen += 1
        first_result.set()
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

    async def worker(late: bool) -> None:
        nonlocal workers
        if late:
            await first_result.wait()
        me = _Worker()
        for req in queue:
            if abort:
                return
            await handle(req, me)
            if me.retiring and workers > summary.concurrency:  # it was pushed back: it leaves
                workers -= 1
                return

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
        # a quarter at once, the rest with the first result: an endpoint that batches has timed its steps by
        # then, and can push back the excess instead of finding it queued behind a first batch slower than expected
        await asyncio.gather(*(worker(late=i >= (workers + 3) // 4) for i in range(workers)))
    finally:
        if bar is not None:
            bar.close()
        summary.seconds = time.perf_counter() - t0
        if own_client:
            await client.close()
    if abort:
        abort[0].summary = summary
        raise abort[0]
    return summary
