"""teacher_gen against the bundled server at real scale: failures, requests per prompt, pushback, throughput.

Starts the bundled server on a model directory exactly as ``teacher_gen.endpoint: local`` does
(``generate.bundled_server`` with params.yaml's ``teacher_gen`` section, ``max_tokens`` replaced by
``--max-tokens``) and asks it for every prompt through the stage's own client (``ask_all``, concurrency
resolved as the stage resolves it, a fresh cache), optionally with ``--load-threads N`` busy processes
beside it. Prints one JSON line: prompts, failures (by reason), HTTP requests counted on both sides (the
client's chat-completion POSTs, the server's accepted + pushed back), requests per prompt, 429s, timeouts,
retries, wall time, prompts/s, generated tokens/s, and the server's batching counters (``/stats``).

    python -m bench.teacher_server_load /tmp/smollm2-hf                        # 2,200 prompts, idle
    python -m bench.teacher_server_load /tmp/smollm2-hf --load-threads 2       # beside two busy processes
    python -m bench.teacher_server_load /tmp/smollm2-hf --prompts 128          # a smoke run

Prompts are deterministic chat questions of ~10-30 words (arithmetic, a sentence about a thing, reasons,
definitions), so answers vary in length. The load is ``N`` Python processes each running ``while True: pass``
(one core each, unpinned), started before the server and stopped after the run; the JSON says so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from ars_opd.config import load_params
from ars_opd.serving.local_server import LOCAL_MODEL_NAME
from ars_opd.teacher.client import chat
from ars_opd.teacher.client.cache import TeacherCache
from ars_opd.teacher.client.chat import ask_all
from ars_opd.teacher.client.endpoint import ClientSettings
from ars_opd.teacher.client.generate import build_requests, bundled_server, resolve_concurrency

REPO = Path(__file__).resolve().parents[1]
BUSY_LOOP = "while True: pass"
THINGS = (
    "the ocean", "a red bicycle", "winter mornings", "a library", "volcanoes", "honey bees", "an old clock",
    "mountain trails", "fresh bread", "the moon", "a thunderstorm", "paper boats", "city parks", "owls",
    "a lighthouse", "green tea", "desert nights", "a violin", "river stones", "autumn leaves",
)  # fmt: skip
TEMPLATES = (
    "What is {a} plus {b}? Please answer with one short sentence that states the sum.",
    "Write one sentence about {thing} that a friend might enjoy reading on a quiet afternoon.",
    "Give two reasons why people enjoy {thing}, and keep each reason to a few words.",
    "Explain in one or two sentences what {thing} has to do with {other}, even if the link is loose.",
    "If I have {a} apples and give away {c}, how many apples are left? Show the subtraction.",
    "Describe {thing} to a curious child in simple words, using at most three short sentences.",
    "Write a short friendly greeting for a postcard about {thing}, signed by a traveller named Sam.",
    "What is {a} times {c}? Reply with the number and nothing else, please.",
    "Tell me a fun fact about {thing} and then suggest one question I could ask a teacher about it.",
    "Compare {thing} and {other} in two sentences: one about how they look and one about how they feel.",
)


def prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` subset-style rows of distinct natural chat prompts (the client asks a repeated one once), the same
    for a seed."""
    rng = random.Random(seed)
    texts: dict[str, None] = {}
    while len(texts) < n:
        thing, other = rng.sample(THINGS, 2)
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
        texts[rng.choice(TEMPLATES).format(a=a, b=b, c=c, thing=thing, other=other)] = None
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]


def server_stats(base_url: str) -> dict:
    root = base_url.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/stats", timeout=30) as r:
        return json.loads(r.read())


def count_requests(counts: Counter) -> None:
    """Count every chat-completion POST the stage's client sends, and how each ended (the reason's kind)."""
    real = chat.post_json

    async def counted(client, path, body):
        counts["requests"] += 1
        try:
            out = await real(client, path, body)
        except Exception as e:
            counts[getattr(e, "reason", type(e).__name__).split(":", 1)[0]] += 1
            raise
        counts["ok"] += 1
        return out

    chat.post_json = counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", help="a Hugging Face model directory with a chat template")
    p.add_argument("--prompts", type=int, default=2200)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--load-threads", type=int, default=0, help="busy processes running beside the server")
    p.add_argument("--params", default=str(REPO / "params.yaml"), help="whose teacher_gen section to use")
    p.add_argument("--progress", action="store_true", help="show the client's progress bar on stderr")
    args = p.parse_args()

    cfg = load_params(args.params, sections=("teacher_gen",)).teacher_gen
    cfg = dataclasses.replace(cfg, max_tokens=args.max_tokens)
    cfg = dataclasses.replace(cfg, concurrency=resolve_concurrency(cfg))
    requests = build_requests(prompts(args.prompts), cfg, LOCAL_MODEL_NAME, "bench")
    counts: Counter = Counter()
    count_requests(counts)
    load = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load_threads)]
    try:
        with tempfile.TemporaryDirectory() as tmp, bundled_server(cfg, args.model_dir) as url:
            load_avg = os.getloadavg()
            with TeacherCache(Path(tmp) / "answers.jsonl") as cache:
                t0 = time.perf_counter()
                summary = asyncio.run(ask_all(requests, cache, ClientSettings(url, limits=cfg), args.progress))
                wall = time.perf_counter() - t0
                answer_tokens = sum(
                    (cache.get(r.key)["response"].get("usage") or {}).get("completion_tokens") or 0
                    for r in {r.key: r for r in requests}.values()
                    if r.key in cache
                )
            stats = server_stats(url)
    finally:
        for proc in load:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    server_requests = stats["completions"] + stats["pushed_back"]
    print(
        json.dumps(
            {
                "model_dir": args.model_dir,
                "prompts": len(requests),
                "answered": summary.completed,
                "failures": summary.failed,
                "failures_by_reason": chat.count_by_reason(f.reason for f in summary.failures),
                "http_requests": counts["requests"],
                "http_requests_server": server_requests,
                "requests_per_prompt": round(counts["requests"] / max(1, len(requests)), 4),
                "http_429": counts["http_429"],
                "timeouts": counts["timeout"],
                "other_errors": counts["requests"] - counts["ok"] - counts["http_429"] - counts["timeout"],
                "retries": summary.retries,
                "wall_s": round(wall, 1),
                "prompts_per_s": round(summary.completed / wall, 3),
                "generated_tokens_per_s": round(stats["tokens_generated"] / wall, 1),
                "answer_tokens_per_s": round(answer_tokens / wall, 1),
                "mean_answer_tokens": round(answer_tokens / max(1, summary.completed), 1),
                "load": {
                    "processes": args.load_threads,
                    "what": f"{args.load_threads} x python -c '{BUSY_LOOP}' (one core each, unpinned)",
                    "cpus": os.cpu_count(),
                    "loadavg_1_5_15_at_start": [round(x, 2) for x in load_avg],
                },
                "client": {
                    "concurrency": cfg.concurrency,
                    "concurrency_at_end": summary.concurrency,
                    "request_timeout_s": cfg.request_timeout_s,
                    "max_attempts": cfg.max_attempts,
                    "max_tokens": cfg.max_tokens,
                },
                "server_config": dataclasses.asdict(cfg.server),
                "server": {
                    k: stats[k]
                    for k in (
                        "completions",
                        "pushed_back",
                        "clients_gone",
                        "rows_dropped",
                        "rows_stopped",
                        "generate_calls",
                        "rows_generated",
                        "largest_batch",
                        "largest_batch_tokens",
                        "tokens_generated",
                        "step_fixed_s",
                        "step_per_row_s",
                    )
                },
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
