"""bench/gpu.py --device cpu --tiny: the GPU path's code, run in seconds, importing only torch and transformers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what the GPU machine does not have: importing any of them is an ImportError in the child process
ABSENT = ("dvc", "dvclive", "datasets", "openai", "aiohttp", "pandas", "matplotlib")


@pytest.mark.slow
def test_gpu_bench_tiny_runs_every_workload_without_the_pipelines_other_dependencies():
    code = (
        "import runpy, sys\n"
        f"for name in {ABSENT!r}: sys.modules[name] = None\n"
        "sys.argv = ['bench/gpu.py', '--device', 'cpu', '--tiny']\n"
        "runpy.run_path('bench/gpu.py', run_name='__main__')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    benches = ["sft", "sft_fsdp", "sft_lora", "rollout", "opd_step", "opd_loss", "engine"]
    assert [line["bench"] for line in lines] == benches
    sft, fsdp, lora, rollout, step, loss, engine = lines
    assert "CUDA" in engine["skipped"]  # the engine cases are vLLM on CUDA; here they say so, not a silent pass
    # a world of one: FSDP holds everything (its state is the plain run's); LoRA trains the adapter only
    assert fsdp["state_bytes"] == sft["state_bytes"] and fsdp["tokens_per_s"] > 0 and not fsdp["compiled"]
    assert lora["trainable"] < sft["trainable"] / 4 and lora["state_bytes"] < sft["state_bytes"]
    assert sft["attention"] == "ars_varlen_sdpa" and sft["tokens_per_s"] > 0 and sft["peak_bytes"] > 0
    assert 0 <= sft["padding_fraction"] < 0.5 and sft["mfu"] is None  # no peak FLOP figure for a CPU
    assert rollout["tokens_per_s"] > 0 and rollout["batch"] == 8 and rollout["cache"] == "static"
    assert step["step_ms"] > 0 and step["peak_bytes"] > 0 and step["loss_tokens"] == 192
    assert 0 < loss["extra_bytes_chunked"] < loss["extra_bytes_naive"]
    assert all(math.isfinite(v) for line in lines for v in line.values() if isinstance(v, float))
