"""A small OpenAI-compatible chat server for any local Hugging Face causal-LM directory.

``python -m ars_opd.teacher_server MODEL_DIR --port 0 --ready-file ready.json`` loads the model and its
tokenizer, listens on 127.0.0.1, and writes ``{"host", "port", "pid", "model"}`` to the ready file once it
answers. Endpoints: ``GET /v1/models``, ``GET /health``, ``GET /stats`` (batching counters) and
``POST /v1/chat/completions``, plain or streamed as Server-Sent Events in OpenAI's chunk format.

How requests are served: each request's messages go through the directory's chat template (generation
prompt appended). A batcher task takes the first waiting request, waits ``max_wait_ms`` for others, and
runs up to ``max_batch_size`` of them, left-padded, through one ``model.generate`` call in a single worker
thread, so the event loop keeps accepting requests while the next batch gathers. Rows of one batch may
differ in temperature, top_p, max_tokens, seed and stop strings:

* sampling is a logits processor: per-row temperature and nucleus (top_p) filtering plus Gumbel noise
  from a per-row ``torch.Generator`` seeded with the request's ``seed`` (random when absent), with
  ``generate(do_sample=False)`` taking the argmax. argmax(logits / T + Gumbel) is a sample from
  softmax(logits / T), and the noise a row sees depends only on its own seed, so a seeded request gives
  the same text alone or batched (up to float rounding of the logits). Rows with temperature 0 (or
  below 1e-5) get no noise: greedy.
* a stopping criterion called after every decoding step records each row's new token, ends the row at
  EOS, at a stop string or at its ``max_tokens``, and pushes the row's progress to its request, which is
  how streaming sends tokens while they are generated.

The server ignores the model's ``generation_config.json`` sampling defaults: the request's parameters
(OpenAI defaults: temperature 1, top_p 1) decide the decoding alone.

What it deliberately leaves out: authentication, TLS, tool/function calls, logprobs, ``n`` > 1,
penalties and logit bias, response formats, the legacy ``/v1/completions`` endpoint, continuous batching
(a batch runs until its longest row ends; requests that arrive meanwhile form the next batch) and
multi-GPU placement, ``trust_remote_code`` models. Such request fields are refused with 400 rather than
silently ignored. On SIGTERM/SIGINT the server stops at the running batch's next decoding step and answers
requests still in flight with 503, rather than finishing long generations first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import secrets
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from aiohttp import web
from jinja2 import TemplateError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from ars_opd.generation import pad_left
from ars_opd.prompts import encode_prompt

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
# Fields this server does not implement: a request that sets one (to anything truthy) gets a 400, because
# ignoring e.g. logprobs or a penalty would silently return something other than what was asked for.
UNSUPPORTED_FIELDS = ("tools", "functions", "tool_choice", "function_call", "logprobs", "top_logprobs",
                      "logit_bias", "frequency_penalty", "presence_penalty", "response_format")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
MAX_REQUEST_BYTES = 64 << 20  # aiohttp's default of 1 MiB is too small for long prompts
GREEDY_BELOW = 1e-5  # temperatures this small are greedy: dividing logits by them overflows (as in vLLM)


class RequestError(Exception):
    """A client mistake, answered with an OpenAI-style error body and a 4xx status (or 503 when stopping)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)


