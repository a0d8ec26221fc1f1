"""Asking a teacher through any OpenAI-compatible endpoint: bounded concurrency, retries, no lost work.

``ask_all`` sends every request whose key is not yet in the ``TeacherCache`` with ``openai.AsyncOpenAI``,
at most ``concurrency`` in flight (a fixed pool of worker coroutines pulling from one iterator, so memory
does not grow with the number of prompts). Each answer goes to the cache the moment it arrives.

Retries: timeouts, dropped connections, 408/409/425/429 and 5xx, malformed bodies and empty ``choices``
are retried with exponential backoff and jitter, honouring ``retry-after`` / ``retry-after-ms`` (capped),
up to ``max_attempts``. 400/401/403/404/413/422 cannot succeed by retrying and fail at once. An answer
with no text (empty or whitespace content) is a failure (``empty_completion``), not an answer: it is never
cached, so it cannot be served again as if it were one. Every final failure is returned with its reason
and HTTP status. 401/403 abort the whole run (the key is wrong for every request),
and so does a run whose first ``abort_after`` results are all failures: a misconfigured endpoint is
reported in seconds, not after hours.

Before the first request, ``preflight`` checks that the endpoint answers (``GET /models``) and names the
URL if it does not. The API key is read from the environment by the caller and only passed to the client;
it is never logged or written anywhere.

``post_json`` and ``with_retries`` are the request and retry halves of ``ask_all``, shared with the OPD
scoring client (``ars_opd.teacher.client.score``), so every endpoint client retries the same way.

What this module leaves out: streaming (answers are short and wanted whole), logprobs, tool calls.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, TypeVar

import httpx2
import openai
from tqdm.auto import tqdm

from ars_opd.config import EndpointConfig
from ars_opd.teacher.client.cache import TeacherCache

T = TypeVar("T")
NON_RETRYABLE_STATUS = {400, 401, 403, 404, 413, 422}
AUTH_STATUS = {401, 403}


class EndpointError(RuntimeError):
    """The endpoint is unreachable, rejects the key, serves another model or tokenizer, or fails every
    request. ``summary``: what the run got before it stopped (set when requests were sent).

    The base class of every error about the endpoint or the key (``ScoringError`` included): its message
    is complete, naming the URL or the params key and what to do, so a stage prints it alone and exits 4
    (``stages.run_stage``) instead of a traceback. Raise it (or a subclass) only with such a message.
    """

    summary: "AskSummary | None" = None


@dataclass(frozen=True)
class ClientSettings:
    """Where to send requests and how: ``limits`` holds the endpoint params (concurrency, timeout, retries)."""

    base_url: str
    api_key: str = "EMPTY"
    limits: EndpointConfig = EndpointConfig()
    max_retry_after_s: float = 60.0
    abort_after: int = 20
    transport: str = "aiohttp"  # "aiohttp" (faster at high concurrency) or "httpx"

    def __repr__(self) -> str:  # never show the key
        return f"ClientSettings(base_url={self.base_url!r}, concurrency={self.limits.concurrency}, ...)"


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
    seconds: float = 0.0

    @property
    def failed(self) -> int:
        return len(self.failures)


def count_by_reason(reasons: Iterable[str]) -> dict[str, int]:
    """How many failures of each kind (the part of a reason before its first ':'), sorted by kind."""
    out: dict[str, int] = {}
    for reason in reasons:
        kind = reason.split(":", 1)[0]
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


class MissingAPIKeyError(EndpointError):
    """The variable a params section's ``api_key_env`` names is not set."""


def api_key(env_name: str | None, section: str, error: type[MissingAPIKeyError] = MissingAPIKeyError) -> str:
    """The key in the environment variable ``env_name`` (``<section>.api_key_env``); "EMPTY" when none is
    named (a local server takes any key). Read here and handed to the client only: written nowhere."""
    if env_name is None:
        return "EMPTY"
    key = os.environ.get(env_name)
    if not key:
        raise error(f"{section}.api_key_env names {env_name}, but that environment variable is not set (or "
                    "empty); export it before running the stage")
    return key


class RetryableError(Exception):
    """A request that may succeed if asked again (see the module docstring: timeouts, dropped connections,
    408/409/425/429, 5xx, malformed answers)."""

    def __init__(self, reason: str, wait_s: float | None = None):
        super().__init__(reason)
        self.reason, self.wait_s, self.attempts = reason, wait_s, 0


class FinalError(Exception):
    """A request that asking again cannot change (any other 4xx)."""

    def __init__(self, reason: str, status: int | None = None):
        super().__init__(reason)
        self.reason, self.status, self.attempts = reason, status, 0


def _retry_after_s(headers: httpx2.Headers | None) -> float | None:
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000.0
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value) if value else None
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def _short(text: Any, n: int = 160) -> str:
    s = str(text).replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def make_client(settings: ClientSettings) -> openai.AsyncOpenAI:
    """An AsyncOpenAI client whose connection pool matches the concurrency; retries are ours, not its."""
    n, timeout_s = settings.limits.concurrency, settings.limits.request_timeout_s
    limits = httpx2.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx2.Timeout(timeout_s, connect=min(10.0, timeout_s))
    kind = {"aiohttp": openai.DefaultAioHttpClient, "httpx": openai.DefaultAsyncHttpxClient}[settings.transport]
    http_client = kind(limits=limits, timeout=timeout)
    return openai.AsyncOpenAI(base_url=settings.base_url, api_key=settings.api_key, max_retries=0,
                              timeout=timeout, http_client=http_client)


