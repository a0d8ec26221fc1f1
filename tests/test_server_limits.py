"""One oversized request must not stall the bundled server: 413 above the body limit, 400 before tokenizing a
prompt the context cannot hold, and the CPU work of a huge prompt off the event loop."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from ars_opd.serving.server import app as server_app
from ars_opd.serving.server.handlers import BODY_LIMIT_KEY, ENGINE_KEY
from ars_opd.serving.server.options import ServerOptions
from ars_opd.serving.server.preparation import CHARS_MARGIN
from server_thread import ServerThread
from tiny_models import save_tiny_model

MODEL = "tiny"


def _serve(tmp_path_factory, tokenizer, context: int) -> ServerThread:
    """The bundled server, in this process, on a tiny model whose context is ``context`` tokens."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp(f"ctx{context}"), tokenizer, context=context)
    return ServerThread(server_app.create_app(str(model_dir), ServerOptions(model_name=MODEL, max_wait_ms=1)))


@pytest.fixture(scope="module")
def small_context(tmp_path_factory, char_tokenizer):
    srv = _serve(tmp_path_factory, char_tokenizer, 256)
    yield srv
    srv.close()


def _body(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0, **kw}


async def _post(session, url: str, body) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    data = body if isinstance(body, bytes) else json.dumps(body)
    async with session.post(f"{url}/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json(), time.perf_counter() - t0


def _post_one(url: str, body) -> tuple[int, dict, float]:
    async def go():
        async with aiohttp.ClientSession() as s:
            return await _post(s, url, body)

    return asyncio.run(go())


def test_the_bounds_follow_the_context_and_the_tokenizer(small_context, char_tokenizer):
    preparer = small_context.app[ENGINE_KEY].requests
    longest = max(len(t) for t in char_tokenizer.get_vocab())
    assert preparer.max_prompt_chars == 256 * longest * CHARS_MARGIN
    assert (
        small_context.app[BODY_LIMIT_KEY]
        == server_app.body_limit(preparer.max_prompt_chars)
        == server_app.BYTES_PER_CHAR * preparer.max_prompt_chars + server_app.BODY_OVERHEAD
    )
    # the premise of the bound: no token covers more than `longest` characters of the text (vocabulary words,
    # letters, spaces and characters the tokenizer does not know, in random order)
    import random

    rng = random.Random(0)
    pieces = list(char_tokenizer.get_vocab()) + [" ", "\u2028", "é", "漢", "🙂", "  "]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(400))
        assert len(char_tokenizer(text, add_special_tokens=False)["input_ids"]) * longest >= len(text)


def test_a_body_over_the_limit_gets_413_without_being_decoded(small_context):
    limit = small_context.app[BODY_LIMIT_KEY]
    status, out, _ = _post_one(small_context.url, json.dumps(_body("a" * limit)).encode())
    assert status == 413 and out["error"]["code"] == "request_too_large" and str(limit) in out["error"]["message"]


def test_a_prompt_the_context_cannot_hold_is_refused_before_tokenizing(small_context, monkeypatch):
    preparer = small_context.app[ENGINE_KEY].requests
    encoded = []
    real = preparer.encode
    monkeypatch.setattr(preparer, "encode", lambda messages: encoded.append(1) or real(messages))
    status, out, _ = _post_one(small_context.url, _body("b" * (preparer.max_prompt_chars + 1)))
    assert status == 400 and out["error"]["code"] == "context_length_exceeded" and encoded == []
    assert f"have {preparer.max_prompt_chars + 1} characters" in out["error"]["message"]
    # at the bound it is tokenized, and refused by its real token count
    status, out, _ = _post_one(small_context.url, _body("b" * preparer.max_prompt_chars))
    assert status == 400 and encoded == [1] and "prompt tokens" in out["error"]["message"]
    status, out, _ = _post_one(small_context.url, _body("hi"))
    assert status == 200 and encoded == [1, 1]


@pytest.mark.slow
def test_small_requests_stay_fast_while_a_huge_prompt_is_tokenized(tmp_path_factory, char_tokenizer):
    """A context of 200k tokens admits a 1.5M-character prompt to tokenization (seconds of CPU); meanwhile
    small requests are served as usual; tokenized on the event loop, each would wait for all of it."""
    srv = _serve(tmp_path_factory, char_tokenizer, 200_000)
    try:

        async def go():
            async with aiohttp.ClientSession() as s:
                baseline = [(await _post(s, srv.url, _body("hi")))[2] for _ in range(5)]
                huge = asyncio.create_task(_post(s, srv.url, _body("abc def ghi " * 125_000)))
                await asyncio.sleep(0.2)  # let the huge one reach its tokenizer
                small = []
                while not huge.done():
                    status, _, seconds = await _post(s, srv.url, _body("hi"))
                    assert status == 200
                    small.append(seconds)
                    await asyncio.sleep(0.02)
                return baseline, await huge, small

        baseline, (status, out, huge_s), small = asyncio.run(go())
    finally:
        srv.close()
    assert status == 400 and "prompt tokens" in out["error"]["message"]  # tokenized, then refused
    assert huge_s > 1.0 and len(small) >= 5, (huge_s, small)  # the small requests really overlapped it
    # a slow shared machine gets generous margin; blocked, each would have waited the whole huge_s
    assert max(small) < min(1.5, huge_s / 2), (max(small), huge_s, sorted(baseline))
