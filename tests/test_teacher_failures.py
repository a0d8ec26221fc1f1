"""teacher_gen failures: a report that survives a failed run, refusals not re-asked, empty answers not cached."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from ars_opd.artifacts import read_jsonl
from ars_opd.teacher.client.endpoint import EndpointError
from ars_opd.teacher.client.generate import TeacherGenerationError, generate_teacher_completions
from fake_endpoint import FakeEndpoint, _bucket
from test_teacher_gen_stage import _cfg, _workspace


@pytest.fixture
def in_tmp(tmp_path):
    cwd = os.getcwd()
    yield tmp_path
    os.chdir(cwd)


def _prompts(paths) -> list[str]:
    return [
        r["messages"][-1]["content"]
        for split in ("train", "eval")
        for r in read_jsonl(getattr(paths, f"subset_{split}"))
    ]


def test_failed_run_reports_every_reason_and_does_not_re_ask_refusals(in_tmp):
    paths = _workspace(in_tmp, n=60, eval_size=10)
    prompts = _prompts(paths)
    with FakeEndpoint(always_fail_400=0.15, always_fail_500=0.15) as ep:
        refused = {p for p in prompts if ep.fault_for(p, 1) == "400"}
        broken = {p for p in prompts if ep.fault_for(p, 1) == "500"}
        assert refused and broken
        with pytest.raises(TeacherGenerationError) as err:
            generate_teacher_completions(_cfg(ep.base_url, max_attempts=2), paths, progress=False)
        message = str(err.value)
        # every reason is named with its count and what a rerun does, not just the first few examples
        assert f"http_400 x{len(refused)}: Error code: 400" in message and "bad request (injected)" in message
        assert f"http_500 x{len(broken)}" in message
        assert "http_400" in message.split("not asked again")[0].splitlines()[-1]
        assert f"A rerun asks again the {len(broken)} prompt(s)" in message
        assert f"does not change the {len(refused)}" in message
        assert not Path(paths.teacher_dir).exists()  # the stage's outputs: all or nothing
        report = json.loads(Path(paths.teacher_failure_report).read_text())
        assert report["stage_failed"] and report["failed"] == len(refused) + len(broken)
        assert report["by_kind"]["http_400"]["count"] == len(refused)
        assert report["by_kind"]["http_400"]["rerun"].startswith("not asked again")
        assert report["by_kind"]["http_500"]["rerun"] == "asked again"
        assert Counter(f["reason"].split(":")[0] for f in report["failures"]) == {
            "http_400": len(refused),
            "http_500": len(broken),
        }

        # a rerun asks the 500s again, never the 400s
        n = len(ep.log)
        m = generate_teacher_completions(
            _cfg(ep.base_url, max_attempts=2, max_failure_fraction=0.5), paths, progress=False
        )
        again = {e["prompt"] for e in ep.log[n:]}
        assert again == broken
        assert m["remembered_failures"] == len(refused) and m["failed"] == len(refused) + len(broken)
        failures = read_jsonl(Path(paths.teacher_dir) / "failures.jsonl")
        assert Counter(f["reason"].split(":")[0] for f in failures) == {
            "http_400": len(refused),
            "http_500": len(broken),
        }
        assert set(failures[0]) == {"id", "split", "key", "reason", "attempts"}

        # ... unless asked to
        n = len(ep.log)
        generate_teacher_completions(
            _cfg(ep.base_url, max_attempts=2, max_failure_fraction=0.5, retry_failed=True), paths, progress=False
        )
        assert {e["prompt"] for e in ep.log[n:]} == broken | refused


@pytest.mark.parametrize("temperature, remembered", [(0.0, True), (0.7, False)])
def test_empty_answers_are_never_cached(in_tmp, temperature, remembered):
    paths = _workspace(in_tmp, n=40, eval_size=8)
    prompts = _prompts(paths)
    with FakeEndpoint(always_empty=0.25) as ep:
        empty = {p for p in prompts if _bucket(p, "empty") < 0.25}
        assert empty
        cfg = _cfg(ep.base_url, temperature=temperature, max_failure_fraction=0.5)
        m = generate_teacher_completions(cfg, paths, progress=False)
        assert m["failures_by_reason"] == {"empty_completion": len(empty)}
        cached = [json.loads(line) for line in Path(paths.teacher_cache).read_text("utf-8").split("\n") if line]
        assert len(cached) == len(prompts) - len(empty)
        assert all(e["response"]["content"].strip() for e in cached)
        n = len(ep.log)
        generate_teacher_completions(cfg, paths, progress=False)
        # greedy: the same empty answer again, so not asked; sampled: it may differ, so asked again
        assert {e["prompt"] for e in ep.log[n:]} == (set() if remembered else empty)
    report = json.loads(Path(paths.teacher_failure_report).read_text())
    assert not report["stage_failed"] and report["by_kind"]["empty_completion"]["count"] == len(empty)


def test_a_run_stopped_by_the_endpoint_still_writes_its_report(in_tmp):
    paths = _workspace(in_tmp, n=40, eval_size=8)
    with FakeEndpoint(always_fail_500=1.0) as ep:
        with pytest.raises(EndpointError, match="all failed"):
            generate_teacher_completions(_cfg(ep.base_url, max_attempts=1, concurrency=2), paths, progress=False)
    report = json.loads(Path(paths.teacher_failure_report).read_text())
    assert report["stage_failed"] and report["failed"] == 40
    assert report["by_kind"]["http_500"]["count"] >= 20 and "not_asked" in report["by_kind"]
    assert report["by_kind"]["not_asked"]["rerun"] == "asked again"


def test_refusals_file_passes_the_check(in_tmp):
    from ars_opd.checks import Problems, _read_jsonl

    paths = _workspace(in_tmp, n=40, eval_size=8)
    with FakeEndpoint(always_fail_400=0.2) as ep:
        generate_teacher_completions(_cfg(ep.base_url, max_failure_fraction=0.5), paths, progress=False)
    problems = Problems()
    rows = _read_jsonl(Path(paths.teacher_refusals), problems, ("key", "request", "failure"))
    assert problems == [] and rows and all(r["failure"]["status"] == 400 for r in rows)
