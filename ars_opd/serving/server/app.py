"""A small OpenAI-compatible chat server for any local Hugging Face causal-LM directory.

``python -m ars_opd.serving.server MODEL_DIR --port 0 --ready-file ready.json`` loads the model and its
tokenizer, listens on 127.0.0.1, and writes ``{"host", "port", "pid", "model"}`` to the ready file once it
answers. Endpoints: ``GET /v1/models``, ``GET /health``, ``GET /stats`` (batching counters),
``POST /v1/chat/completions``, plain or streamed as Server-Sent Events in OpenAI's chunk format,
``POST /v1/completions`` for scoring (token-id prompts with ``prompt_logprobs: k``, ``max_tokens`` 0 or 1,
``echo``, answered in exactly vLLM's shape: ``ars_opd.serving.server.scoring``) and, without
``prompt_logprobs``, for generating from one token-id prompt (a rollout engine's request:
``ars_opd.serving.server.generation``), vLLM's ``POST /tokenize``, and, with ``--weight-updates``, vLLM's
``POST /collective_rpc`` for two methods, ``ars_opd_load_weights`` (load a published safetensors file between
batches: ``ars_opd.serving.server.weights``; ``--ignore-weight-updates`` is a fault injection for tests) and
``ars_opd_fingerprint`` (the sha256 of every loaded tensor, for the trainer's version check).
Each chat request's messages go through the directory's chat template (generation
prompt appended); requests are answered by the route handlers of ``ars_opd.serving.server.handlers``,
prepared by ``ars_opd.serving.server.preparation`` (validated by ``ars_opd.serving.server.validation``) and
batched, chat and scoring rows alike, by ``ars_opd.serving.server.engine``. This module builds the
application (routes, body limit, the batcher's lifetime) and runs the process: ``serve``, ``run_server`` and
the command line, ``main``.

One client cannot stall the others: a body larger than ``body_limit`` (what the longest prompt that fits
the context can take, JSON-escaped) is answered 413 without being decoded; decoding, validation, chat
template and tokenization run in threads, off the event loop; a prompt with more characters than the
context can hold is refused with 400 before it is tokenized (``ars_opd.serving.server.preparation``). Nor is
work done for clients that have gone: a client that times out or drops its connection cancels its handler
(``app_runner``), and its row is dropped if still queued or stopped at its batch's next decoding step.

What it deliberately leaves out: authentication, TLS, tool/function calls, logprobs, ``n`` > 1,
penalties and logit bias, response formats, text prompts on ``/v1/completions``, top-k, continuous batching
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
from pathlib import Path
from typing import Sequence

import torch
from aiohttp import web

from ars_opd.serving.server import handlers
from ars_opd.serving.server.engine import DTYPES, TeacherEngine
from ars_opd.serving.server.handlers import BODY_LIMIT_KEY, ENGINE_KEY, REQUEST_LOG_KEY
from ars_opd.serving.server.options import ServerOptions

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


# -- application and process ---------------------------------------------------------------------------------


def create_app(model_dir: str, options: ServerOptions = ServerOptions()) -> web.Application:
    """Load the model and tokenizer from ``model_dir`` and build the aiohttp application serving it.

    ``options.threads`` sets torch's intra-op thread count for this process (None: torch's default).
    ``options.log_requests``: append one JSON line per accepted chat request (time, messages, max_tokens,
    temperature) to this file. The batcher starts and stops with the application (its cleanup context).
    """
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    engine = TeacherEngine(model_dir, options)
    limit = body_limit(engine.requests.max_prompt_chars)
    app = web.Application(client_max_size=limit)
    app[ENGINE_KEY] = engine
    app[BODY_LIMIT_KEY] = limit
    if options.log_requests:
        app[REQUEST_LOG_KEY] = options.log_requests

    async def batcher(_app: web.Application):
        await engine.start()
        yield
        await engine.stop()

    async def refuse_new_work(_app: web.Application) -> None:
        # on_shutdown runs before aiohttp waits for open requests: end them now rather than after a batch
        await engine.stop()

    app.cleanup_ctx.append(batcher)
    app.on_shutdown.append(refuse_new_work)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/stats", handlers.stats)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_post("/collective_rpc", handlers.collective_rpc)
    return app


def app_runner(app: web.Application, **kwargs) -> web.AppRunner:
    """The runner every server of this app is served by (``serve``, and the tests' in-process servers).

    ``handler_cancellation``: a handler whose client has gone (a timeout, a dropped connection) is cancelled,
    so its ``finally`` marks its row cancelled and the engine drops it before generating it (or stops it at the
    next decoding step). aiohttp leaves it off by default, and then a request whose client timed out would be
    generated for nobody while its retry waits behind it.
    """
    return web.AppRunner(app, handler_cancellation=True, **kwargs)


def _write_ready_file(path: str, info: dict) -> None:
    """Write JSON atomically, so a watcher never reads a half-written file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, target)


