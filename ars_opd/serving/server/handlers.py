"""The bundled server's HTTP handlers: one coroutine per route, reading requests and writing answers.

Each POST handler reads its body (413 past the app's ``BODY_LIMIT_KEY``), has the engine's ``requests``
(``ars_opd.serving.server.preparation``) prepare it in threads, submits its rows to the engine
(``ars_opd.serving.server.engine``) and turns the events that answer them (``ars_opd.serving.server.jobs``)
into OpenAI's or vLLM's wire format: a whole ``chat.completion``, a stream of Server-Sent Events chunks, a
scoring answer, errors as ``RequestError`` bodies. The rule the chat and scoring handlers keep: work
proportional to a request's size runs off the event loop (decoding and tokenizing in the preparation threads,
formatting a scoring answer in an executor), so one client cannot stall the others; ``/tokenize`` still
decodes and tokenizes on the loop. The app (``ars_opd.serving.server.app``) registers the handlers and fills
the keys they read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import asdict
from typing import Sequence

from aiohttp import web

from ars_opd.serving.server.engine import TeacherEngine
from ars_opd.serving.server.generation import GenerateRequest
from ars_opd.serving.server.jobs import Failure, Job, ScoreJob
from ars_opd.serving.server.scoring import vllm_prompt_logprobs
from ars_opd.serving.server.validation import ChatRequest, RequestError


def streamable_prefix(text: str, stops: Sequence[str]) -> str:
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
    return text[: end - hold]


ENGINE_KEY = web.AppKey("engine", TeacherEngine)
REQUEST_LOG_KEY = web.AppKey("request_log", str)
BODY_LIMIT_KEY = web.AppKey("body_limit", int)


async def list_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(
        {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0, "owned_by": "ars-opd"}]}
    )


async def health(request: web.Request) -> web.Response:
    if request.app[ENGINE_KEY].stopping:
        return web.json_response({"status": "stopping"}, status=503)
    return web.json_response({"status": "ok"})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[ENGINE_KEY].stats))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        body = await _read_body(request)
        # decoding, validation, chat template and tokenization run in threads, off the event loop
        chat, prompt_ids, max_tokens = await engine.requests.prepare_async(body)
        job = engine.submit(chat, prompt_ids, max_tokens)
    except RequestError as e:
        return e.response()
    log_path = request.app.get(REQUEST_LOG_KEY)
    if log_path:
        record = {
            "time": time.time(),
            "messages": chat.messages,
            "max_tokens": max_tokens,
            "temperature": chat.temperature,
        }
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.model_name}
    with _awaiting(engine, [job]):
        if chat.stream:
            return await _stream_completion(request, chat, job, meta)
        return await _whole_completion(job, meta)


@contextlib.contextmanager
def _awaiting(engine: TeacherEngine, jobs: Sequence[Job | ScoreJob]):
    """Around a handler's wait for its rows. When the client goes (a timeout, a dropped connection) aiohttp
    cancels the handler (``app.app_runner``): that is counted. On the way out, however it ends, the rows are
    marked cancelled: a no-op for finished rows; a queued row is then dropped before it is generated, a running
    one stopped at its batch's next decoding step."""
    try:
        yield
    except asyncio.CancelledError:
        engine.stats.clients_gone += 1
        raise
    finally:
        for job in jobs:
            job.cancelled = True


