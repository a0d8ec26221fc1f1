"""The sft stage on a micro config: outputs, exact resume after kill -9, fresh start on a new config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ars_opd.artifacts import read_jsonl, write_jsonl
from ars_opd.config import BaseConfig, ConfigError, load_params
from ars_opd.models.prepare import prepare_models
from micro import run_stage_here, teacher_rows, write_micro_params

REPO = Path(__file__).resolve().parents[1]
SFT_MICRO = {
    "steps": 60,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "checkpoint_every": 5,
    "warmup_steps": 3,
    "lr": 0.01,
}


def _workspace(root: Path, extra_sft: dict | None = None) -> Path:
    """Micro models and a teacher train split (completions = reference answers) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    write_micro_params(
        REPO,
        root / "params.yaml",
        {"sft": {**SFT_MICRO, **(extra_sft or {})}, "ddp": {"workers": 2, "threads_per_worker": 1}},
    )
    cwd = os.getcwd()
    os.chdir(root)
    try:
        p = load_params(
            "params.yaml", sections=("paths", "models", "synthetic")
        )  # the sft section may be bad on purpose
        if not Path(p.paths.models_dir).exists():
            prepare_models(
                BaseConfig(threads=1), p.models, p.synthetic, p.paths.models_dir, p.paths.models_metrics, progress=False
            )
            Path(p.paths.teacher_dir).mkdir(parents=True)
            write_jsonl(Path(p.paths.teacher_dir) / "train.jsonl", teacher_rows(120, seed=3))
        return root
    finally:
        os.chdir(cwd)


def _stage(root: Path, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "stages.sft"],
        cwd=root,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _manifest(root: Path) -> dict:
    return json.loads((root / "data/sft/log/manifest.json").read_text())


def _weights(root: Path) -> dict:
    return load_file(str(root / "data/sft/model/model.safetensors"))


@pytest.mark.slow
@pytest.mark.ddp
def test_sft_resume_after_kill_is_bit_identical(tmp_path):
    straight = _workspace(tmp_path / "straight")
    run_stage_here(straight, "sft")
    steps = read_jsonl(straight / "data/sft/log/steps.jsonl")
    assert [r["step"] for r in steps] == list(range(60))
    row = steps[0]
    for key in ("loss", "tokens", "lr", "grad_norm", "clip_coef", "clipped_total", "worker_loss", "worker_tokens"):
        assert key in row, key
    # wall-clock seconds go to DVCLive only: an identical retrain must write an identical steps.jsonl
    assert not [k for r in steps for k in r if k.endswith("_s")]
    assert (straight / "data/live/sft/plots/metrics/train/step_s.tsv").is_file()
    assert len(row["worker_loss"]) == 2 and sum(row["worker_tokens"]) == row["tokens"]
    live = json.loads((straight / "data/live/sft/metrics.json").read_text())
    assert live["steps"] == 60 and live["final_loss"] == pytest.approx(steps[-1]["loss"])
    manifest = json.loads((straight / "data/sft/log/manifest.json").read_text())
    assert manifest["data"]["kept"] == 120 and manifest["workers"] == 2

    killed = _workspace(tmp_path / "killed")
    latest = killed / "data/checkpoints/sft/latest.json"
    proc = _stage(killed)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if latest.exists() and json.loads(latest.read_text())["step"] >= 10:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the stage and its DDP workers
    proc.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert killed_at < 60, "the run finished before it could be killed"
    run_stage_here(killed, "sft")
    a, b = _weights(straight), _weights(killed)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # bit-identical
    resumed_steps = read_jsonl(killed / "data/sft/log/steps.jsonl")
    assert [r["loss"] for r in resumed_steps] == [r["loss"] for r in steps]
    assert json.loads((killed / "data/sft/log/manifest.json").read_text())["resumed_from"] >= killed_at


@pytest.mark.slow
@pytest.mark.ddp
def test_changed_config_starts_afresh_and_bad_geometry_is_clear(tmp_path):
    root = _workspace(tmp_path / "w", {"steps": 6, "checkpoint_every": 3})
    run_stage_here(root, "sft")
    _workspace(root, {"steps": 6, "checkpoint_every": 3, "lr": 0.002})
    proc = _stage(root)  # the command, and what it says
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "another configuration, other data or other code; starting afresh" in out
    assert _manifest(root)["resumed_from"] is None
    before = _weights(root)
    run_stage_here(root, "sft")  # nothing changed: the final checkpoint is taken as is
    assert _manifest(root)["resumed_from"] == 6
    assert all(before[k].equal(v) for k, v in _weights(root).items())
    # new teacher completions, same row count and config: must train again, not resume the old run's end
    train = root / "data/teacher/train.jsonl"
    rows = read_jsonl(train)
    write_jsonl(train, [{**r, "completion": r["completion"][::-1] + "!"} for r in rows])
    run_stage_here(root, "sft")
    assert _manifest(root)["resumed_from"] is None
    assert any(not before[k].equal(v) for k, v in _weights(root).items())
    _workspace(root, {"global_batch_size": 6, "micro_batch_size": 2, "steps": 6})  # 6 / 2 workers = 3, not / 2
    with pytest.raises(ConfigError, match="does not divide by sft.micro_batch_size"):
        run_stage_here(root, "sft")


@pytest.mark.slow
@pytest.mark.ddp
def test_empty_training_data_is_a_clear_error(tmp_path):
    root = _workspace(tmp_path / "w", {"steps": 2, "warmup_steps": 1})
    (root / "data/teacher/train.jsonl").write_text("")
    proc = _stage(root)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "no SFT rows left after the budgets" in out
