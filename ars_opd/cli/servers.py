"""The ``ars-opd`` subcommands that start a server: ``serve`` (the bundled OpenAI-compatible server) and ``vllm``
(``check``: a real vLLM answers on a tiny model; ``serve``: a model served by vLLM, optionally for one command).
Their heavy imports happen only when one runs; what each does is the command's docstring (``ars_opd.cli``).
"""

from __future__ import annotations

import argparse
import json
import sys

from ars_opd.config import VLLM_DTYPES


def serve(argv: list[str]) -> int:
    from ars_opd.serving.server import app  # heavy imports only for this subcommand

    return app.main(argv)


def _vllm_check(args: argparse.Namespace) -> int:
    import tempfile
    import time
    import urllib.request

    from ars_opd.config import ArchConfig
    from ars_opd.data import synthetic
    from ars_opd.models.builtin import save_builtin_model
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.serving.local_server import LocalServerError
    from ars_opd.serving.vllm_server import VLLMOptions, vllm_server

    def post(url: str, body: dict) -> dict:
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)

    with tempfile.TemporaryDirectory(prefix="ars-opd-vllm-check-") as tmp:
        tokenizer = build_char_word_tokenizer(synthetic.instruction_words())
        arch = ArchConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=128)
        save_builtin_model(tmp, arch, tokenizer)  # head size 32: one vLLM's CPU attention serves
        t0 = time.monotonic()
        try:
            with vllm_server(tmp, VLLMOptions(served_model_name="check")) as url:
                ready = time.monotonic() - t0
                chat = post(
                    f"{url}/chat/completions",
                    {"model": "check", "messages": [{"role": "user", "content": "Add 2 and 3."}], "max_tokens": 4},
                )
                scored = post(
                    f"{url}/completions",
                    {"model": "check", "prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 1},
                )
        except (LocalServerError, OSError, ValueError) as e:
            print(f"ars-opd vllm check: {e}", file=sys.stderr)
            return 1
    n_scored = len(scored["choices"][0]["prompt_logprobs"])
    print(
        f"ars-opd vllm check: vLLM served a tiny model after {ready:.0f} s: a chat completion "
        f"({chat['choices'][0]['finish_reason']}) and prompt_logprobs for {n_scored} positions"
    )
    return 0


def _vllm_serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import subprocess
    import threading

    from ars_opd.serving.local_server import LocalServerError
    from ars_opd.serving.vllm_server import VLLMOptions, vllm_server

    opts = VLLMOptions(
        served_model_name=args.name,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        build=args.build,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        weight_sync=args.rollout_engine,
    )
    command = args.command_line
    try:
        with vllm_server(args.model_dir, opts, port=args.port, log_path=args.log) as url:
            print(f"ars-opd vllm: serving {args.model_dir} as {args.name!r} at {url}", file=sys.stderr, flush=True)
            if not command:
                stop = threading.Event()
                signal.signal(signal.SIGTERM, lambda *_: stop.set())
                try:
                    stop.wait()
                except KeyboardInterrupt:
                    pass
                return 0
            return subprocess.run(command, env={**os.environ, "ARS_OPD_VLLM_URL": url}).returncode
    except LocalServerError as e:
        print(f"ars-opd vllm: {e}", file=sys.stderr)
        return 1


def add_parsers(sub) -> None:
    """``serve`` (its arguments parsed by the server itself) and ``vllm``, in the command's order."""
    # parsed by the server itself (main() hands it the rest of the command line)
    sub.add_parser("serve", help="serve a local HF causal LM with an OpenAI-compatible API (serve --help)")
    v = sub.add_parser("vllm", help="a real vLLM server from .venv-vllm (make vllm): check it, or serve a model")
    vsub = v.add_subparsers(dest="vllm_command", required=True)
    vsub.add_parser("check", help="start vLLM on a tiny model, ask it once, stop it").set_defaults(func=_vllm_check)
    vs = vsub.add_parser("serve", help="serve MODEL_DIR with vLLM; with `-- COMMAND`, run it against the server")
    vs.add_argument("model_dir", help="a local Hugging Face model directory (e.g. data/models/teacher)")
    vs.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    vs.add_argument("--name", default="teacher", help="served model name (default: teacher)")
    vs.add_argument("--max-model-len", type=int, default=256, help="context length (default 256)")
    vs.add_argument("--max-logprobs", type=int, default=20, help="largest prompt_logprobs k (default 20)")
    vs.add_argument(
        "--logprobs-mode", default="raw_logprobs", help="vLLM's --logprobs-mode (default raw_logprobs: OPD needs it)"
    )
    vs.add_argument(
        "--build",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="the vLLM environment's build (default auto: ask its python whether torch sees a GPU); a CPU build "
        "serves fp32, eager, in a 256 MiB KV cache, a GPU build in the checkpoint's dtype with CUDA graphs",
    )
    vs.add_argument(
        "--dtype",
        choices=VLLM_DTYPES,
        default=None,
        help="vLLM's --dtype (default: float32 on a CPU build, auto on a GPU build)",
    )
    vs.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="a GPU build's share of the GPU's memory (default 0.9, vLLM's; lower it beside a trainer)",
    )
    vs.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's --enforce-eager (default: on a CPU build, off on a GPU build)",
    )
    vs.add_argument("--log", default=None, help="write the server's output here (default: a temporary file)")
    vs.add_argument(
        "--rollout-engine",
        action="store_true",
        help="serve a student for opd.rollouts: engine (our weight-sync worker extension, dev mode, vLLM's own "
        "generation defaults, chunked prefill off)",
    )
    vs.set_defaults(func=_vllm_serve, command_line=[])  # `-- COMMAND ...` after the options: split off in main
