"""The bundled server over real HTTP on 127.0.0.1: OpenAI wire format, batching, sampling, streaming, errors.

The oracle for greedy text is ``ars_opd.lm.generation.generate_token_ids`` on the same model directory,
which shares no code with the server's engine, sampler or stopping logic. One test runs the module as
a subprocess to check the ready file and a clean SIGTERM exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from ars_opd.config import ArchConfig
from ars_opd.data.prompts import encode_prompt
from ars_opd.lm.generation import decode_completion, generate_token_ids
from ars_opd.models.builtin import build_causal_lm
from ars_opd.serving.server import app as server_app
from ars_opd.serving.server import handlers, sampling
from ars_opd.serving.server.options import ServerOptions
from server_thread import ServerThread

MODEL = "tiny-teacher"
# 16 prompts of different lengths, so a batch of them is really left-padded
PROMPTS = [f"Reverse: {'abcdefghijklmnop'[: i + 1]}" + " x" * (i % 3) for i in range(16)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, char_tokenizer) -> Path:
    d = tmp_path_factory.mktemp("tiny_teacher")
    # At the default init (std 0.02) this model answers "\n\n\n..." to every prompt, which could not tell
    # one batch row from another; larger weights make the greedy text depend on the prompt.
    return save_scaled_model(d, char_tokenizer, num_layers=1, seed=0, scale=20.0)


def save_scaled_model(d: Path, tokenizer, num_layers: int, seed: int, scale: float) -> Path:
    """A tiny built-in model (hidden 32) with its matrices scaled by ``scale``, saved with ``tokenizer``."""
    model = build_causal_lm(
        ArchConfig(hidden_size=32, num_layers=num_layers, num_heads=2, num_kv_heads=2, intermediate_size=64),
        tokenizer,
        seed=seed,
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    # a generous wait makes "concurrent requests share a batch" hold even on a busy 2-core machine
    srv = ServerThread(
        server_app.create_app(str(model_dir), ServerOptions(model_name=MODEL, max_batch_size=64, max_wait_ms=50))
    )
    yield srv
    srv.close()


def chat_body(content: str, **overrides) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 12,
        **overrides,
    }


async def _post(session: aiohttp.ClientSession, url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    async with session.post(f"{url}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def post_all(url: str, bodies: list, concurrent: bool) -> list[tuple[int, dict]]:
    async def go():
        async with aiohttp.ClientSession() as s:
            if concurrent:
                return await asyncio.gather(*(_post(s, url, b) for b in bodies))
            return [await _post(s, url, b) for b in bodies]

    return asyncio.run(go())


def post(url: str, body) -> dict:
    status, out = post_all(url, [body], concurrent=False)[0]
    assert status == 200, out
    return out


def stream(url: str, body: dict, on_chunk=None) -> list:
    """The SSE ``data:`` payloads of a streamed completion, decoded (``[DONE]`` kept as a string)."""

    async def go():
        events = []
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    line = line.decode().strip()
                    if not line:
                        continue
                    assert line.startswith("data: "), line
                    payload = line[len("data: ") :]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
                    if on_chunk is not None:
                        on_chunk(events[-1])
        return events

    return asyncio.run(go())


def text_of(response: dict) -> str:
    return response["choices"][0]["message"]["content"]


def streamed_text(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])


def test_models_health_and_stats(server):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{server.url}/v1/models") as r:
                models = await r.json()
            async with s.get(f"{server.url}/health") as r:
                health = (r.status, await r.json())
            async with s.get(f"{server.url}/stats") as r:
                stats = await r.json()
        return models, health, stats

    models, health, stats = asyncio.run(go())
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    assert health == (200, {"status": "ok"})
    assert set(stats) >= {"completions", "generate_calls", "largest_batch"}


def test_greedy_text_equals_generate_token_ids(server, model_dir, char_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    for content in PROMPTS[:3]:
        messages = [{"role": "user", "content": content}]
        prompt_ids = encode_prompt(char_tokenizer, messages)
        want_ids = generate_token_ids(model, char_tokenizer, [prompt_ids], max_new_tokens=24)[0]
        got = post(server.url, chat_body(content, max_tokens=24))
        assert text_of(got) == decode_completion(char_tokenizer, want_ids)
        ended_at_eos = want_ids[-1] == char_tokenizer.eos_token_id
        assert got["choices"][0]["finish_reason"] == ("stop" if ended_at_eos else "length")
        assert got["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(want_ids),
            "total_tokens": len(prompt_ids) + len(want_ids),
        }
        assert got["object"] == "chat.completion" and got["model"] == MODEL and got["id"].startswith("chatcmpl-")


def test_concurrent_requests_are_batched_and_match_sequential(server):
    bodies = [chat_body(p, max_tokens=10 + i % 4) for i, p in enumerate(PROMPTS)]
    sequential = post_all(server.url, bodies, concurrent=False)
    calls_before = server.stats.generate_calls
    concurrent = post_all(server.url, bodies, concurrent=True)
    calls = server.stats.generate_calls - calls_before
    assert [s for s, _ in concurrent] == [200] * 16
    assert [text_of(r) for _, r in concurrent] == [text_of(r) for _, r in sequential]
    assert [r["usage"] for _, r in concurrent] == [r["usage"] for _, r in sequential]
    assert len({text_of(r) for _, r in sequential}) > 8  # the prompts really lead to different texts
    assert calls < 16 and server.stats.largest_batch > 1, (calls, server.stats)


def test_streaming_is_incremental_and_equals_whole_text(server):
    body = chat_body(PROMPTS[5], max_tokens=200)
    whole = post(server.url, body)
    during_generate = []
    events = stream(server.url, body, on_chunk=lambda e: during_generate.append(server.stats.generating))
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    final = events[-2]["choices"][0]
    assert final["finish_reason"] == whole["choices"][0]["finish_reason"] and final["delta"] == {}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert streamed_text(events) == text_of(whole)
    content_chunks = [e for e in events[1:-2] if e["choices"][0]["delta"].get("content")]
    assert len(content_chunks) > 10
    # tokens went out while generate was still running, not all at the end
    assert any(during_generate[1:-2]), during_generate


def test_stream_usage_chunk(server):
    events = stream(server.url, {**chat_body(PROMPTS[1], max_tokens=7), "stream_options": {"include_usage": True}})
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7


def test_seeded_sample_does_not_depend_on_batch_mates(server):
    seeded = [
        chat_body(PROMPTS[3], temperature=1.0, seed=1234, max_tokens=30),
        chat_body(PROMPTS[3], temperature=0.7, top_p=0.8, seed=7, max_tokens=30),
    ]
    alone = [text_of(post(server.url, b)) for b in seeded]
    mates = [
        chat_body(PROMPTS[9], max_tokens=5),
        chat_body(PROMPTS[0], temperature=1.0, max_tokens=40),
        chat_body(PROMPTS[12], temperature=1.5, seed=5, max_tokens=12),
        chat_body(PROMPTS[7], max_tokens=35),
    ]
    calls_before = server.stats.generate_calls
    together = post_all(server.url, [mates[0], seeded[0], mates[1], mates[2], seeded[1], mates[3]], concurrent=True)
    assert server.stats.generate_calls - calls_before < 6  # they did share a batch
    assert [text_of(together[1][1]), text_of(together[4][1])] == alone
    # sampling is on, and the seed decides it
    other_seed = text_of(post(server.url, {**seeded[0], "seed": 99}))
    greedy = text_of(post(server.url, {**seeded[0], "temperature": 0}))
    assert other_seed != alone[0] and greedy != alone[0]
    assert post(server.url, {**seeded[0], "seed": -(2**70)})["choices"][0]["finish_reason"]  # any integer seeds


def test_max_tokens_gives_length_and_exact_token_count(server):
    for key, n in (("max_tokens", 5), ("max_completion_tokens", 3)):
        body = chat_body(PROMPTS[2])
        del body["max_tokens"]
        got = post(server.url, {**body, key: n})
        assert got["choices"][0]["finish_reason"] == "length"
        assert got["usage"]["completion_tokens"] == n


def test_stop_strings_cut_the_text(server):
    full = text_of(post(server.url, chat_body(PROMPTS[4], max_tokens=30)))
    assert len(full) >= 8, full
    stop = full[5:7]
    want = full[: full.find(stop)]
    body = chat_body(PROMPTS[4], max_tokens=30, stop=["never in this text", stop])
    got = post(server.url, body)
    assert text_of(got) == want and got["choices"][0]["finish_reason"] == "stop"
    assert got["usage"]["completion_tokens"] < 30
    events = stream(server.url, body)
    assert streamed_text(events) == want and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert text_of(post(server.url, {**body, "stop": stop})) == want  # a single string works too


def test_text_parts_are_joined(server):
    parts = [{"type": "text", "text": "Reverse:"}, {"type": "text", "text": "abc"}]
    got = post(server.url, {**chat_body(""), "messages": [{"role": "user", "content": parts}]})
    assert text_of(got) == text_of(post(server.url, chat_body("Reverse:\nabc")))


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (chat_body("hi", model="other-model"), 404, "other-model"),
        ("{not json", 400, "not valid JSON"),
        ({"model": MODEL}, 400, "messages"),
        ([1, 2], 400, "JSON object"),
        (chat_body("hi", n=2), 400, "n=1"),
        ({**chat_body("hi"), "messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
        ({**chat_body("hi"), "messages": [{"role": "user", "content": 3}]}, 400, "content"),
        (chat_body("hi", temperature="hot"), 400, "temperature"),
        (chat_body("hi", top_p=0), 400, "top_p"),
        (chat_body("hi", max_tokens=0), 400, "max_tokens"),
        (chat_body("hi", max_tokens=10_000), 400, "context"),
        (chat_body("hi", stop=[""]), 400, "stop"),
        (chat_body("hi", logprobs=True), 400, "logprobs"),
    ],
)
def test_client_mistakes_get_openai_style_4xx(server, body, status, needle):
    got_status, out = post_all(server.url, [body], concurrent=False)[0]
    assert got_status == status
    assert set(out["error"]) >= {"message", "type", "code"}
    assert needle in out["error"]["message"]


def test_streamable_prefix_holds_back_possible_stop_starts():
    assert handlers.streamable_prefix("abc<en", ["<end>"]) == "abc"
    assert handlers.streamable_prefix("abc<", ["<end>", "zz"]) == "abc"
    assert handlers.streamable_prefix("abc<x", ["<end>"]) == "abc<x"
    assert handlers.streamable_prefix("ab\ufffd", []) == "ab"


def test_row_sampler_draws_from_the_tempered_nucleus():
    """Gumbel-argmax frequencies match softmax(logits / T) restricted to the top_p nucleus (an explicit oracle)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = [
        SimpleNamespace(temperature=0.0, top_p=1.0, seed=0),  # greedy: no noise
        SimpleNamespace(temperature=0.7, top_p=1.0, seed=1),
        SimpleNamespace(temperature=1.3, top_p=0.8, seed=2),
    ]
    sampler = sampling.RowSampler(rows, torch.device("cpu"))
    draws, counts = 2000, torch.zeros(3, 5)
    for _ in range(draws):
        picks = sampler(None, logits.expand(3, 5).clone()).argmax(dim=-1)
        counts[torch.arange(3), picks] += 1
    freq = counts / draws

    def nucleus_probs(t: float, top_p: float) -> torch.Tensor:
        p = torch.softmax(logits / t, dim=-1)
        keep, mass = [], 0.0
        for i in sorted(range(5), key=lambda i: -p[i].item()):
            if mass >= top_p:
                break
            keep.append(i)
            mass += p[i].item()
        q = torch.zeros(5)
        q[keep] = p[keep] / p[keep].sum()
        return q

    assert freq[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # statistical, not rounding: 2,000 draws, binomial standard error at most √(0.25/2000) ≈ 0.011; 4 of them
    assert (freq[1] - nucleus_probs(0.7, 1.0)).abs().max() < 0.045, freq[1]
    want = nucleus_probs(1.3, 0.8)
    assert (want[3:] == 0).all() and (freq[2, 3:] == 0).all()  # outside the nucleus: never drawn
    assert (freq[2] - want).abs().max() < 0.045, freq[2]


def test_official_openai_client(server):
    import openai

    want = text_of(post(server.url, chat_body(PROMPTS[6], max_tokens=15)))

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        try:
            messages = [{"role": "user", "content": PROMPTS[6]}]
            done = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=15)
            pieces = []
            chunks = await client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=15, stream=True
            )
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="nope", messages=messages)
            return done, "".join(pieces)
        finally:
            await client.close()

    done, streamed = asyncio.run(go())
    assert done.choices[0].message.content == want == streamed
    assert done.usage.completion_tokens == 15