@dataclass(frozen=True)
class ChatRequest:
    """The validated fields of a chat completion request."""

    messages: list[dict]
    """Messages with string content (text parts already joined)."""
    temperature: float
    top_p: float
    max_tokens: int | None
    """None: up to the end of the model's context."""
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    """Streaming only: send a last chunk with token counts (``stream_options.include_usage``)."""


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a number, got {value!r}", "invalid_type", name)
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(400, f"'{name}' must be in {bounds}, got {value}", "invalid_value", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{name}' must be an integer, got {value!r}", "invalid_type", name)
    if low is not None and value < low:
        raise RequestError(400, f"'{name}' must be >= {low}, got {value}", "invalid_value", name)
    return value


def _message_text(content, index: int) -> str:
    """A message's content as one string; a list of text parts is joined with newlines (as vLLM does)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(400, f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}; "
                                        f"got {part!r} (only text is supported)", "invalid_value", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts, got "
                            f"{type(content).__name__}", "invalid_type", "messages")


def parse_chat_request(body, model_name: str) -> ChatRequest:
    """Validate a decoded ``/v1/chat/completions`` body; raises ``RequestError`` (400, or 404 for the model)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is None:
        raise RequestError(400, "'model' is required", "missing_required_parameter", "model")
    if model != model_name:
        raise RequestError(404, f"The model `{model}` does not exist; this server serves `{model_name}`.",
                           "model_not_found", "model")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'messages' must be a non-empty list of {'role', 'content'} objects",
                           "invalid_value" if "messages" in body else "missing_required_parameter", "messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}] must be an object, got {type(m).__name__}", "invalid_type", "messages")
        if m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                               "invalid_value", "messages")
        messages.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) and not (name == "response_format" and body[name] == {"type": "text"}):
            raise RequestError(400, f"'{name}' is not supported by this server", "unsupported_parameter", name)
    if body.get("n") not in (None, 1):
        raise RequestError(400, f"only n=1 is supported, got n={body['n']!r}", "unsupported_parameter", "n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be a boolean, got {stream!r}", "invalid_type", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", "invalid_type", "stream_options")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "invalid_value", "stop")
    # max_completion_tokens is the newer name of max_tokens; it wins when both are given (as in vLLM)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    return ChatRequest(
        messages=messages,
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=max_tokens,
        seed=_integer(body, "seed"),
        stop=tuple(stop),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
    )


@dataclass
class _Progress:
    """A row's completion so far (already cut at a stop string); ``finish_reason`` set on the last one."""

    text: str
    completion_tokens: int
    finish_reason: str | None


@dataclass
class _Failure:
    status: int
    message: str


