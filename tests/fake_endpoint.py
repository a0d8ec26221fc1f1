"""A scriptable OpenAI-compatible endpoint for tests and benchmarks: fixed latency, injected faults.

It answers ``POST /v1/chat/completions`` with a deterministic text derived from the prompt (so a test
can check every answer) after ``latency_s``, and ``GET /v1/models``. With ``fault_rate`` > 0 a
deterministic share of prompts (chosen by a hash of the prompt) misbehaves on its first attempt, each
with one of: 429 with ``Retry-After``, 500, a hang past any sane timeout, a malformed JSON body, an
empty ``choices`` list, or a dropped connection. ``always_fail_400`` / ``always_fail_500`` make shares of
prompts fail on every attempt, and ``always_empty`` answers a share with no text; ``pushback_first`` answers
the first N requests 429, as a full server pushes back. Every request is logged (prompt, attempt, outcome,
time, requests in flight) in memory and, optionally, to a JSON Lines file, so tests can
count re-requests.

It runs in a background thread of the caller (``FakeEndpoint(...).start()``) or as its own process
(``python tests/fake_endpoint.py --port 0 --ready-file F --latency 1.0``) for benchmarks, where the
client's and server's CPU must not share one interpreter. Loopback only. Not a model: nothing here
generates text.

``FaultyProxy`` injects faults in front of a real server; ``FakeScorer`` answers OPD scoring requests in
vLLM's field names (``/v1/completions`` with ``prompt_logprobs``, ``/tokenize`` at the root), returning
log-probabilities or, as a server with ``--logprobs-mode raw_logits`` does, logits.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

FAULTS = ("429", "500", "hang", "malformed_json", "empty_choices", "drop_connection")


def expected_answer(prompt: str) -> str:
    """The text the fake endpoint answers for ``prompt`` (the last user message)."""
    return "answer-" + hashlib.sha256(prompt.encode()).hexdigest()[:12]


def _bucket(prompt: str, salt: str) -> float:
    return int(hashlib.sha256(f"{salt}:{prompt}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


@dataclass
class FakeEndpoint:
    model: str = "fake-teacher"
    latency_s: float = 0.0
    fault_rate: float = 0.0
    always_fail_400: float = 0.0
    always_fail_500: float = 0.0
    always_empty: float = 0.0
    retry_after_s: float = 0.2
    hang_s: float = 30.0
    log_path: str | None = None
    api_key: str | None = None  # if set, requests without "Authorization: Bearer <api_key>" get 401
    pushback_first: int = 0  # the first N chat requests get 429 with Retry-After (a server full at the start)
    host: str = "127.0.0.1"
    port: int = 0
    log: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self._attempts: dict[str, int] = {}
        self._served = 0
        self._in_flight = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._log_file = open(self.log_path, "a") if self.log_path else None

    # -- behaviour -------------------------------------------------------------------------------
    def fault_for(self, prompt: str, attempt: int) -> str | None:
        if _bucket(prompt, "400") < self.always_fail_400:
            return "400"
        if _bucket(prompt, "500") < self.always_fail_500:
            return "500"
        if attempt == 1 and _bucket(prompt, "fault") < self.fault_rate:
            return FAULTS[int(_bucket(prompt, "kind") * len(FAULTS)) % len(FAULTS)]
        return None

    def _record(self, prompt: str, attempt: int, outcome: str, body: dict) -> None:
        entry = {
            "prompt": prompt,
            "attempt": attempt,
            "outcome": outcome,
            "time": time.time(),
            "messages": body.get("messages"),
            "in_flight": self._in_flight,  # chat requests being answered, this one included
        }
        with self._lock:
            self.log.append(entry)
            if self._log_file:
                self._log_file.write(json.dumps(entry) + "\n")
                self._log_file.flush()

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "invalid api key", "type": "auth"}}, status=401)
        return None

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self._in_flight += 1
        try:
            return await self._answer(request)
        finally:
            self._in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        body = await request.json()
        messages = body.get("messages") or []
        prompt = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
        with self._lock:
            attempt = self._attempts.get(prompt, 0) + 1
            self._attempts[prompt] = attempt
        fault = self.fault_for(prompt, attempt)
        self._served += 1
        if self._served <= self.pushback_first:
            fault = "429"
        self._record(prompt, attempt, fault or "ok", body)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if fault == "400":
            return web.json_response(
                {"error": {"message": "bad request (injected)", "type": "invalid_request_error"}}, status=400
            )
        if fault == "429":
            return web.json_response(
                {"error": {"message": "slow down (injected)", "type": "rate_limit"}},
                status=429,
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if fault == "500":
            return web.json_response({"error": {"message": "boom (injected)", "type": "server_error"}}, status=500)
        if fault == "hang":
            await asyncio.sleep(self.hang_s)
        if fault == "malformed_json":
            return web.Response(text='{"id": "x", "choices": [', content_type="application/json")
        if fault == "drop_connection":
            request.transport.close()
            return web.Response()
        content = "" if _bucket(prompt, "empty") < self.always_empty else expected_answer(prompt)
        choices = (
            []
            if fault == "empty_choices"
            else [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": content},
                }
            ]
        )
        return web.json_response(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "fake"}]}
        )

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        return app

    # -- running ---------------------------------------------------------------------------------
    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=4096)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def start(self) -> str:
        """Serve from a background thread; return the base URL."""
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("fake endpoint did not start")
        return self.base_url

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            await self._runner.cleanup()
            # handlers still sleeping (injected hangs) would be destroyed pending: cancel them cleanly
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if self._log_file:
            self._log_file.close()

    def __enter__(self) -> "FakeEndpoint":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Fake OpenAI-compatible endpoint (fixed latency, injected faults)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.0)
    p.add_argument("--fault-rate", type=float, default=0.0)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--log", default=None)
    a = p.parse_args(argv)
    ep = FakeEndpoint(latency_s=a.latency, fault_rate=a.fault_rate, port=a.port, log_path=a.log)

    async def serve() -> None:
        await ep._start()
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"host": ep.host, "port": ep.port, "pid": os.getpid()}, f)
        os.replace(tmp, a.ready_file)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await ep._runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()


PROXY_FAULTS = ("429", "500", "503", "hang")


@dataclass
class FaultyProxy(FakeEndpoint):
    """A pass-through to a real server (``upstream``, its root URL) that injects faults on first attempts.

    A deterministic share ``fault_rate`` of distinct POST bodies fails on its first attempt with one of
    ``PROXY_FAULTS`` (429 with Retry-After, 500, 503, or a hang past the client's timeout); every other
    request, and every retry, is forwarded unchanged, so a client that retries correctly gets exactly the
    upstream's answers. GETs always pass. ``log`` records (path, attempt, outcome).
    """

    upstream: str = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        return app

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        import aiohttp

        body = await request.read()
        fault = None
        if request.method == "POST":
            key = request.path + hashlib.sha256(body).hexdigest()
            with self._lock:
                attempt = self._attempts.get(key, 0) + 1
                self._attempts[key] = attempt
            if attempt == 1 and _bucket(key, "fault") < self.fault_rate:
                fault = PROXY_FAULTS[int(_bucket(key, "kind") * len(PROXY_FAULTS)) % len(PROXY_FAULTS)]
            with self._lock:
                self.log.append({"path": request.path, "attempt": attempt, "outcome": fault or "ok"})
        if fault in ("429", "500", "503"):
            headers = {"Retry-After": str(self.retry_after_s)} if fault == "429" else None
            return web.json_response(
                {"error": {"message": f"injected {fault}", "type": "server_error"}}, status=int(fault), headers=headers
            )
        if fault == "hang":
            await asyncio.sleep(self.hang_s)
        async with aiohttp.ClientSession() as s:
            async with s.request(
                request.method,
                self.upstream + request.path_qs,
                data=body or None,
                headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
            ) as r:
                return web.Response(body=await r.read(), status=r.status, content_type=r.content_type)


def byte_ids(text: str) -> list[int]:
    """``FakeScorer``'s tokenizer: one id per UTF-8 byte (ids 0..255), no special tokens."""
    return list(text.encode())


class ByteTokenizer:
    """``byte_ids`` called the way the scoring client calls a Hugging Face tokenizer."""

    eos_token = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": byte_ids(text)}


@dataclass
class FakeScorer(FakeEndpoint):
    """vLLM's scoring surface without a model, in vLLM's field names, for the OPD scoring client.

    ``POST /v1/completions`` ``{"model", "prompt": [ids], "max_tokens", "temperature", "prompt_logprobs": k}``
    answers ``choices[0].prompt_logprobs``: a list whose first item is null, then per position a dict keyed by
    token id (a string in JSON) of ``{"logprob", "rank", "decoded_token"}`` holding the top-k and the actual
    token (first, with its own rank; k + 1 entries when it is outside the top-k). ``POST /tokenize`` is served
    at the server root only, as vLLM serves it: ``{"model", "prompt", "add_special_tokens"}`` ->
    ``{"count", "max_model_len", "tokens"}`` (``byte_ids``). ``GET /v1/models`` lists the model.

    The logits at position i are a fixed function of token i - 1, i and the id, in (-0.5, 0]; like vLLM's
    ``--logprobs-mode``, ``logprobs_mode`` "raw_logprobs" returns their log-softmax and "raw_logits" the
    logits themselves (all negative, so a check of the sign alone passes them). ``requests`` records
    (path, body) of every POST.
    """

    logprobs_mode: str = "raw_logprobs"
    max_model_len: int = 4096
    vocab: int = 256
    requests: list = field(default_factory=list)

    def logits(self, prev: int, position: int) -> list[float]:
        return [-((v * 40503 + prev * 977 + position * 131) % 1024) / 2048 for v in range(self.vocab)]

    def values(self, prev: int, position: int) -> list[float]:
        """What position ``position`` (after token ``prev``) returns: log-probs or logits, per ``logprobs_mode``."""
        z = self.logits(prev, position)
        if self.logprobs_mode == "raw_logits":
            return z
        m = max(z)
        lse = m + math.log(sum(math.exp(x - m) for x in z))
        return [x - lse for x in z]

    def _position(self, ids: list[int], i: int, k: int) -> dict:
        z, out = self.logits(ids[i - 1], i), self.values(ids[i - 1], i)
        order = sorted(range(self.vocab), key=lambda v: (-z[v], v))
        actual = ids[i]
        entry = {
            str(actual): {
                "logprob": out[actual],
                "rank": 1 + sum(x > z[actual] for x in z),
                "decoded_token": chr(actual),
            }
        }
        for j, v in enumerate(order[:k]):
            if v != actual:
                entry[str(v)] = {"logprob": out[v], "rank": j + 1, "decoded_token": chr(v)}
        return entry

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        return web.json_response(
            {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status},
            status=status,
        )

    async def _completions(self, request: web.Request) -> web.Response:
        if (denied := self._unauthorized(request)) is not None:
            return denied
        body = await request.json()
        with self._lock:
            self.requests.append((request.path, body))
        if body.get("model") != self.model:
            return self._error(404, f"The model `{body.get('model')}` does not exist.")
        ids, k = body.get("prompt"), body.get("prompt_logprobs")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < self.vocab for t in ids):
            return self._error(400, "this fake scores token-id prompts only")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            return self._error(400, "prompt_logprobs must be an integer >= 0")
        prompt_logprobs = [None] + [self._position(ids, i, k) for i in range(1, len(ids))]
        last = self.logits(ids[-1], len(ids))
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": chr(max(range(self.vocab), key=lambda v: (last[v], -v))),
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": prompt_logprobs,
                    }
                ],
                "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1, "completion_tokens": 1},
            }
        )

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        with self._lock:
            self.requests.append((request.path, body))
        if body.get("model") != self.model:
            return self._error(404, f"The model `{body.get('model')}` does not exist.")
        tokens = byte_ids(body["prompt"])
        return web.json_response({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)  # at the root, as vLLM serves it: not /v1/tokenize
        return app
