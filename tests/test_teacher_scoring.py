"""Scoring through the bundled server's ``/v1/completions``: vLLM's exact ``prompt_logprobs`` shape, values
against a float64 forward of the same model, batching, request validation, /tokenize, and the scoring client.

``VLLM_RESPONSE`` is written by hand from vLLM's documented completions response (``choices[i]
.prompt_logprobs``: a list whose first item is null, then per position a dict keyed by token id, a string
in JSON, of {logprob, rank, decoded_token}; the actual token is included even outside the top-k, which then
gives k + 1 entries). Both it and the bundled server's answers go through the same parser.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from ars_opd.config import EndpointConfig
from ars_opd.serving.server import app as server_app
from ars_opd.serving.server.options import ServerOptions
from ars_opd.teacher.client.endpoint import ClientSettings, RetryableError, make_client
from ars_opd.teacher.client.score import ScoringError, check_tokenizer, parse_prompt_logprobs, score_sequences
from server_thread import ServerThread
from test_teacher_server import save_scaled_model
from tolerances import forward_bound, two_computations, vs_oracle

MODEL = "tiny-scorer"

# prompt [11, 42, 7]: top-2 at position 1 includes 42; at position 2 the actual token 7 is outside the top-2
VLLM_RESPONSE = json.loads("""
{"id": "cmpl-5b1c", "object": "text_completion", "created": 1733000000, "model": "Qwen/Qwen3-8B",
 "choices": [{"index": 0, "text": " the", "logprobs": null, "finish_reason": "length", "stop_reason": null,
   "prompt_logprobs": [
     null,
     {"42": {"logprob": -0.25, "rank": 1, "decoded_token": " fox"},
      "9": {"logprob": -1.75, "rank": 2, "decoded_token": " dog"}},
     {"7": {"logprob": -6.5, "rank": 14, "decoded_token": "!"},
      "3": {"logprob": -0.5, "rank": 1, "decoded_token": "."},
      "5": {"logprob": -1.5, "rank": 2, "decoded_token": ","}}
   ]}],
 "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}}
""")


def test_parser_reads_a_vllm_shaped_response():
    s = parse_prompt_logprobs(VLLM_RESPONSE["choices"][0]["prompt_logprobs"], [11, 42, 7])
    assert s.logprobs == [-0.25, -6.5]
    assert s.support_ids == [[42, 9], [7, 3, 5]] and s.support_logprobs[1] == [-6.5, -0.5, -1.5]


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda p: p.pop(), "positions"),  # one position short
        (lambda p: p.__setitem__(0, {}), "not null"),
        (lambda p: p[2].pop("7"), "lacks the actual token 7"),
        (lambda p: p[1]["42"].__setitem__("logprob", "-0.5"), "not a finite number"),
        (lambda p: p[1]["42"].__setitem__("logprob", None), "not a finite number"),
        (lambda p: p[1].__setitem__("x", {"logprob": -1.0}), "not a token id"),
    ],
)
def test_parser_refuses_malformed_prompt_logprobs(mutate, needle):
    p = json.loads(json.dumps(VLLM_RESPONSE["choices"][0]["prompt_logprobs"]))
    mutate(p)
    with pytest.raises(RetryableError, match=needle):
        parse_prompt_logprobs(p, [11, 42, 7])


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory, char_tokenizer):
    # sharper distributions than the default init's near-uniform ones
    return save_scaled_model(tmp_path_factory.mktemp("tiny_scorer"), char_tokenizer, num_layers=2, seed=3, scale=8.0)


@pytest.fixture(scope="module")
def scorer(scorer_dir):
    srv = ServerThread(
        server_app.create_app(
            str(scorer_dir), ServerOptions(model_name=MODEL, max_batch_size=64, max_wait_ms=50, max_logprobs=8)
        )
    )
    yield srv
    srv.close()


def _post(url: str, path: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def one(s, b):
        async with s.post(f"{url}{path}", json=b) as r:
            return r.status, await r.json()

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, b) for b in bodies))

    return asyncio.run(go())


def _rows(tokenizer) -> list[list[int]]:
    texts = ["Reverse the word: cat", "Add 12 and 30", "Sort: b a c", "Uppercase: hello world and more words"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_server_answers_in_vllm_shape_with_float64_oracle_values(scorer, scorer_dir, char_tokenizer):
    from transformers import AutoModelForCausalLM

    rows, k = _rows(char_tokenizer), 5
    status, body = _post(
        scorer.url,
        "/v1/completions",
        [{"model": MODEL, "prompt": rows, "max_tokens": 1, "echo": True, "prompt_logprobs": k}],
    )[0]
    assert status == 200, body
    assert body["object"] == "text_completion" and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(scorer_dir).double().eval()
    vocab = len(char_tokenizer)
    for ids, choice in zip(rows, body["choices"]):
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :, :vocab]
            lp = torch.log_softmax(logits, -1)  # (L, V) float64
        # the server's fp32 forward (rows padded to the longest) against this float64 one
        tol = vs_oracle(forward_bound(model.config, max(map(len, rows)), logits.abs().max().item(), vocab))
        for i in range(1, len(ids)):
            entry = plp[i]
            assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
            assert str(ids[i]) in entry and len(entry) in (k, k + 1)
            oracle = lp[i - 1]
            actual = entry[str(ids[i])]
            assert abs(actual["logprob"] - float(oracle[ids[i]])) <= tol
            assert actual["rank"] == int((oracle > oracle[ids[i]]).sum()) + 1
            assert actual["decoded_token"] == char_tokenizer.decode([ids[i]])
            top = oracle.topk(k).indices.tolist()
            others = {int(t): v for t, v in entry.items() if int(t) != ids[i] or ids[i] in top}
            assert sorted(others) == sorted(top)
            for t, v in others.items():
                assert abs(v["logprob"] - float(oracle[t])) <= tol and v["rank"] == top.index(t) + 1
        # the parser reads the server's answer as it reads vLLM's
        parsed = parse_prompt_logprobs(plp, ids)
        assert torch.allclose(
            torch.tensor(parsed.logprobs, dtype=torch.float64),
            lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])],
            rtol=0,
            atol=tol,
        )
        next_token = int(lp[-1].argmax())
        assert choice["text"] == char_tokenizer.decode(ids) + char_tokenizer.decode([next_token])
        assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, rows)),
        "completion_tokens": 4,
        "total_tokens": sum(map(len, rows)) + 4,
    }


def _two_forwards(scorer_dir, rows, vocab) -> float:
    """Two fp32 forwards of the scorer over ``rows`` in other batches (other padding): within twice one's bound."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(scorer_dir).eval()
    with torch.no_grad():
        top = max(model(torch.tensor([ids])).logits[0, :, :vocab].abs().max().item() for ids in rows)
    return two_computations(forward_bound(model.config, max(map(len, rows)), top, vocab))


def test_concurrent_scoring_requests_share_batches(scorer, scorer_dir, char_tokenizer):
    rows = _rows(char_tokenizer) * 4
    calls = scorer.stats.score_calls
    out = _post(
        scorer.url,
        "/v1/completions",
        [{"model": MODEL, "prompt": r, "max_tokens": 0, "prompt_logprobs": 2} for r in rows],
    )
    assert all(s == 200 for s, _ in out)
    assert scorer.stats.score_calls - calls < len(rows)  # batched, not one forward per request
    alone = _post(
        scorer.url, "/v1/completions", [{"model": MODEL, "prompt": rows[3], "max_tokens": 0, "prompt_logprobs": 2}]
    )[0][1]
    a = parse_prompt_logprobs(alone["choices"][0]["prompt_logprobs"], rows[3]).logprobs
    b = parse_prompt_logprobs(out[3][1]["choices"][0]["prompt_logprobs"], rows[3]).logprobs
    # batch mates and padding do not change a row beyond rounding
    assert max(abs(x - y) for x, y in zip(a, b)) <= _two_forwards(scorer_dir, rows, len(char_tokenizer))
    assert out[0][1]["choices"][0]["text"] == ""  # max_tokens 0, no echo


@pytest.mark.parametrize(
    "override, status, needle",
    [
        ({"max_tokens": 16}, 400, "max_tokens"),
        ({"prompt": "text prompt"}, 400, "token ids"),
        ({"prompt": [1, 2, 10**6]}, 400, "token ids in"),
        ({"prompt_logprobs": 9}, 400, "max-logprobs"),
        ({"temperature": 0.7}, 400, "temperature 1"),
        ({"stream": True}, 400, "stream"),
        ({"model": "other"}, 404, "does not exist"),
    ],
)
def test_scoring_requests_are_validated(scorer, override, status, needle):
    got, body = _post(
        scorer.url,
        "/v1/completions",
        [{"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 2, **override}],
    )[0]
    assert got == status and needle in body["error"]["message"], body


def test_tokenize_endpoint_matches_the_tokenizer(scorer, char_tokenizer):
    text = "Reverse: abc"
    _, body = _post(scorer.url, "/tokenize", [{"model": MODEL, "prompt": text, "add_special_tokens": False}])[0]
    assert body["tokens"] == char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert set(body) == {"count", "max_model_len", "tokens"} and body["count"] == len(body["tokens"])  # vLLM's fields


def _settings(url: str, **limits) -> ClientSettings:
    return ClientSettings(f"{url}/v1", limits=EndpointConfig(endpoint=f"{url}/v1", model=MODEL, **limits))


def test_score_sequences_and_tokenizer_check_through_the_client(scorer, scorer_dir, char_tokenizer):
    rows = _rows(char_tokenizer)
    settings = _settings(scorer.url, concurrency=3)

    async def go():
        client = make_client(settings)
        try:
            await check_tokenizer(client, MODEL, char_tokenizer, settings)
            return await score_sequences(client, MODEL, rows, 3, settings)
        finally:
            await client.close()

    scores = asyncio.run(go())
    direct = _post(
        scorer.url, "/v1/completions", [{"model": MODEL, "prompt": rows, "max_tokens": 0, "prompt_logprobs": 3}]
    )[0][1]
    tol = _two_forwards(scorer_dir, rows, len(char_tokenizer))
    for ids, s, c in zip(rows, scores, direct["choices"]):
        # equal up to float rounding: the server batched these rows differently (other padding)
        ref = parse_prompt_logprobs(c["prompt_logprobs"], ids)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)) <= tol
        assert [set(x) for x in s.support_ids] == [set(x) for x in ref.support_ids]


def test_tokenizer_mismatch_is_refused_naming_the_endpoint(scorer, char_tokenizer):
    class Shifted:  # the same tokenizer with every id moved by one: what a different vocabulary looks like
        eos_token = char_tokenizer.eos_token

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [t + 1 for t in char_tokenizer(text, add_special_tokens=False)["input_ids"]]}

    settings = _settings(scorer.url)

    async def go():
        client = make_client(settings)
        try:
            await check_tokenizer(client, MODEL, Shifted(), settings)
        finally:
            await client.close()

    with pytest.raises(ScoringError, match=f"{scorer.url}/v1.*tokenizes differently"):
        asyncio.run(go())