@dataclass(eq=False)
class _Job:
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

    def post(self, event: _Progress | _Failure) -> None:
        """Hand an event to the request's handler from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def fail(self, status: int, message: str) -> None:
        self.done = True
        self.post(_Failure(status, message))


class _RowSampler(LogitsProcessor):
    """Per-row temperature, top_p and seeded Gumbel noise; ``generate(do_sample=False)`` then takes the argmax."""

    def __init__(self, jobs: Sequence[_Job], device: torch.device):
        sampled = [i for i, j in enumerate(jobs) if j.temperature >= GREEDY_BELOW]
        self.rows = torch.tensor(sampled, dtype=torch.long, device=device)
        self.temperature = torch.tensor([[jobs[i].temperature] for i in sampled], device=device)  # (R, 1)
        self.top_p = torch.tensor([[jobs[i].top_p] for i in sampled], device=device)  # (R, 1)
        self.use_top_p = any(jobs[i].top_p < 1.0 for i in sampled)
        self.generators = [torch.Generator(device=device).manual_seed(jobs[i].seed) for i in sampled]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.generators:
            return scores
        logits = scores[self.rows].float() / self.temperature  # (R, V)
        if self.use_top_p:
            logits = _nucleus(logits, self.top_p)
        # every row draws V uniforms per step from its own generator, whatever its batch-mates do
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))  # (R, V)
        out = scores.clone()
        out[self.rows] = (logits + gumbel).to(out.dtype)
        return out


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's smallest set whose probability reaches top_p. (R, V), (R, 1)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before a token; the top token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


class _RowProgress(StoppingCriteria):
    """Called by ``generate`` after every decoding step: advances each row and returns which rows are done."""

    def __init__(self, jobs: Sequence[_Job], engine: "TeacherEngine"):
        self.jobs, self.engine = jobs, engine

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()
        for job, token in zip(self.jobs, last):
            if job.done:  # generate pads finished rows; nothing to record
                continue
            if self.engine.stopping:
                job.fail(503, "the server is shutting down")
            elif job.cancelled:
                job.done = True
            else:
                self.engine.advance(job, token)
        return torch.tensor([j.done for j in self.jobs], dtype=torch.bool, device=input_ids.device)


@dataclass
class ServerStats:
    """Counters for batching, readable at ``GET /stats``."""

    completions: int = 0
    """Chat requests accepted for generation."""
    generate_calls: int = 0
    """``model.generate`` calls started (one per batch)."""
    rows_generated: int = 0
    """Sum of batch sizes."""
    largest_batch: int = 0
    generating: bool = False
    """A ``generate`` call is running now."""


class TeacherEngine:
    """The loaded model and tokenizer, the queue of waiting requests, and the batcher that serves them."""

    def __init__(self, model_dir: str, model_name: str, max_batch_size: int = 64, max_wait_ms: float = 5.0,
                 device: str = "cpu", dtype: str = "float32"):
        if max_batch_size < 1 or max_wait_ms < 0:
            raise ValueError(f"need max_batch_size >= 1 and max_wait_ms >= 0, got {max_batch_size}, {max_wait_ms}")
        self.model_name = model_name
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_ms / 1000.0
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template; a chat server needs one")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"neither the tokenizer nor the generation config in {model_dir} names an EOS token")
        self.eos_ids = frozenset(eos)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
        # a fresh config drops the checkpoint's sampling defaults (temperature, top_k, repetition penalty...):
        # the request's parameters, applied by _RowSampler, are the only decoding policy
        self.model.generation_config = GenerationConfig(eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)
        self.context_length = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.stats = ServerStats()
        self.stopping = False
        self._pending: asyncio.Queue[_Job] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._batcher: asyncio.Task | None = None

    # -- event loop side --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._pending = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self._batcher = asyncio.create_task(self._batch_loop(), name="teacher-batcher")

    async def stop(self) -> None:
        """Refuse new requests, end the running batch at its next step with 503, and join the worker thread."""
        self.stopping = True
        while self._pending is not None and not self._pending.empty():
            self._pending.get_nowait().fail(503, "the server is shutting down")
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)

    def encode(self, messages: list[dict]) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, messages)
        except (TemplateError, ValueError, TypeError) as e:  # e.g. a template that requires alternating roles
            raise RequestError(400, f"the chat template rejected the messages: {e}", "invalid_value", "messages") from None

    def resolve_max_tokens(self, max_tokens: int | None, prompt_tokens: int) -> int:
        """The request's max_tokens, or the rest of the context; 400 when prompt and completion do not fit."""
        if self.context_length is None:
            return max_tokens if max_tokens is not None else 2048
        room = self.context_length - prompt_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" plus {max_tokens} completion tokens" if max_tokens is not None else ""
            raise RequestError(400, f"this model's context is {self.context_length} tokens; the request has "
                                    f"{prompt_tokens} prompt tokens{asked}", "context_length_exceeded", "messages")
        return max_tokens if max_tokens is not None else room

    def submit(self, chat: ChatRequest, prompt_ids: list[int], max_tokens: int) -> _Job:
        if self.stopping or self._pending is None:
            raise RequestError(503, "the server is shutting down", "unavailable")
        job = _Job(prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=chat.temperature, top_p=chat.top_p,
                   # any integer is a valid seed; torch generators take 64 bits
                   seed=chat.seed % (1 << 64) if chat.seed is not None else secrets.randbits(63), stop=chat.stop,
                   stream=chat.stream, loop=asyncio.get_running_loop(), events=asyncio.Queue())
        self.stats.completions += 1
        self._pending.put_nowait(job)
        return job

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._pending.get()]
            try:
                if self.max_wait_s > 0 and self._pending.qsize() < self.max_batch_size - 1:
                    await asyncio.sleep(self.max_wait_s)  # give concurrent requests a moment to join
                while len(batch) < self.max_batch_size and not self._pending.empty():
                    batch.append(self._pending.get_nowait())
                batch = [j for j in batch if not j.cancelled]
                if batch:
                    # requests arriving while this runs wait in the queue and form the next batch
                    await loop.run_in_executor(self._executor, self._generate_batch, batch)
            except asyncio.CancelledError:  # stopping: answer the rows taken from the queue but not finished
                for job in batch:
                    if not job.done:
                        job.fail(503, "the server is shutting down")
                raise

    # -- generation thread side -------------------------------------------------------------------------

    def _generate_batch(self, jobs: list[_Job]) -> None:
        stats = self.stats
        stats.generate_calls += 1
        stats.rows_generated += len(jobs)
        stats.largest_batch = max(stats.largest_batch, len(jobs))
        stats.generating = True
        ids, mask = pad_left([j.prompt_ids for j in jobs], self.pad_id)  # (B, T) each
        try:
            with torch.inference_mode():
                # position ids come from the attention mask inside generate, so left padding is invisible
                self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                    max_new_tokens=max(j.max_tokens for j in jobs),
                    logits_processor=LogitsProcessorList([_RowSampler(jobs, self.device)]),
                    stopping_criteria=StoppingCriteriaList([_RowProgress(jobs, self)]),
                )
        except Exception as e:  # a server fault: every waiting request learns it, the server keeps running
            log.exception("generate failed for a batch of %d", len(jobs))
            for job in jobs:
                if not job.done:
                    job.fail(500, f"generation failed: {type(e).__name__}: {e}")
        finally:
            stats.generating = False
        for job in jobs:
            if not job.done:  # cannot happen unless generate stops early on its own
                job.fail(500, "generation ended before this request's completion was finished")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=True)

    def advance(self, job: _Job, token: int) -> None:
        """Record ``token`` for ``job``, decide whether the row is finished, and post its progress."""
        job.completion_ids.append(token)
        n = len(job.completion_ids)
        finish = "stop" if token in self.eos_ids else "length" if n >= job.max_tokens else None
        # decoding every step costs a little; only streams and stop strings need the text before the end
        if finish or job.stream or job.stop:
            text = self.decode(job.completion_ids)
            cut = _first_stop(text, job.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
            if finish or job.stream:
                job.post(_Progress(text, n, finish))
        job.done = finish is not None


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _streamable(text: str, stops: Sequence[str]) -> str:
    """The prefix of an unfinished completion that is safe to send.

    Held back: a trailing replacement character (an incomplete multi-byte character that the next token
    completes) and a tail that could be the start of a stop string, since sent text cannot be taken back.
    """
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, end), hold, -1):
            if text.endswith(s[:k], 0, end):
                hold = k
                break
    return text[:end - hold]


