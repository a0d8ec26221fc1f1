"""The scoring client against stock vLLM's traps: logits where log-probabilities belong (``--logprobs-mode
raw_logits``), and the two URL forms of an endpoint (vLLM serves ``/tokenize`` at the root, the completions
API under ``/v1``).

Oracles: log-probabilities written by hand at a chosen log-sum-exp (the tolerance boundary), and
``FakeScorer`` (tests/fake_endpoint.py), which answers in vLLM's field names, serves ``/tokenize`` at the
root only and returns either log-softmax or the logits themselves.
"""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest

from ars_opd.config import EndpointConfig
from ars_opd.teacher.client.endpoint import ClientSettings, EndpointError, make_client
from ars_opd.teacher.client.score import (
    PROBE_TEXT,
    NotLogprobsError,
    ScoringError,
    check_logprobs,
    check_tokenizer,
    logsumexp_tolerance,
    parse_prompt_logprobs,
    score_body,
    score_sequences,
)
from fake_endpoint import ByteTokenizer, FakeScorer, byte_ids

MODEL = "fake-teacher"
FLAGS = ("--logprobs-mode raw_logprobs", "--no-enable-prefix-caching")


def _position(values: dict[int, float]) -> dict:
    return {str(t): {"logprob": v, "rank": r + 1, "decoded_token": chr(t)} for r, (t, v) in enumerate(values.items())}


def _at_lse(n: int, lse: float) -> list[float]:
    """n equal log-probabilities whose log-sum-exp is ``lse``."""
    return [lse - math.log(n)] * n


def test_negative_logits_are_refused_though_every_value_is_below_zero():
    logits = {42: -0.1, 9: -0.5, 3: -1.0}  # what raw_logits can look like: all < 0, probabilities sum to 1.88
    with pytest.raises(NotLogprobsError, match=r"prompt_logprobs\[1\]: the 3 returned values have log-sum-exp 0.63"):
        parse_prompt_logprobs([None, _position(logits)], [11, 42])
    with pytest.raises(NotLogprobsError, match="value 0.5 > 0"):
        parse_prompt_logprobs([None, _position({42: 0.5, 9: -1.0})], [11, 42])


def test_log_probabilities_pass_and_a_hair_above_zero_is_rounding():
    lp = {42: math.log(0.7), 9: math.log(0.2), 3: math.log(0.1)}  # a whole distribution: log-sum-exp 0
    s = parse_prompt_logprobs([None, _position(lp), _position({7: 5e-5})], [11, 42, 7])
    assert s.logprobs == [math.log(0.7), 0.0] and s.support_ids == [[42, 9, 3], [7]]


@pytest.mark.parametrize("n", [2, 3, 21])
def test_the_tolerance_boundary_is_n_bf16_eps(n):
    tol = logsumexp_tolerance(n)
    assert tol == n * 2.0**-7
    for inside in (0.0, 0.5 * tol, tol * (1 - 1e-9)):
        check_logprobs(_at_lse(n, inside), "p")
    for outside in (tol * (1 + 1e-6), 1.5 * tol):
        with pytest.raises(NotLogprobsError, match="log-sum-exp"):
            check_logprobs(_at_lse(n, outside), "p")


def test_the_fake_answers_in_vllm_field_names():
    with FakeScorer(model=MODEL) as ep:

        async def go():
            async with aiohttp.ClientSession() as s:
                root = ep.base_url.removesuffix("/v1")
                async with s.post(
                    f"{root}/tokenize", json={"model": MODEL, "prompt": "ab", "add_special_tokens": False}
                ) as r:
                    tok = await r.json()
                async with s.post(f"{root}/v1/tokenize", json={"model": MODEL, "prompt": "ab"}) as r:
                    not_under_v1 = r.status
                async with s.post(f"{root}/v1/completions", json=score_body(MODEL, [97, 98, 99], 2)) as r:
                    return tok, not_under_v1, await r.json()

        tok, not_under_v1, body = asyncio.run(go())
    assert tok == {"count": 2, "max_model_len": 4096, "tokens": [97, 98]} and not_under_v1 == 404
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and set(body["usage"]) == {
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
    }
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 3
    for i, entry in enumerate(plp[1:], 1):
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert next(iter(entry)) == str([97, 98, 99][i]) and len(entry) in (2, 3)  # the actual token first
        assert all(isinstance(v["rank"], int) and v["rank"] >= 1 for v in entry.values())


def _settings(url: str, **limits) -> ClientSettings:
    return ClientSettings(url, limits=EndpointConfig(endpoint=url, model=MODEL, **limits))


def _check_and_score(url: str, rows: list[list[int]], k: int, **limits):
    settings = _settings(url, **limits)

    async def go():
        client = make_client(settings)
        try:
            await check_tokenizer(client, MODEL, ByteTokenizer(), settings)
            return await score_sequences(client, MODEL, rows, k, settings)
        finally:
            await client.close()

    return asyncio.run(go())


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "", "/"])
def test_both_url_forms_reach_root_tokenize_and_v1_completions(suffix):
    rows = [byte_ids("Reverse: cat"), byte_ids("Add 12 and 30")]
    with FakeScorer(model=MODEL) as ep:
        url = ep.base_url.removesuffix("/v1") + suffix
        scores = _check_and_score(url, rows, 5, concurrency=2)
    paths = [p for p, _ in ep.requests]
    assert paths == ["/tokenize", "/v1/completions"] + ["/v1/completions"] * len(rows), paths
    tokenize, probe = ep.requests[0][1], ep.requests[1][1]
    assert tokenize == {"model": MODEL, "prompt": PROBE_TEXT, "add_special_tokens": False}
    assert probe == score_body(MODEL, byte_ids(PROBE_TEXT), 1)
    sent = sorted(json.dumps(b) for _, b in ep.requests[2:])
    assert sent == sorted(json.dumps(score_body(MODEL, r, 5)) for r in rows)
    for ids, s in zip(rows, scores):
        assert len(s.logprobs) == len(ids) - 1
        for i in range(1, len(ids)):
            assert s.logprobs[i - 1] == pytest.approx(ep.values(ids[i - 1], i)[ids[i]], abs=1e-12)
            assert ids[i] in s.support_ids[i - 1] and len(s.support_ids[i - 1]) in (5, 6)


def test_logits_are_refused_before_training_naming_the_flags():
    with FakeScorer(model=MODEL, logprobs_mode="raw_logits") as ep:
        with pytest.raises(NotLogprobsError, match="Refused before training") as refused:
            _check_and_score(ep.base_url, [byte_ids("abc")], 5)
    message = str(refused.value)
    assert all(flag in message for flag in FLAGS) and ep.base_url in message, message
    assert isinstance(refused.value, (ScoringError, EndpointError))
    assert [p for p, _ in ep.requests] == ["/tokenize", "/v1/completions"]  # refused at the probe, not retried


def test_logits_in_a_step_are_refused_and_not_retried():
    rows = [byte_ids("Reverse: cat"), byte_ids("Add 12 and 30"), byte_ids("Sort: b a c")]
    with FakeScorer(model=MODEL, logprobs_mode="raw_logits") as ep:
        settings = _settings(ep.base_url, concurrency=1, max_attempts=5)

        async def go():
            client = make_client(settings)
            try:
                return await score_sequences(client, MODEL, rows, 3, settings)
            finally:
                await client.close()

        with pytest.raises(NotLogprobsError, match="sequence 0: prompt_logprobs.*step was not trained") as refused:
            asyncio.run(go())
    assert all(flag in str(refused.value) for flag in FLAGS)
    assert len(ep.requests) == 1  # the first answer stops the step: not retried, nothing else sent
