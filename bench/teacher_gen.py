"""Throughput of the teacher client + cache against an endpoint with a fixed latency.

Starts the fake OpenAI-compatible endpoint (tests/fake_endpoint.py) as its own process, answering every
request after ``--latency`` seconds, and for each concurrency C sends ``--per-c`` x C requests through the
stage's real client (``ask_all``) into a fresh ``TeacherCache`` (writes included). Prints one JSON line per
C: concurrency, latency_s, requests, requests_per_s, ideal_requests_per_s (C / latency), efficiency.

    python bench/teacher_gen.py                      # C in 8, 64, 256, 1024; 20 x C requests each
    python bench/teacher_gen.py --transport httpx    # compare the openai client's httpx transport
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ars_opd.config import EndpointConfig
from ars_opd.teacher.client.cache import TeacherCache, cache_key
from ars_opd.teacher.client.chat import TeacherRequest, ask_all
from ars_opd.teacher.client.endpoint import ClientSettings


def start_endpoint(latency: float, tmp: Path) -> tuple[subprocess.Popen, str]:
    ready = tmp / "ready.json"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            str(repo / "tests" / "fake_endpoint.py"),
            "--latency",
            str(latency),
            "--ready-file",
            str(ready),
        ],
        cwd=repo,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("fake endpoint did not start")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, f"http://{info['host']}:{info['port']}/v1"


def requests_for(n: int, tag: str) -> list[TeacherRequest]:
    out = []
    for i in range(n):
        identity = {
            "model": "fake-teacher",
            "messages": [{"role": "user", "content": f"{tag} prompt {i}"}],
            "sampling": {"temperature": 0.0, "max_tokens": 32},
        }
        body = {"model": "fake-teacher", "messages": identity["messages"], "temperature": 0.0, "max_tokens": 32}
        out.append(TeacherRequest(cache_key(identity), body, identity))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--latency", type=float, default=1.0)
    p.add_argument("--per-c", type=int, default=20, help="requests per concurrency level, as a multiple of C")
    p.add_argument("--transport", choices=["aiohttp", "httpx"], default="aiohttp")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_endpoint(args.latency, Path(tmp))
        try:
            for c in args.concurrency:
                reqs = requests_for(args.per_c * c, f"c{c}")
                settings = ClientSettings(
                    url, limits=EndpointConfig(concurrency=c, request_timeout_s=60), transport=args.transport
                )
                with TeacherCache(Path(tmp) / f"cache-{c}.jsonl") as cache:
                    t0 = time.perf_counter()
                    summary = asyncio.run(ask_all(reqs, cache, settings, progress=False))
                    elapsed = time.perf_counter() - t0
                rps = summary.completed / elapsed
                ideal = c / args.latency
                print(
                    json.dumps(
                        {
                            "concurrency": c,
                            "latency_s": args.latency,
                            "requests": len(reqs),
                            "completed": summary.completed,
                            "failed": summary.failed,
                            "transport": args.transport,
                            "seconds": round(elapsed, 2),
                            "requests_per_s": round(rps, 1),
                            "ideal_requests_per_s": round(ideal, 1),
                            "efficiency": round(rps / ideal, 3),
                        }
                    ),
                    flush=True,
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)


if __name__ == "__main__":
    main()