# -- HTTP handlers ------------------------------------------------------------------------------------------

ENGINE_KEY = web.AppKey("engine", TeacherEngine)
REQUEST_LOG_KEY = web.AppKey("request_log", str)


async def _list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "ars-opd"}]})


async def _health(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].stopping:
        return web.json_response({"status": "stopping"}, status=503)
    return web.json_response({"status": "ok"})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[ENGINE_KEY].stats))


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        try:
            body = await request.json()
        except (ValueError, LookupError) as e:  # bad JSON, bad UTF-8, unknown charset
            raise RequestError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
        chat = parse_chat_request(body, engine.model_name)
        prompt_ids = engine.encode(chat.messages)
        max_tokens = engine.resolve_max_tokens(chat.max_tokens, len(prompt_ids))
        job = engine.submit(chat, prompt_ids, max_tokens)
    except RequestError as e:
        return e.response()
    log_path = request.app.get(REQUEST_LOG_KEY)
    if log_path:
        record = {"time": time.time(), "messages": chat.messages, "max_tokens": max_tokens,
                  "temperature": chat.temperature}
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}
    try:
        if chat.stream:
            return await _stream_completion(request, chat, job, meta)
        return await _whole_completion(job, meta)
    finally:
        job.cancelled = True  # no-op when finished; otherwise the batch drops the row at its next step


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _whole_completion(job: _Job, meta: dict) -> web.Response:
    while True:
        event = await job.events.get()
        if isinstance(event, _Failure):
            return RequestError(event.status, event.message).response()
        if event.finish_reason is not None:
            break
    return web.json_response({
        **meta, "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": event.text},
                     "logprobs": None, "finish_reason": event.finish_reason}],
        "usage": _usage(len(job.prompt_ids), event.completion_tokens),
    })


