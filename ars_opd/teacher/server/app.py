"""A small OpenAI-compatible chat server for any local Hugging Face causal-LM directory.

``python -m ars_opd.teacher.server MODEL_DIR --port 0 --ready-file ready.json`` loads the model and its
tokenizer, listens on 127.0.0.1, and writes ``{"host", "port", "pid", "model"}`` to the ready file once it
answers. Endpoints: ``GET /v1/models``, ``GET /health``, ``GET /stats`` (batching counters),
``POST /v1/chat/completions``, plain or streamed as Server-Sent Events in OpenAI's chunk format,
``POST /v1/completions`` for scoring only (token-id prompts, ``max_tokens`` 0 or 1, ``echo``,
``prompt_logprobs: k``, answered in exactly vLLM's shape: ``ars_opd.teacher.server.scoring``), and vLLM's
``POST /tokenize``. Each chat request's messages go through the directory's chat template (generation
prompt appended); requests are validated by ``ars_opd.teacher.server.validation`` and batched, chat and scoring
rows alike, by ``ars_opd.teacher.server.engine``.

One client cannot stall the others: a body larger than ``body_limit`` (what the longest prompt that fits
the context can take, JSON-escaped) is answered 413 without being decoded; decoding, validation, chat
template and tokenization run in threads, off the event loop; a prompt with more characters than the
context can hold is refused with 400 before it is tokenized (``ars_opd.teacher.server.engine``).

What it deliberately leaves out: authentication, TLS, tool/function calls, logprobs, ``n`` > 1,
penalties and logit bias, response formats, text generation through ``/v1/completions``, continuous batching
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
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch
from aiohttp import web

from ars_opd.teacher.server.engine import DTYPES, TeacherEngine, Failure, Job
from ars_opd.teacher.server.validation import ChatRequest, RequestError
from ars_opd.teacher.server.scoring import DEFAULT_MAX_LOGPROBS, vllm_prompt_logprobs

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 64 << 20  # the largest body any model gets (aiohttp's default of 1 MiB is too small)
BYTES_PER_CHAR = 12  # a JSON-escaped character outside the BMP ("\\ud83d\\ude00") takes 12 bytes
BODY_OVERHEAD = 1 << 20  # room for the other fields and the JSON syntax


def body_limit(max_prompt_chars: int | None) -> int:
    """Largest request body worth reading: bodies beyond it get 413 before they are decoded.

    A prompt of ``max_prompt_chars`` characters, each JSON-escaped in the longest form, plus overhead;
    capped at ``MAX_REQUEST_BYTES`` (the cap alone when the context length is unknown).
    """
    if max_prompt_chars is None:
        return MAX_REQUEST_BYTES
    return min(MAX_REQUEST_BYTES, BYTES_PER_CHAR * max_prompt_chars + BODY_OVERHEAD)


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
BODY_LIMIT_KEY = web.AppKey("body_limit", int)


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
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"the request body is larger than this server's limit of "
                                    f"{request.app[BODY_LIMIT_KEY]} bytes (derived from the model's context "
                                    "length)", "request_too_large") from None
        # decoding, validation, chat template and tokenization run in threads, off the event loop
        chat, prompt_ids, max_tokens = await engine.prepare_async(body)
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


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"the request body is larger than this server's limit of "
                                f"{request.app[BODY_LIMIT_KEY]} bytes (derived from the model's context "
                                "length)", "request_too_large") from None


async def _completions(request: web.Request) -> web.Response:
    """Scoring: vLLM-shaped ``prompt_logprobs`` for token-id prompts (``ars_opd.teacher.server.scoring``)."""
    engine = request.app[ENGINE_KEY]
    try:
        score = await engine.prepare_score_async(await _read_body(request))
        jobs = engine.submit_scores(score)
    except RequestError as e:
        return e.response()
    try:
        rows = [await job.events.get() for job in jobs]
    finally:
        for job in jobs:
            job.cancelled = True  # no-op when finished; otherwise the batch drops the row
    failed = next((r for r in rows if isinstance(r, Failure)), None)
    if failed is not None:
        return RequestError(failed.status, failed.message).response()
    # formatting k entries per position (and their JSON) is CPU work: off the event loop, as preparing is
    text = await asyncio.get_running_loop().run_in_executor(None, _score_response, engine, score, rows)
    return web.Response(text=text, content_type="application/json")


def _score_response(engine: TeacherEngine, score, rows) -> str:
    """The JSON body of a scoring answer (vLLM's completions response with ``prompt_logprobs``)."""
    tok = engine.tokenizer
    choices = []
    for i, (ids, row) in enumerate(zip(score.prompts, rows)):
        completion = [row.next_token] if score.max_tokens == 1 else []
        text = tok.decode(completion)
        choices.append({"index": i, "text": (tok.decode(ids) + text) if score.echo else text,
                        "logprobs": None, "finish_reason": "length", "stop_reason": None,
                        "prompt_logprobs": vllm_prompt_logprobs(ids, row, engine.decode_token)
                        if score.top_k is not None else None})
    prompt_tokens = sum(len(p) for p in score.prompts)
    return json.dumps({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": engine.model_name, "choices": choices,
        "usage": _usage(prompt_tokens, score.max_tokens * len(score.prompts)),
    })


async def _tokenize(request: web.Request) -> web.Response:
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
        return RequestError(404, f"The model `{body['model']}` does not exist; this server serves "
                                 f"`{engine.model_name}`.", "model_not_found", "model").response()
    special = body.get("add_special_tokens", True)
    tokens = engine.tokenizer(body["prompt"], add_special_tokens=bool(special))["input_ids"]
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": engine.context_length})


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _whole_completion(job: Job, meta: dict) -> web.Response:
    while True:
        event = await job.events.get()
        if isinstance(event, Failure):
            return RequestError(event.status, event.message).response()
        if event.finish_reason is not None:
            break
    return web.json_response({
        **meta, "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": event.text},
                     "logprobs": None, "finish_reason": event.finish_reason}],
        "usage": _usage(len(job.prompt_ids), event.completion_tokens),
    })