async def _read_body(request: web.Request) -> bytes:
    """The request's body; a ``RequestError`` 413 when it is over the application's limit."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(
            413,
            f"the request body is larger than this server's limit of "
            f"{request.app[BODY_LIMIT_KEY]} bytes (derived from the model's context "
            "length)",
            "request_too_large",
        ) from None


async def completions(request: web.Request) -> web.Response:
    """Scoring (with ``prompt_logprobs``): vLLM-shaped ``prompt_logprobs`` for token-id prompts
    (``ars_opd.serving.server.scoring``); generation (without): one token-id prompt's completion
    (``ars_opd.serving.server.generation``)."""
    engine = request.app[ENGINE_KEY]
    try:
        score = await engine.requests.prepare_completion_async(await _read_body(request))
        if isinstance(score, GenerateRequest):
            return await _generation(engine, score)
        jobs = engine.submit_scores(score)
    except RequestError as e:
        return e.response()
    with _awaiting(engine, jobs):
        rows = [await job.events.get() for job in jobs]
    failed = next((r for r in rows if isinstance(r, Failure)), None)
    if failed is not None:
        return RequestError(failed.status, failed.message).response()
    # formatting k entries per position (and their JSON) is CPU work: off the event loop, as preparing is
    text = await asyncio.get_running_loop().run_in_executor(None, _score_response, engine, score, rows)
    return web.Response(text=text, content_type="application/json")


async def _generation(engine: TeacherEngine, gen: GenerateRequest) -> web.Response:
    """Generate one completion and answer in vLLM's completions shape (``token_ids`` when asked, the sampled
    tokens' raw ``logprobs.token_logprobs`` when ``logprobs`` is 0)."""
    job = engine.submit_generation(gen)
    with _awaiting(engine, [job]):
        event = await _last_event(job)
    if isinstance(event, Failure):
        return RequestError(event.status, event.message).response()
    ids = list(job.completion_ids)
    tok = engine.tokenizer
    logprobs = None
    if job.logprobs is not None:
        logprobs = {
            "tokens": [engine.decode_token(t) for t in ids],
            "token_logprobs": list(job.logprobs),
            "top_logprobs": None,
            "text_offset": None,
        }
    choice = {
        "index": 0,
        "text": tok.decode(ids, skip_special_tokens=gen.skip_special_tokens),
        "logprobs": logprobs,
        "finish_reason": event.finish_reason,
        # vLLM's: the stop_token_ids entry that ended it (None for the model's EOS or a length cut)
        "stop_reason": ids[-1] if ids and ids[-1] in gen.stop_ids and ids[-1] not in engine.eos_ids else None,
    }
    if gen.return_token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = list(gen.prompt_ids), ids
    return web.json_response(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": [choice],
            "usage": _usage(len(gen.prompt_ids), len(ids)),
        }
    )


RPC_METHODS = ("ars_opd_load_weights", "ars_opd_fingerprint")


async def collective_rpc(request: web.Request) -> web.Response:
    """vLLM's dev route ``POST /collective_rpc`` for this server's two methods: ``{"method":
    "ars_opd_load_weights", "kwargs": {"path"}}`` -> ``{"results": [{"loaded", "seconds", "vocab",
    "prefix_cache": false}]}`` (one worker; ``vocab``: the ids its log-probabilities are normalised over, the
    tokenizer's; no prefix cache for the trainer to reset), and ``{"method":
    "ars_opd_fingerprint"}`` -> ``{"results": [{"tensors": {name: {"sha256", ...}}, "vocab", "seconds"}]}``
    (``ars_opd.serving.server.weights.state_fingerprint``). Only with ``ServerOptions.weight_updates``
    (``--weight-updates``); else 404."""
    engine = request.app[ENGINE_KEY]
    if not engine.options.weight_updates:
        return RequestError(
            404,
            "weight updates are off on this server: start it with --weight-updates (ServerOptions.weight_updates)"
            " to serve /collective_rpc",
            "not_found",
        ).response()
    try:
        try:
            body = json.loads(await _read_body(request))
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
        if not isinstance(body, dict) or body.get("method") not in RPC_METHODS:
            method = body.get("method") if isinstance(body, dict) else None
            raise RequestError(
                400,
                f"unknown method {method!r}: this server serves {', '.join(RPC_METHODS)}",
                "invalid_value",
                "method",
            )
        kwargs = body.get("kwargs") or {}
        if body["method"] == "ars_opd_fingerprint":
            if kwargs:
                raise RequestError(400, "ars_opd_fingerprint takes no 'kwargs'", "invalid_value", "kwargs")
            return web.json_response({"results": [await engine.fingerprint()]})
        if not isinstance(kwargs, dict) or set(kwargs) != {"path"}:
            raise RequestError(400, "'kwargs' must be {\"path\": <safetensors file>}", "invalid_value", "kwargs")
        result = await engine.load_weights(kwargs["path"])
    except RequestError as e:
        return e.response()
    return web.json_response({"results": [result]})


