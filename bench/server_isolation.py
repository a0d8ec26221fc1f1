"""Does one oversized prompt stall the bundled server for everyone else?

Builds a tiny model directory (the built-in tokenizer, a given context length; ``save_builtin_model``),
starts ``ars-opd serve`` on it as its own process (``local_server``, as the stages do), sends one
huge prompt, and meanwhile small requests (max_tokens 2): ``--small`` of them one after another, or all at
once with ``--burst``. Prints one JSON line per scenario: the huge request's status and seconds, and the
small requests' count, median and max latency and failures.

    python -m bench.server_isolation                 # the default scenarios below (from the repo root)
    python -m bench.server_isolation --burst 256     # 256 small requests sent together with each huge one

Scenarios (context tokens, prompt characters): (256, 8M) refused 413 by the body limit; (256, 50k) refused
400 by the character bound, before tokenizing; (200k, 1.5M) tokenized in a worker thread, then refused 400
by its token count. The figure to read is the small requests' latency: it stays flat when huge requests are
refused without holding up the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from ars_opd.config import ArchConfig, TeacherServerConfig
from ars_opd.data import synthetic
from ars_opd.models.builtin import save_builtin_model
from ars_opd.models.tokenizer import build_char_word_tokenizer
from ars_opd.serving.local_server import local_server

SCENARIOS = ((256, 8_000_000), (256, 50_000), (200_000, 1_500_000))


def serve(context: int, tmp: Path):
    """``ars-opd serve`` as its own process on a tiny model whose context is ``context`` tokens: a context
    manager yielding the server's base URL (``.../v1``); the process stops on leaving it."""
    arch = ArchConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
    model_dir = save_builtin_model(
        tmp / f"ctx{context}",
        dataclasses.replace(arch, max_position_embeddings=context),
        build_char_word_tokenizer(synthetic.instruction_words()),
    )
    return local_server(
        str(model_dir), TeacherServerConfig(threads=1, max_wait_ms=1.0, startup_timeout_s=120), model_name="m"
    )


async def post(session: aiohttp.ClientSession, url: str, content: str) -> tuple[int | str, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
            await r.read()
            return r.status, time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__, time.perf_counter() - t0


async def scenario(url: str, chars: int, small: int, burst: int) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        baseline = [(await post(s, url, "hi"))[1] for _ in range(5)]
        huge = asyncio.create_task(post(s, url, "abc def ghi " * (chars // 12)))
        if burst:
            results = await asyncio.gather(*(post(s, url, "hi") for _ in range(burst)))
        else:
            results = []
            await asyncio.sleep(0.05)
            while not huge.done() and len(results) < small:
                results.append(await post(s, url, "hi"))
                await asyncio.sleep(0.02)
        status, huge_s = await huge
    lat = [t for code, t in results if code == 200]
    return {
        "huge_status": status,
        "huge_s": round(huge_s, 3),
        "small_n": len(results),
        "small_failed": sum(code != 200 for code, _ in results),
        "small_p50_s": round(statistics.median(lat), 4) if lat else None,
        "small_max_s": round(max(lat), 4) if lat else None,
        "baseline_p50_s": round(statistics.median(baseline), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", type=int, default=1000, help="most sequential small requests per scenario")
    p.add_argument("--burst", type=int, default=0, help="send this many small requests at once instead")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for context, chars in SCENARIOS:
            with serve(context, Path(tmp)) as base:
                result = asyncio.run(scenario(f"{base}/chat/completions", chars, args.small, args.burst))
            print(json.dumps({"context": context, "prompt_chars": chars, "burst": args.burst, **result}), flush=True)


if __name__ == "__main__":
    main()
