"""The teacher client against a real HTTP server on loopback that injects faults (no client mocks)."""

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ars_opd.config import EndpointConfig
from ars_opd.teacher.client.cache import TeacherCache, cache_key
from ars_opd.teacher.client.chat import TeacherRequest, ask_all
from ars_opd.teacher.client.endpoint import ClientSettings, EndpointError
from fake_endpoint import FakeEndpoint, expected_answer


def _requests(n: int, model: str = "fake-teacher", tag: str = "q") -> list[TeacherRequest]:
    out = []
    for i in range(n):
        identity = {
            "model": model,
            "messages": [{"role": "user", "content": f"{tag} {i}"}],
            "sampling": {"max_tokens": 8},
        }
        body = {"model": model, "messages": identity["messages"], "max_tokens": 8}
        out.append(TeacherRequest(cache_key(identity), body, identity))
    return out


def _settings(url: str, api_key: str = "EMPTY", **kw) -> ClientSettings:
    limits = dict(concurrency=64, request_timeout_s=1.0, max_attempts=4, backoff_base_s=0.02, backoff_max_s=0.2)
    return ClientSettings(url, api_key, limits=EndpointConfig(**{**limits, **kw}))


@pytest.mark.slow
def test_faults_end_completed_or_failed_with_reason_and_no_duplicates(tmp_path):
    reqs = _requests(1000)
    with FakeEndpoint(fault_rate=0.2, always_fail_400=0.01, always_fail_500=0.01, retry_after_s=0.3, hang_s=3.0) as ep:
        with TeacherCache(tmp_path / "c.jsonl") as cache:
            summary = asyncio.run(ask_all(reqs, cache, _settings(ep.base_url), progress=False))
        log = list(ep.log)
    outcomes = Counter(e["outcome"] for e in log)
    assert all(outcomes[f] > 10 for f in ("429", "500", "hang", "malformed_json", "empty_choices", "drop_connection"))

    with TeacherCache(tmp_path / "c.jsonl") as cache:
        answered = {e["key"]: e for e in cache.entries()}
    failed = {f.key: f for f in summary.failures}
    keys = {r.key for r in reqs}
    assert set(answered) | set(failed) == keys and not set(answered) & set(failed)
    lines = (tmp_path / "c.jsonl").read_text().splitlines()
    assert len(lines) == len(answered) == summary.completed  # one line per key, no duplicates
    for r in reqs:
        if r.key in answered:
            assert answered[r.key]["response"]["content"] == expected_answer(r.body["messages"][0]["content"])
            assert answered[r.key]["request"] == r.identity
    reasons = Counter(f.reason.split(":")[0] for f in summary.failures)
    assert set(reasons) == {"http_400", "http_500"}, reasons
    # 400 cannot succeed: asked exactly once; 500 is retried up to the cap
    attempts_by_prompt = Counter(e["prompt"] for e in log)
    for f in summary.failures:
        prompt = next(r.body["messages"][0]["content"] for r in reqs if r.key == f.key)
        assert attempts_by_prompt[prompt] == (1 if f.reason.startswith("http_400") else 4)
    # retry-after honoured: the retry of a 429 came no sooner than the header said
    first = {e["prompt"]: e["time"] for e in log if e["outcome"] == "429"}
    second = {e["prompt"]: e["time"] for e in log if e["attempt"] == 2 and e["prompt"] in first}
    assert second and min(second[p] - first[p] for p in second) >= 0.3 - 0.02
    assert summary.retries >= sum(outcomes[f] for f in ("429", "hang", "malformed_json", "empty_choices"))


def test_rerun_asks_only_for_missing(tmp_path):
    reqs = _requests(30)
    with FakeEndpoint() as ep:
        with TeacherCache(tmp_path / "c.jsonl") as cache:
            asyncio.run(ask_all(reqs[:10], cache, _settings(ep.base_url), progress=False))
        with TeacherCache(tmp_path / "c.jsonl") as cache:
            s = asyncio.run(ask_all(reqs + reqs[:5], cache, _settings(ep.base_url), progress=False))
        prompts = Counter(e["prompt"] for e in ep.log)
    assert (s.requested, s.already_cached, s.completed) == (30, 10, 20)
    assert set(prompts.values()) == {1} and len(prompts) == 30


def test_unreachable_endpoint_fails_fast_naming_the_url(tmp_path):
    t0 = time.perf_counter()
    with TeacherCache(tmp_path / "c.jsonl") as cache:
        with pytest.raises(EndpointError, match=r"cannot reach the teacher endpoint http://127.0.0.1:9/v1"):
            asyncio.run(ask_all(_requests(5), cache, _settings("http://127.0.0.1:9/v1"), progress=False))
    assert time.perf_counter() - t0 < 15


def test_wrong_api_key_aborts_before_any_request(tmp_path):
    with FakeEndpoint(api_key="right") as ep:
        with TeacherCache(tmp_path / "c.jsonl") as cache:
            with pytest.raises(EndpointError, match="rejected the API key"):
                asyncio.run(ask_all(_requests(5), cache, _settings(ep.base_url, api_key="wrong"), progress=False))
        assert ep.log == []
        with TeacherCache(tmp_path / "c.jsonl") as cache:
            s = asyncio.run(ask_all(_requests(5), cache, _settings(ep.base_url, api_key="right"), progress=False))
        assert s.completed == 5


def test_wrong_model_name_is_named(tmp_path):
    with FakeEndpoint(model="served") as ep, TeacherCache(tmp_path / "c.jsonl") as cache:
        with pytest.raises(EndpointError, match="model 'fake-teacher' is not served"):
            asyncio.run(ask_all(_requests(3), cache, _settings(ep.base_url), progress=False))


def test_an_endpoint_failing_everything_is_stopped_early(tmp_path):
    with FakeEndpoint(always_fail_400=1.0) as ep, TeacherCache(tmp_path / "c.jsonl") as cache:
        with pytest.raises(EndpointError, match="first 20 teacher requests all failed"):
            asyncio.run(ask_all(_requests(500), cache, _settings(ep.base_url, concurrency=4), progress=False))
        assert len(ep.log) < 40


_ULIMIT_SCRIPT = r"""
import asyncio, json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
sys.path.insert(0, "tests")
from fake_endpoint import FakeEndpoint
from ars_opd.config import EndpointConfig
from ars_opd.teacher.client.cache import TeacherCache, cache_key
from ars_opd.teacher.client.chat import TeacherRequest, ask_all
from ars_opd.teacher.client.endpoint import ClientSettings
reqs = []
for i in range(600):
    ident = {"model": "fake-teacher", "messages": [{"role": "user", "content": f"u {i}"}]}
    reqs.append(TeacherRequest(cache_key(ident), {**ident, "max_tokens": 4}, ident))
with FakeEndpoint(latency_s=0.05) as ep, TeacherCache(sys.argv[1]) as cache:
    limits = EndpointConfig(concurrency=64, request_timeout_s=10)
    s = asyncio.run(ask_all(reqs, cache, ClientSettings(ep.base_url, limits=limits), progress=False))
print(json.dumps({"completed": s.completed, "failed": s.failed,
                  "limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}))
"""


def test_concurrency_64_under_ulimit_256(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _ULIMIT_SCRIPT, str(tmp_path / "c.jsonl")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"completed": 600, "failed": 0, "limit": 256}