def _score_response(engine: TeacherEngine, score, rows) -> str:
    """The JSON body of a scoring answer (vLLM's completions response with ``prompt_logprobs``)."""
    tok = engine.tokenizer
    choices = []
    for i, (ids, row) in enumerate(zip(score.prompts, rows)):
        completion = [row.next_token] if score.max_tokens == 1 else []
        text = tok.decode(completion)
        choices.append(
            {
                "index": i,
                "text": (tok.decode(ids) + text) if score.echo else text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": vllm_prompt_logprobs(ids, row, engine.decode_token)
                if score.top_k is not None
                else None,
            }
        )
    prompt_tokens = sum(len(p) for p in score.prompts)
    return json.dumps(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": engine.model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, score.max_tokens * len(score.prompts)),
        }
    )


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``: {"model", "prompt", "add_special_tokens"} -> {"tokens", "count", "max_model_len"}."""
    engine = request.app[ENGINE_KEY]
    try:
        body = json.loads(await _read_body(request))
    except RequestError as e:
        return e.response()
    except (ValueError, UnicodeDecodeError) as e:
        return RequestError(400, f"the request body is not valid JSON: {e}", "invalid_json").response()
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        return RequestError(400, "'prompt' must be a string", "invalid_value", "prompt").response()
    if body.get("model") not in (None, engine.model_name):
        return RequestError(
            404,
            f"The model `{body['model']}` does not exist; this server serves `{engine.model_name}`.",
            "model_not_found",
            "model",
        ).response()
    special = body.get("add_special_tokens", True)
    tokens = engine.tokenizer(body["prompt"], add_special_tokens=bool(special))["input_ids"]
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": engine.context_length})


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _last_event(job: Job):
    """A generation's final event (the one with its ``finish_reason``), or the ``Failure`` that ended it: the
    events before it (the streaming deltas) are passed over."""
    while True:
        event = await job.events.get()
        if isinstance(event, Failure) or event.finish_reason is not None:
            return event


async def _whole_completion(job: Job, meta: dict) -> web.Response:
    event = await _last_event(job)
    if isinstance(event, Failure):
        return RequestError(event.status, event.message).response()
    return web.json_response(
        {
            **meta,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": event.text},
                    "logprobs": None,
                    "finish_reason": event.finish_reason,
                }
            ],
            "usage": _usage(len(job.prompt_ids), event.completion_tokens),
        }
    )


async def _stream_completion(request: web.Request, chat: ChatRequest, job: Job, meta: dict) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {
            **meta,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
        }

    try:
        await send(chunk({"role": "assistant"}))
        sent = ""
        while True:
            event = await job.events.get()
            if isinstance(event, Failure):
                await send({"error": {"message": event.message, "type": "server_error", "code": event.status}})
                break
            final = event.finish_reason is not None
            visible = event.text if final else streamable_prefix(event.text, chat.stop)
            # decoding a longer token prefix extends the text (held-back tails aside), so the diff is a suffix
            if len(visible) > len(sent) and visible.startswith(sent):
                await send(chunk({"content": visible[len(sent) :]}))
                sent = visible
            if final:
                await send(chunk({}, event.finish_reason))
                if chat.include_usage:
                    await send(
                        {
                            **meta,
                            "object": "chat.completion.chunk",
                            "choices": [],
                            "usage": _usage(len(job.prompt_ids), event.completion_tokens),
                        }
                    )
                break
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; the finally in the caller drops its row
        pass
    return response
