"""bench/consistency_overhead.py: its summary arithmetic, and one tiny run's JSON line (shape, parts, weights)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "consistency_overhead.py"


def _bench():
    if str(BENCH.parent) not in sys.path:  # as `python bench/consistency_overhead.py` has it: its sibling modules
        sys.path.insert(0, str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("consistency_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_takes_the_median_round_ratio_and_splits_the_overhead_into_parts():
    bench = _bench()
    rounds = [
        {"steps": 10, "with": w, "without": 10.0, "cpu_with": w / 2, "cpu_without": 5.0}
        for w in (10.1, 10.4, 10.2, 13.0, 10.3)
    ]  # one round hit by a load spike
    parts = dict.fromkeys(bench.PARTS, 0.0) | {"hook": 0.5, "drift": 1.0}  # seconds over the 50 steps
    out = bench._summary(rounds, parts, 50)
    assert out["overhead_ratio"] == 1.03 and out["overhead_ratio_min"] == 1.01 and out["overhead_ratio_max"] == 1.3
    assert out["step_s_without"] == 1.0 and out["cpu_step_s_without"] == 0.5 and out["cpu_overhead_ratio"] == 1.03
    assert out["parts"]["hook"] == {"ms_per_step": 10.0, "pct_of_step": 1.0}
    assert out["parts"]["drift"] == {"ms_per_step": 20.0, "pct_of_step": 2.0}
    assert out["parts_ms_per_step"] == 30.0 and out["unattributed_ms"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.ddp
@pytest.mark.slow
def test_tiny_run_prints_one_json_line_with_every_part_and_identical_weights():
    args = [
        "--preset",
        "tiny",
        "--rounds",
        "2",
        "--round-steps",
        "4",
        "--drift-every",
        "2",
        "--warmup",
        "1",
        "--micro",
        "2",
        "--seq",
        "16",
    ]
    r = subprocess.run([sys.executable, str(BENCH), *args], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    out = lines[0]
    assert out["workers"] == 2 and out["rounds"] == 2 and out["round_steps"] == 4 and len(out["round_ratios"]) == 2
    assert out["overhead_ratio_min"] <= out["overhead_ratio"] <= out["overhead_ratio_max"]
    assert out["step_s_without"] > 0 and out["cpu_step_s_without"] > 0
    assert set(out["parts"]) == {"hook", "stats", "metrics", "noise_scale", "drift", "drift_gather"}
    assert all(p["ms_per_step"] > 0 for p in out["parts"].values())  # every part ran and was timed
    assert out["weights_identical"] is True  # the monitor only observes
    assert r.stderr.count("round ") >= 2
    bad = subprocess.run(
        [sys.executable, str(BENCH), "--round-steps", "3"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--drift-every" in bad.stderr