PARENT_POLL_S = 1.0  # how often a server started with a parent PID checks that the parent still runs


def parent_alive(pid: int, was_child: bool) -> bool:
    """Whether process ``pid`` still runs. A server started as its child asks for its own parent (a dead parent's
    children are re-parented, and a reused PID cannot fool it); otherwise it probes the PID."""
    if was_child:
        return os.getppid() == pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    was_child = os.getppid() == pid
    while not stop.is_set():
        if not parent_alive(pid, was_child):
            log.warning("the parent process %d is gone: shutting down", pid)
            stop.set()
            return
        await asyncio.sleep(PARENT_POLL_S)


async def serve(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    ready_file: str | None = None,
    parent_pid: int | None = None,
) -> None:
    """Serve ``app`` until SIGTERM or SIGINT (or until process ``parent_pid`` is gone), then shut down gracefully;
    the ready file lives while serving."""
    runner = app_runner(app, handle_signals=False, access_log=None)
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
        watcher = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid is not None else None
        await stop.wait()
        if watcher is not None:
            watcher.cancel()
        log.info("shutting down")
    finally:
        if wrote_ready_file:
            Path(ready_file).unlink(missing_ok=True)  # a stale file would point the next reader at a dead port
        await runner.cleanup()


def run_server(
    model_dir: str, options: ServerOptions = ServerOptions(), host: str = "127.0.0.1", port: int = 0, ready_file=None
) -> None:
    """Load the model, listen on ``host:port`` (0: an ephemeral port), and serve until SIGTERM/SIGINT.

    Once the model is loaded and the socket listens, ``ready_file`` (if given) holds
    ``{"host", "port", "pid", "model"}``. Use a numeric host with port 0: a name that resolves to several
    addresses would get a different ephemeral port on each.
    """
    asyncio.run(serve(create_app(model_dir, options), host, port, ready_file, options.parent_pid))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ars-opd serve", description="Serve a local Hugging Face causal LM with an OpenAI-compatible chat API."
    )
    parser.add_argument("model_dir", help="directory with config.json, weights and a tokenizer with a chat template")
    parser.add_argument("--model-name", help="model id clients must send (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    parser.add_argument("--ready-file", help="write {host, port, pid, model} as JSON here once serving")
    defaults = ServerOptions()  # the batching defaults are TeacherServerConfig's: one source
    parser.add_argument(
        "--max-batch-size", type=int, default=defaults.max_batch_size, help="most requests per generate call"
    )
    parser.add_argument(
        "--max-wait-ms", type=float, default=defaults.max_wait_ms, help="how long a batch waits for more requests"
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="most rows x longest max_tokens per generate call (default: no limit but --max-batch-size)",
    )
    parser.add_argument(
        "--max-queue-s",
        type=float,
        help="answer 429 with Retry-After when a new request's estimated wait for its answer exceeds this "
        "(the client's timeout or less; default: never)",
    )
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--device", default=defaults.device, help="torch device for the model (default: %(default)s)")
    parser.add_argument(
        "--dtype", default=defaults.dtype, choices=sorted(DTYPES), help="weights dtype (default: %(default)s)"
    )
    parser.add_argument("--log-requests", metavar="PATH", help="append one JSON line per chat request to PATH")
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.max_logprobs,
        help="largest prompt_logprobs k a scoring request may ask (as vLLM's; default %(default)s)",
    )
    parser.add_argument(
        "--weight-updates",
        action="store_true",
        help="serve POST /collective_rpc {method: ars_opd_load_weights, kwargs: {path}}: load a safetensors file "
        "into the served model (a rollout engine)",
    )
    parser.add_argument(
        "--ignore-weight-updates",
        action="store_true",
        help="FAULT INJECTION for tests: answer weight loads with success but keep the old weights (a stale engine)",
    )
    parser.add_argument(
        "--keep-old-head",
        action="store_true",
        help="FAULT INJECTION for tests: load every tensor but the output head, which keeps its old values",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="stop when this process is gone (the stage that started the server, even after a kill -9 of it)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # while the model loads, asyncio's handlers are not installed yet: exit quietly on SIGTERM then too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        options = ServerOptions(
            model_name=args.model_name,
            max_batch_size=args.max_batch_size,
            max_wait_ms=args.max_wait_ms,
            max_batch_tokens=args.max_batch_tokens,
            max_queue_s=args.max_queue_s,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            log_requests=args.log_requests,
            max_logprobs=args.max_logprobs,
            weight_updates=args.weight_updates or args.ignore_weight_updates or args.keep_old_head,
            ignore_weight_updates=args.ignore_weight_updates,
            keep_old_head=args.keep_old_head,
            parent_pid=args.parent_pid,
        )
        run_server(args.model_dir, options, args.host, args.port, args.ready_file)
    except KeyboardInterrupt:  # Ctrl-C before serving started
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