async def preflight(client: openai.AsyncOpenAI, model: str, timeout_s: float = 15.0,
                    section: str = "teacher_gen") -> list[str]:
    """Check the endpoint answers and accepts the key; return the model ids it lists (may be empty).

    ``section``: the params section whose keys the error messages name (``teacher_gen``, ``opd.teacher_endpoint``).
    """
    try:
        page = await asyncio.wait_for(client.models.list(), timeout_s)
    except (openai.APIConnectionError, asyncio.TimeoutError, OSError) as e:
        raise EndpointError(f"cannot reach the teacher endpoint {client.base_url} ({type(e).__name__}: "
                            f"{_short(e)}); start the server there, or set {section}.endpoint to the URL it "
                            "listens on") from None
    except openai.APIStatusError as e:
        if e.status_code in AUTH_STATUS:
            raise EndpointError(f"the teacher endpoint {client.base_url} rejected the API key "
                                f"(HTTP {e.status_code}); check the variable named by {section}.api_key_env") from None
        return []  # some compatible servers do not implement /models; the first request will tell
    ids = [m.id for m in page.data]
    if ids and model not in ids:
        raise EndpointError(f"model {model!r} is not served at {client.base_url}; it serves {ids[:10]}: set "
                            f"{section}.model to the served name")
    return ids


async def post_json(client: openai.AsyncOpenAI, path: str, body: dict) -> dict:
    """POST ``body`` to ``path`` and return the JSON object; errors mapped to ``RetryableError`` / ``FinalError``."""
    # ``client.post`` with ``cast_to=object`` is the SDK's public route for a raw JSON body: it keeps the
    # client's transport and error mapping but skips the typed request transform and the response model,
    # whose CPU cost per request limits throughput at high concurrency (bench/teacher_gen.py measures it).
    try:
        resp = await client.post(path, body=body, cast_to=object)
    except openai.APITimeoutError:
        raise RetryableError("timeout") from None
    except openai.APIConnectionError as e:
        raise RetryableError(f"connection_error: {_short(e.__cause__ or e)}") from None
    except openai.APIStatusError as e:
        status = e.status_code
        detail = _short(getattr(e, "message", e))
        if status in NON_RETRYABLE_STATUS:
            raise FinalError(f"http_{status}: {detail}", status) from None
        raise RetryableError(f"http_{status}: {detail}", _retry_after_s(e.response.headers)) from None
    except (openai.APIResponseValidationError, ValueError) as e:
        raise RetryableError(f"malformed_response: {_short(e)}") from None
    if not isinstance(resp, dict):
        raise RetryableError(f"malformed_response: body is {type(resp).__name__}, not a JSON object")
    return resp


async def with_retries(call: Callable[[], Awaitable[T]], settings: ClientSettings,
                       on_retry: Callable[[], None] | None = None) -> tuple[T, int]:
    """``await call()`` until it succeeds: (result, attempts). The one retry loop of every endpoint client.

    ``RetryableError`` errors are retried with exponential backoff and jitter (honouring a capped retry-after)
    up to ``settings.limits.max_attempts``, then re-raised with ``attempts`` set; ``FinalError`` is re-raised at
    once with ``attempts`` set. ``on_retry`` is called before each wait.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await call(), attempt
        except FinalError as e:
            e.attempts = attempt
            raise
        except RetryableError as e:
            if attempt >= settings.limits.max_attempts:
                e.attempts = attempt
                raise
            if on_retry is not None:
                on_retry()
            cap = min(settings.limits.backoff_max_s, settings.limits.backoff_base_s * 2 ** (attempt - 1))
            wait = cap / 2 + random.uniform(0, cap / 2)
            if e.wait_s is not None:
                wait = max(wait, min(e.wait_s, settings.max_retry_after_s))
            await asyncio.sleep(wait)


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
        "usage": {"prompt_tokens": usage.get("prompt_tokens"),
                  "completion_tokens": usage.get("completion_tokens")} if usage else None,
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

    async def handle(req: TeacherRequest) -> None:
        nonlocal results_seen
        key = req.key

        def count_retry() -> None:
            summary.retries += 1

        while True:
            try:
                answer, attempt = await with_retries(lambda: _ask_once(client, req.body), settings, count_retry)
            except FinalError as e:
                summary.failures.append(Failure(key, e.reason, e.attempts, e.status))
                if e.status in AUTH_STATUS:
                    abort.append(EndpointError(f"the teacher endpoint rejected the request ({e.reason}); "
                                               "check the API key variable named by teacher_gen.api_key_env"))
                break
            except RetryableError as e:
                summary.failures.append(Failure(key, e.reason, e.attempts))
                break
            if not answer["content"].strip():  # not an answer: left out of the cache
                summary.failures.append(Failure(key, f"empty_completion: finish_reason "
                                                     f"{answer['finish_reason']!r}", attempt))
                break
            cache.put(key, req.identity, answer)
            summary.completed += 1
            break
        results_seen += 1
        if results_seen == settings.abort_after and summary.completed == 0 and not abort:
            reasons = sorted({f.reason for f in summary.failures})[:3]
            abort.append(EndpointError(f"the first {results_seen} teacher requests all failed ({reasons}); "
                                       "stopping instead of failing every prompt"))
        bar.update(1)
        if summary.failures:
            bar.set_postfix(failed=summary.failed, retries=summary.retries, refresh=False)

    async def worker() -> None:
        for req in queue:
            if abort:
                return
            await handle(req)

    try:
        if check_endpoint:
            await preflight(client, pending[0].body["model"])
        bar = tqdm(total=len(pending), desc="teacher", unit="req", disable=not progress, mininterval=0.5,
                   smoothing=0.05, dynamic_ncols=True)
        await asyncio.gather(*(worker() for _ in range(min(settings.limits.concurrency, len(pending)))))
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