def test_module_runs_as_a_process_and_stops_cleanly_on_sigterm(model_dir, tmp_path):
    ready, requests_log = tmp_path / "ready.json", tmp_path / "requests.jsonl"
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ars_opd.serving.server",
            str(model_dir),
            "--port",
            "0",
            "--ready-file",
            str(ready),
            "--log-requests",
            str(requests_log),
            "--threads",
            "1",
        ],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no ready file after 120 s"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        assert info["host"] == "127.0.0.1" and info["pid"] == proc.pid and info["port"] > 0
        assert info["model"] == model_dir.name  # default name: the directory's basename
        url = f"http://{info['host']}:{info['port']}"
        out = post(url, {**chat_body(PROMPTS[0]), "model": info["model"]})
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
        lines = requests_log.read_text().splitlines()
        assert len(lines) == 1
        assert set(json.loads(lines[0])) == {"time", "messages", "max_tokens", "temperature"}
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert not ready.exists()


STAGE = """
import json, sys, time
from pathlib import Path
from ars_opd.config import TeacherServerConfig
from ars_opd.serving.local_server import local_server

with local_server(sys.argv[1], TeacherServerConfig(threads=1)) as url:
    print(url, flush=True)
    time.sleep(600)  # killed with SIGKILL here: no cleanup runs
"""


