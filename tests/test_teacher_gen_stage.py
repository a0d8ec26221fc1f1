"""The teacher_gen stage end to end: fake endpoint (faults, kill -9 and resume) and the bundled server."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from ars_opd.artifacts import read_jsonl, write_jsonl
from ars_opd.config import DataConfig, PathsConfig, SyntheticConfig, TeacherGenConfig, parse_section
from ars_opd.data.subset import make_subset
from ars_opd.teacher.client.generate import (
    TeacherGenerationError,
    build_requests,
    generate_teacher_completions,
    strip_thinking,
)
from fake_endpoint import FakeEndpoint, expected_answer
from micro import committed_params

REPO = Path(__file__).resolve().parents[1]


def _workspace(root: Path, n: int = 40, eval_size: int = 8) -> PathsConfig:
    """A directory with a synthetic subset at the default relative paths; chdir into it."""
    os.chdir(root)
    paths = PathsConfig()
    res = make_subset(DataConfig(subset_size=n, eval_size=eval_size), SyntheticConfig(), seed=0)
    Path(paths.subset_train).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(paths.subset_train, res.train)
    write_jsonl(paths.subset_eval, res.eval)
    return paths


def _cfg(url: str, **kw) -> TeacherGenConfig:
    raw = {
        "endpoint": url,
        "model": "fake-teacher",
        "request_timeout_s": 1.0,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.1,
        **kw,
    }
    return parse_section(TeacherGenConfig, raw, "teacher_gen")


@pytest.fixture
def in_tmp(tmp_path):
    cwd = os.getcwd()
    yield tmp_path
    os.chdir(cwd)


def test_strip_thinking():
    assert strip_thinking("<think>\nhmm 2+2\n</think>\n\n4") == "4"
    assert strip_thinking("  <think>a</think>b <think>c</think>") == "b <think>c</think>"
    assert strip_thinking("4 <think>x</think>") == "4 <think>x</think>"  # only a *leading* block
    assert strip_thinking("<think>never closed") == ""


def test_requests_keyed_by_everything_that_determines_the_answer():
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    base = build_requests(rows, _cfg("http://x/v1"), "m", "rev1")[0]
    assert base.body == {
        "model": "m",
        "messages": rows[0]["messages"],
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 32,
    }
    variants = [
        build_requests(rows, _cfg("http://x/v1", temperature=0.7), "m", "rev1")[0],
        build_requests(rows, _cfg("http://x/v1"), "m", "rev2")[0],
        build_requests(rows, _cfg("http://x/v1"), "m2", "rev1")[0],
        build_requests(rows, _cfg("http://x/v1", system_prompt="Be terse."), "m", "rev1")[0],
        build_requests(rows, _cfg("http://x/v1", max_tokens=8), "m", "rev1")[0],
    ]
    assert len({base.key, *(v.key for v in variants)}) == 6
    assert variants[3].body["messages"][0] == {"role": "system", "content": "Be terse."}
    # the endpoint URL and API key never enter the key or the cached request
    other_url = build_requests(rows, _cfg("http://elsewhere/v1"), "m", "rev1")[0]
    assert other_url.key == base.key and "api_key" not in json.dumps(base.identity)


def test_stage_against_faulty_endpoint_writes_ordered_outputs_and_lists_failures(in_tmp):
    paths = _workspace(in_tmp, n=120, eval_size=20)
    with FakeEndpoint(fault_rate=0.3, always_fail_500=0.05, hang_s=2.0) as ep:
        with pytest.raises(TeacherGenerationError, match=r"http_500"):
            generate_teacher_completions(_cfg(ep.base_url, max_attempts=3), paths, progress=False)
        assert not Path(paths.teacher_dir).exists()  # nothing half-done
        asked_first = Counter(e["prompt"] for e in ep.log)
        m = generate_teacher_completions(
            _cfg(ep.base_url, max_attempts=3, max_failure_fraction=0.2), paths, progress=False
        )
        # the second run asked only for the prompts that had failed
        asked_second = Counter(e["prompt"] for e in ep.log) - asked_first
        assert set(asked_second) and all(asked_first[p] == 3 for p in asked_second)
    failures = read_jsonl(Path(paths.teacher_dir) / "failures.jsonl")
    assert m["failed"] == len(failures) > 0 and {f["reason"].split(":")[0] for f in failures} == {"http_500"}
    for split, source in (("train", paths.subset_train), ("eval", paths.subset_eval)):
        out = read_jsonl(paths.completions(split))
        ids = [r["id"] for r in read_jsonl(source) if r["id"] not in {f["id"] for f in failures}]
        assert [r["id"] for r in out] == ids  # subset order, failures left out
        for r in out:
            assert r["completion"] == expected_answer(r["messages"][-1]["content"])
    assert m["train_rows"] + m["eval_rows"] + m["failed"] == m["prompts"] == 120
    metrics = json.loads(Path(paths.teacher_metrics).read_text())
    assert metrics["failures_by_reason"] == {"http_500": m["failed"]}
    # the answer cache (a DVC output) is in key order, not the order the answers arrived in
    keys = [r["key"] for r in read_jsonl(paths.teacher_cache)]
    assert len(keys) == 120 - m["failed"] and keys == sorted(keys)


def test_missing_api_key_is_an_error_before_any_request(in_tmp, monkeypatch):
    paths = _workspace(in_tmp)
    monkeypatch.delenv("ARS_TEST_KEY", raising=False)
    with FakeEndpoint(api_key="s3cret") as ep:
        with pytest.raises(TeacherGenerationError, match="ARS_TEST_KEY.*not set"):
            generate_teacher_completions(_cfg(ep.base_url, api_key_env="ARS_TEST_KEY"), paths, progress=False)
        assert ep.log == []
        monkeypatch.setenv("ARS_TEST_KEY", "s3cret")
        generate_teacher_completions(_cfg(ep.base_url, api_key_env="ARS_TEST_KEY"), paths, progress=False)
    # the key is written nowhere
    for p in Path(in_tmp).rglob("*"):
        if p.is_file():
            assert b"s3cret" not in p.read_bytes(), p


_STAGE = [sys.executable, str(REPO / "stages" / "teacher_gen.py")]


def _write_params(root: Path, url: str, **teacher_gen) -> None:
    params = committed_params()
    params["teacher_gen"].update({"endpoint": url, "model": "fake-teacher", **teacher_gen})
    (root / "params.yaml").write_text(yaml.safe_dump(params))


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_asks_nothing_twice(in_tmp):
    paths = _workspace(in_tmp, n=400, eval_size=40)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with FakeEndpoint(latency_s=0.05) as ep:
        _write_params(in_tmp, ep.base_url, concurrency=4)
        proc = subprocess.Popen(_STAGE, cwd=in_tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cache = Path(paths.teacher_cache)
        deadline = time.monotonic() + 120
        while (not cache.exists() or cache.read_bytes().count(b"\n") < 60) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not Path(paths.teacher_dir).exists()
        raw = cache.read_bytes()
        done_before = {
            json.dumps(json.loads(line)["request"]["messages"], sort_keys=True)
            for line in raw.split(b"\n")
            if line.strip() and line.endswith(b"}") and _valid(line)
        }
        assert 60 <= len(done_before) < 400
        n_first = len(ep.log)

        second = subprocess.run(_STAGE, cwd=in_tmp, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        re_asked = [e for e in ep.log[n_first:] if json.dumps(e["messages"], sort_keys=True) in done_before]
        assert re_asked == []
    lines = cache.read_text().splitlines()
    keys = [json.loads(line)["key"] for line in lines]
    assert len(keys) == len(set(keys)) == 400
    m = json.loads(Path(paths.teacher_metrics).read_text())
    assert m["cached_before_run"] == len(done_before) and m["answered"] == 400 - len(done_before)


def _valid(line: bytes) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


@pytest.mark.slow
def test_stage_end_to_end_with_the_bundled_server_on_micro_models(in_tmp):
    from ars_opd.config import BaseConfig, ModelsConfig
    from ars_opd.data.prompts import encode_prompts
    from ars_opd.lm.generation import decode_completion, generate_token_ids
    from ars_opd.models.loading import load_model, load_tokenizer
    from ars_opd.models.prepare import prepare_models
    from micro import MICRO_OVERRIDES

    paths = _workspace(in_tmp, n=30, eval_size=6)
    prepare_models(
        BaseConfig(threads=1),
        parse_section(ModelsConfig, MICRO_OVERRIDES["models"], "models"),
        SyntheticConfig(),
        paths.models_dir,
        paths.models_metrics,
        progress=False,
    )
    cfg = parse_section(TeacherGenConfig, {"max_tokens": 6, "server": {"threads": 1}}, "teacher_gen")
    log = in_tmp / "requests.jsonl"
    m = generate_teacher_completions(cfg, paths, progress=False, log_requests=str(log))
    assert m["answered"] == m["unique_requests"] and m["failed"] == 0 and m["prompts"] == 30
    # concurrency null: two batches of the server's, resolved when the stage ran and recorded
    manifest = json.loads((Path(paths.teacher_dir) / "manifest.json").read_text())
    assert manifest["config"]["teacher_gen"]["concurrency"] == 2 * 64
    out = read_jsonl(paths.completions("train")) + read_jsonl(paths.completions("eval"))
    # the server's greedy answers equal local greedy generation with the same teacher (independent path)
    tok, teacher = load_tokenizer(paths.models_dir), load_model(paths.models_dir, "teacher")
    ids = generate_token_ids(teacher, tok, encode_prompts(tok, [r["messages"] for r in out]), max_new_tokens=6)
    local = [decode_completion(tok, g) for g in ids]
    nonempty = [(r["completion"], t) for r, t in zip(out, local) if t.strip()]
    assert nonempty and all(a == b for a, b in nonempty)
    n_logged = len(log.read_text().splitlines())
    # a rerun is served from the cache: the server is not even started
    m2 = generate_teacher_completions(cfg, paths, progress=False, log_requests=str(log))
    assert m2["cached_before_run"] == m2["unique_requests"] and m2["answered"] == 0
    assert len(log.read_text().splitlines()) == n_logged