async def _stream_completion(request: web.Request, chat: ChatRequest, job: _Job, meta: dict) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {**meta, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    try:
        await send(chunk({"role": "assistant"}))
        sent = ""
        while True:
            event = await job.events.get()
            if isinstance(event, _Failure):
                await send({"error": {"message": event.message, "type": "server_error", "code": event.status}})
                break
            final = event.finish_reason is not None
            visible = event.text if final else _streamable(event.text, chat.stop)
            # decoding a longer token prefix extends the text (held-back tails aside), so the diff is a suffix
            if len(visible) > len(sent) and visible.startswith(sent):
                await send(chunk({"content": visible[len(sent):]}))
                sent = visible
            if final:
                await send(chunk({}, event.finish_reason))
                if chat.include_usage:
                    await send({**meta, "object": "chat.completion.chunk", "choices": [],
                                "usage": _usage(len(job.prompt_ids), event.completion_tokens)})
                break
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; the finally in the caller drops its row
        pass
    return response


# -- application and process ---------------------------------------------------------------------------------

def create_app(model_dir: str, model_name: str, max_batch_size: int = 64, max_wait_ms: float = 5.0,
               threads: int | None = None, device: str = "cpu", dtype: str = "float32",
               log_requests: str | None = None) -> web.Application:
    """Load the model and tokenizer from ``model_dir`` and build the aiohttp application serving it.

    ``threads`` sets torch's intra-op thread count for this process (None: torch's default).
    ``log_requests``: append one JSON line per accepted chat request (time, messages, max_tokens,
    temperature) to this file. The batcher starts and stops with the application (its cleanup context).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    engine = TeacherEngine(model_dir, model_name, max_batch_size, max_wait_ms, device, dtype)
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[ENGINE_KEY] = engine
    if log_requests:
        app[REQUEST_LOG_KEY] = log_requests

    async def batcher(_app: web.Application):
        await engine.start()
        yield
        await engine.stop()

    async def refuse_new_work(_app: web.Application) -> None:
        # on_shutdown runs before aiohttp waits for open requests: end them now rather than after a batch
        await engine.stop()

    app.cleanup_ctx.append(batcher)
    app.on_shutdown.append(refuse_new_work)
    app.router.add_get("/v1/models", _list_models)
    app.router.add_get("/health", _health)
    app.router.add_get("/stats", _stats)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    return app


def _write_ready_file(path: str, info: dict) -> None:
    """Write JSON atomically, so a watcher never reads a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


async def serve(app: web.Application, host: str = "127.0.0.1", port: int = 0, ready_file: str | None = None) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, then shut down gracefully; the ready file lives while serving."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    wrote_ready_file = False
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]  # the real port when port=0
        model_name = app[ENGINE_KEY].model_name
        if ready_file:
            _write_ready_file(ready_file, {"host": host, "port": bound_port, "pid": os.getpid(), "model": model_name})
            wrote_ready_file = True
        log.info("serving %s on http://%s:%d/v1", model_name, host, bound_port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
    finally:
        if wrote_ready_file:
            Path(ready_file).unlink(missing_ok=True)  # a stale file would point the next reader at a dead port
        await runner.cleanup()


def run_server(model_dir: str, host: str = "127.0.0.1", port: int = 0, ready_file: str | None = None,
               model_name: str | None = None, max_batch_size: int = 64, max_wait_ms: float = 5.0,
               threads: int | None = None, device: str = "cpu", dtype: str = "float32",
               log_requests: str | None = None) -> None:
    """Load the model, listen on ``host:port`` (0: an ephemeral port), and serve until SIGTERM/SIGINT.

    Once the model is loaded and the socket listens, ``ready_file`` (if given) holds
    ``{"host", "port", "pid", "model"}``. Use a numeric host with port 0: a name that resolves to several
    addresses would get a different ephemeral port on each.
    """
    name = model_name or Path(os.path.normpath(model_dir)).name
    app = create_app(model_dir, name, max_batch_size, max_wait_ms, threads, device, dtype, log_requests)
    asyncio.run(serve(app, host, port, ready_file))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ars-opd serve", description="Serve a local Hugging Face causal LM with an OpenAI-compatible chat API.")
    parser.add_argument("model_dir", help="directory with config.json, weights and a tokenizer with a chat template")
    parser.add_argument("--model-name", help="model id clients must send (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    parser.add_argument("--ready-file", help="write {host, port, pid, model} as JSON here once serving")
    parser.add_argument("--max-batch-size", type=int, default=64, help="most requests per generate call")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="torch device for the model (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights dtype (default: %(default)s)")
    parser.add_argument("--log-requests", metavar="PATH", help="append one JSON line per chat request to PATH")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # while the model loads, asyncio's handlers are not installed yet: exit quietly on SIGTERM then too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        run_server(args.model_dir, args.host, args.port, args.ready_file, args.model_name, args.max_batch_size,
                   args.max_wait_ms, args.threads, args.device, args.dtype, args.log_requests)
    except KeyboardInterrupt:  # Ctrl-C before serving started
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