def _pid_listening(port: int) -> int | None:
    """The PID of the process that listens on 127.0.0.1:``port`` (from /proc), or None."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[1].endswith(f":{port:04X}") and f[3] == "0A":  # LISTEN
            inode = f[9]
    if inode is None:
        return None
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == f"socket:[{inode}]":
                return int(fd.parts[2])
        except OSError:
            continue
    return None


def test_a_started_server_stops_when_its_stage_is_killed(model_dir):
    """The bundled server runs in its own session; a kill -9 of the stage that started it runs no cleanup. It
    watches its parent (``--parent-pid``) and must be gone within seconds, not serve on orphaned."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    stage = subprocess.Popen(
        [sys.executable, "-c", STAGE, str(model_dir)], cwd=repo, env=env, stdout=subprocess.PIPE, text=True
    )
    server_pid = None
    try:
        url = stage.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        server_pid = _pid_listening(port)
        assert server_pid is not None and server_pid != stage.pid
        urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30).read()  # serving
        stage.kill()  # SIGKILL: the context manager's finally never runs
        stage.wait()
        deadline = time.monotonic() + 30  # the poll is 1 s; the rest is the graceful shutdown on a loaded machine
        while Path(f"/proc/{server_pid}").exists() and time.monotonic() < deadline:
            try:  # reap it if it became our child's orphan under a subreaper; else just wait for it to exit
                if Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.2)
        alive = Path(f"/proc/{server_pid}").exists() and Path(f"/proc/{server_pid}/stat").read_text().split()[2] != "Z"
        assert not alive, f"the server {server_pid} still runs 30 s after its stage was killed"
    finally:
        if stage.poll() is None:
            stage.kill()
        if server_pid is not None and Path(f"/proc/{server_pid}").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(server_pid, signal.SIGKILL)


