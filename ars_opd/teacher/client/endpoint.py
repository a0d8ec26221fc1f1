"""The shared HTTP layer of every teacher endpoint client: settings, the client, the preflight, one request
and the one retry loop, and the errors about the endpoint or the key.

``make_client`` builds an ``openai.AsyncOpenAI`` whose connection pool matches the concurrency; retries are
ours, not the SDK's. ``post_json`` sends one request and maps every failure to ``RetryableError`` or
``FinalError``; ``with_retries`` asks again until it succeeds or cannot.

Retries: timeouts, dropped connections, 408/409/425/429 and 5xx, and malformed bodies are retried with
exponential backoff and jitter, honouring ``retry-after`` / ``retry-after-ms`` (capped), up to
``max_attempts``. A 429 that names its retry-after is an endpoint's pushback (its queue would outlast our
timeout, or a rate limit), not a failed attempt: it is waited out without using one, up to
``max_pushbacks`` times per request. 400/401/403/404/413/422 cannot succeed by retrying and fail at once.

Before the first request, ``preflight`` checks that the endpoint answers (``GET /models``) and names the
URL if it does not. The API key is read from the environment (``api_key``) and only passed to the client;
it is never logged or written anywhere.

Its users are the chat-completion asking of ``teacher_gen`` (``ars_opd.teacher.client.chat``), the OPD
scoring client (``ars_opd.teacher.client.score``) and OPD training, so every endpoint client retries the
same way; this module imports none of them, so each loads only the layer and its own code.
``stages.run_stage`` looks ``EndpointError`` up by this module's name (exit 4): it stays here.
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, TypeVar

from ars_opd.config import EndpointConfig

if TYPE_CHECKING:  # the client's own modules are imported where a client is made or used: the error types and
    # settings here are also imported by code that never talks to an endpoint (the OPD stage with its own
    # rollouts), which then runs where only torch and transformers are installed
    import httpx2
    import openai

T = TypeVar("T")
NON_RETRYABLE_STATUS = {400, 401, 403, 404, 413, 422}
AUTH_STATUS = {401, 403}


class EndpointError(RuntimeError):
    """The endpoint is unreachable, rejects the key, serves another model or tokenizer, or fails every
    request. ``summary``: what the run got before it stopped (an ``AskSummary`` of
    ``ars_opd.teacher.client.chat``, set by ``ask_all`` when requests were sent).

    The base class of every error about the endpoint or the key (``ScoringError`` included): its message
    is complete, naming the URL or the params key and what to do, so a stage prints it alone and exits 4
    (``stages.run_stage``) instead of a traceback. Raise it (or a subclass) only with such a message.
    """

    summary: Any = None  # an AskSummary, not imported: the shared layer does not depend on its users


@dataclass(frozen=True)
class ClientSettings:
    """Where to send requests and how: ``limits`` holds the endpoint params (concurrency, timeout, retries)."""

    base_url: str
    api_key: str = "EMPTY"
    limits: EndpointConfig = EndpointConfig()
    max_retry_after_s: float = 60.0
    max_pushbacks: int = 20  # 429s with a retry-after waited out per request without using an attempt
    abort_after: int = 20
    transport: str = "aiohttp"  # "aiohttp" (faster at high concurrency) or "httpx"

    def __repr__(self) -> str:  # never show the key
        return f"ClientSettings(base_url={self.base_url!r}, concurrency={self.limits.concurrency}, ...)"


class MissingAPIKeyError(EndpointError):
    """The variable a params section's ``api_key_env`` names is not set."""