async def _stream_completion(request: web.Request, chat: ChatRequest, job: Job, meta: dict) -> web.StreamResponse:
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
            if isinstance(event, Failure):
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
               log_requests: str | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> web.Application:
    """Load the model and tokenizer from ``model_dir`` and build the aiohttp application serving it.

    ``threads`` sets torch's intra-op thread count for this process (None: torch's default).
    ``log_requests``: append one JSON line per accepted chat request (time, messages, max_tokens,
    temperature) to this file. The batcher starts and stops with the application (its cleanup context).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    engine = TeacherEngine(model_dir, model_name, max_batch_size, max_wait_ms, device, dtype, max_logprobs)
    limit = body_limit(engine.max_prompt_chars)
    app = web.Application(client_max_size=limit)
    app[ENGINE_KEY] = engine
    app[BODY_LIMIT_KEY] = limit
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
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/tokenize", _tokenize)
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
               log_requests: str | None = None, max_logprobs: int = DEFAULT_MAX_LOGPROBS) -> None:
    """Load the model, listen on ``host:port`` (0: an ephemeral port), and serve until SIGTERM/SIGINT.

    Once the model is loaded and the socket listens, ``ready_file`` (if given) holds
    ``{"host", "port", "pid", "model"}``. Use a numeric host with port 0: a name that resolves to several
    addresses would get a different ephemeral port on each.
    """
    name = model_name or Path(os.path.normpath(model_dir)).name
    app = create_app(model_dir, name, max_batch_size, max_wait_ms, threads, device, dtype, log_requests, max_logprobs)
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
    parser.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                        help="largest prompt_logprobs k a scoring request may ask (as vLLM's; default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # while the model loads, asyncio's handlers are not installed yet: exit quietly on SIGTERM then too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        run_server(args.model_dir, args.host, args.port, args.ready_file, args.model_name, args.max_batch_size,
                   args.max_wait_ms, args.threads, args.device, args.dtype, args.log_requests, args.max_logprobs)
    except KeyboardInterrupt:  # Ctrl-C before serving started
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