WRAPPED_STAGE = """
import subprocess, sys, time
from ars_opd.serving.local_server import exit_with_parent

proc = subprocess.Popen(exit_with_parent(["/bin/sleep", "600"]), start_new_session=True)
print(proc.pid, flush=True)
time.sleep(600)  # killed with SIGKILL here
"""


def test_a_command_wrapped_to_exit_with_its_parent_goes_when_the_stage_is_killed():
    """What a started vLLM runs under (``exit_with_parent``; vLLM itself takes no parent flag): the wrapped
    program, in a session of its own, gets SIGTERM when the stage that started it is killed with -9."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    stage = subprocess.Popen(
        [sys.executable, "-c", WRAPPED_STAGE], cwd=repo, env=env, stdout=subprocess.PIPE, text=True
    )
    child = int(stage.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}/cmdline").read_text().split("\0")[0] != "/bin/sleep" and time.monotonic() < deadline:
            time.sleep(0.05)  # the wrapper has exec'd the program: same PID, death signal kept
        assert Path(f"/proc/{child}/cmdline").read_text().split("\0")[:2] == ["/bin/sleep", "600"]
        stage.kill()
        stage.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the wrapped program outlived the stage"
    finally:
        if stage.poll() is None:
            stage.kill()
        if _running(child):
            os.kill(child, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