def api_key(env_name: str | None, section: str, error: type[MissingAPIKeyError] = MissingAPIKeyError) -> str:
    """The key in the environment variable ``env_name`` (``<section>.api_key_env``); "EMPTY" when none is
    named (a local server takes any key). Read here and handed to the client only: written nowhere."""
    if env_name is None:
        return "EMPTY"
    key = os.environ.get(env_name)
    if not key:
        raise error(
            f"{section}.api_key_env names {env_name}, but that environment variable is not set (or "
            "empty); export it before running the stage"
        )
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
    import httpx2
    import openai

    n, timeout_s = settings.limits.concurrency, settings.limits.request_timeout_s
    limits = httpx2.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx2.Timeout(timeout_s, connect=min(10.0, timeout_s))
    kind = {"aiohttp": openai.DefaultAioHttpClient, "httpx": openai.DefaultAsyncHttpxClient}[settings.transport]
    http_client = kind(limits=limits, timeout=timeout)
    return openai.AsyncOpenAI(
        base_url=settings.base_url, api_key=settings.api_key, max_retries=0, timeout=timeout, http_client=http_client
    )


async def preflight(
    client: openai.AsyncOpenAI, model: str, timeout_s: float = 15.0, section: str = "teacher_gen"
) -> list[str]:
    """Check the endpoint answers and accepts the key; return the model ids it lists (may be empty).

    ``section``: the params section whose keys the error messages name (``teacher_gen``, ``opd.teacher_endpoint``).
    """
    import openai

    try:
        page = await asyncio.wait_for(client.models.list(), timeout_s)
    except (openai.APIConnectionError, asyncio.TimeoutError, OSError) as e:
        raise EndpointError(
            f"cannot reach the teacher endpoint {client.base_url} ({type(e).__name__}: "
            f"{_short(e)}); start the server there, or set {section}.endpoint to the URL it "
            "listens on"
        ) from None
    except openai.APIStatusError as e:
        if e.status_code in AUTH_STATUS:
            raise EndpointError(
                f"the teacher endpoint {client.base_url} rejected the API key "
                f"(HTTP {e.status_code}); check the variable named by {section}.api_key_env"
            ) from None
        return []  # some compatible servers do not implement /models; the first request will tell
    ids = [m.id for m in page.data]
    if ids and model not in ids:
        raise EndpointError(
            f"model {model!r} is not served at {client.base_url}; it serves {ids[:10]}: set "
            f"{section}.model to the served name"
        )
    return ids


async def post_json(client: openai.AsyncOpenAI, path: str, body: dict) -> dict:
    """POST ``body`` to ``path`` and return the JSON object; errors mapped to ``RetryableError`` / ``FinalError``."""
    # ``client.post`` with ``cast_to=object`` is the SDK's public route for a raw JSON body: it keeps the
    # client's transport and error mapping but skips the typed request transform and the response model,
    # whose CPU cost per request limits throughput at high concurrency (bench/teacher_gen.py measures it).
    import openai

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


async def with_retries(
    call: Callable[[], Awaitable[T]],
    settings: ClientSettings,
    on_retry: Callable[[RetryableError], None] | None = None,
) -> tuple[T, int]:
    """``await call()`` until it succeeds: (result, attempts). The one retry loop of every endpoint client.

    ``RetryableError`` errors are retried with exponential backoff and jitter (honouring a capped retry-after)
    up to ``settings.limits.max_attempts``, then re-raised with ``attempts`` (requests sent) set; a 429 with a
    retry-after uses no attempt, ``settings.max_pushbacks`` times at most. ``FinalError`` is re-raised at once
    with ``attempts`` set. ``on_retry`` is called with the error before each wait.
    """
    attempt = failed = pushbacks = 0
    while True:
        attempt += 1
        try:
            return await call(), attempt
        except FinalError as e:
            e.attempts = attempt
            raise
        except RetryableError as e:
            if e.reason.startswith("http_429") and e.wait_s is not None and pushbacks < settings.max_pushbacks:
                pushbacks += 1
            else:
                failed += 1
            if failed >= settings.limits.max_attempts:
                e.attempts = attempt
                raise
            if on_retry is not None:
                on_retry(e)
            cap = min(settings.limits.backoff_max_s, settings.limits.backoff_base_s * 2 ** max(0, failed - 1))
            wait = cap / 2 + random.uniform(0, cap / 2)
            if e.wait_s is not None:
                wait = max(wait, min(e.wait_s, settings.max_retry_after_s))
            await asyncio.sleep(wait)
