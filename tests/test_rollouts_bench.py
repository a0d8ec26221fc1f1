"""bench/rollouts.py: its summary arithmetic, and one ``--quick`` run's JSON lines (shape and sanity).

The quick run generates on the trainer path and on the bundled engine (and on vLLM when ``.venv-vllm`` exists),
then syncs weights into each engine; every throughput line must count exactly the tokens its rollouts hold, and
every sync must pass its probe.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from micro import load_committed_params

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "rollouts.py"
THROUGHPUT_KEYS = {
    "kind", "model", "path", "dtype", "batch", "new_tokens", "tokens_per_s", "sampled_tokens", "seconds", "lengths",
    "full_length", "pinned",
}  # fmt: skip
SYNC_KEYS = {
    "kind", "model", "transport", "engine", "dtype", "bytes", "write_s", "load_s", "probe_s", "total_s",
    "probe_max_abs_diff", "probe_bound",
}  # fmt: skip


def _bench():
    spec = importlib.util.spec_from_file_location("rollouts_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_divides_each_path_by_the_trainers_dynamic_path_at_the_same_model_dtype_and_batch():
    def line(path, tps, b=32, dtype="fp32"):
        kind = "rollout_throughput"
        return {"kind": kind, "model": "m", "path": path, "dtype": dtype, "batch": b, "tokens_per_s": tps}

    lines = [line("trainer_dynamic", 100.0), line("vllm", 150.0), line("bundled", 90.0), line("vllm", 300.0, b=128)]
    lines += [{"kind": "opd_step", "lag": 0, "step_s": 1.0}, {"kind": "opd_lag", "lag1_over_lag0": 0.8}]  # not rates
    out = _bench().summary(lines)
    assert out == {
        "kind": "summary",
        "vllm_over_trainer_dynamic": {"m/fp32/B32": 1.5},  # B=128 has no trainer line to divide by
        "bundled_over_trainer_dynamic": {"m/fp32/B32": 0.9},
    }


def test_opd_lag_lines_take_medians_after_the_first_step_from_the_last_checkpoint(tmp_path):
    import statistics

    from bench import opd_lag

    rows = [{"step": i, "step_s": 10.0 + i * i, "task/gen_s": float(i), "task/sync_s": float("nan") if i == 2 else 0.5}
            for i in range(5)]  # fmt: skip
    for step, upto in ((2, 2), (5, 5)):  # an older checkpoint holds fewer rows
        d = tmp_path / f"step_{step:07d}"
        d.mkdir()
        (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:upto]))
    line = opd_lag.step_line(1, tmp_path)
    assert line["steps"] == 5 and line["lag"] == 1
    assert line["step_s"] == statistics.median([11.0, 14.0, 19.0, 26.0])  # step 0 (the first sync) left out
    assert line["gen_s"] == 2.5 and line["sync_s"] == 0.5  # a step without a sync (NaN) is not a zero


def test_opd_lag_says_what_is_missing(tmp_path, monkeypatch):
    import dataclasses

    from bench import opd_lag

    monkeypatch.setenv("ARS_OPD_VLLM_PYTHON", sys.executable)  # an interpreter that exists: only the data is missing
    params = load_committed_params()
    params = dataclasses.replace(params, paths=dataclasses.replace(params.paths, models_dir="data/no-such-models"))
    assert "dvc repro" in opd_lag.problem(params)


@pytest.mark.slow
@pytest.mark.vllm
def test_quick_run_prints_consistent_throughput_and_sync_lines():
    run = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert lines and lines[-1]["kind"] == "summary"
    throughput = [x for x in lines if x["kind"] == "rollout_throughput"]
    has_vllm = (REPO / ".venv-vllm" / "bin" / "python").exists() or bool(os.environ.get("ARS_OPD_VLLM_PYTHON"))
    expected = {"trainer_dynamic", "bundled"} | ({"vllm"} if has_vllm else set())
    assert {x["path"] for x in throughput} == expected
    for x in throughput:
        assert THROUGHPUT_KEYS <= x.keys(), x
        assert (x["model"], x["dtype"], x["batch"], x["new_tokens"]) == ("builtin_student", "fp32", 4, 8)
        assert len(x["lengths"]) == x["batch"] and all(1 <= n <= x["new_tokens"] for n in x["lengths"])
        assert x["sampled_tokens"] == sum(x["lengths"])  # the tokens counted are the rollouts' tokens
        assert x["full_length"] == sum(n == x["new_tokens"] for n in x["lengths"])
        assert x["seconds"] > 0 and x["tokens_per_s"] == pytest.approx(x["sampled_tokens"] / x["seconds"])
        if x["pinned"]:
            assert x["trainer_cpus"] == "1"
            if x["path"] != "trainer_dynamic":
                assert x["engine_cpus"] == "0"
    bundled = next(x for x in throughput if x["path"] == "bundled")
    assert bundled["server_generate_calls"] == 1  # the whole batch in one generate call of the server
    syncs = [x for x in lines if x["kind"] == "sync"]
    assert {x["engine"] for x in syncs} == expected - {"trainer_dynamic"}
    for x in syncs:
        assert SYNC_KEYS <= x.keys(), x
        assert x["transport"] == "filesystem" and x["bytes"] > 0
        assert x["probe_max_abs_diff"] <= x["probe_bound"] < x["probe_separation"]  # fresh, and told apart
        parts = x["state_s"] + x["write_s"] + x["load_s"] + x["probe_s"]
        assert x["total_s"] == pytest.approx(parts, rel=1e-6)
    assert set(lines[-1]) >= {"kind", "bundled_over_trainer_dynamic"}
