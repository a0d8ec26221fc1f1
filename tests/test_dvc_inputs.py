"""Through real `dvc status` / `dvc repro` in a temporary git copy (one copy, to keep it fast): local inputs
are deps, and a stage run by an interpreter without the packages fails clearly without deleting committed
outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from micro import repo_copy, run_in, write_micro_params
from test_dvc_pipeline import REPO
from tiny_models import save_tiny_model

DVC = str(Path(sys.executable).parent / "dvc")


def _git_repo(tmp_path: Path, extra: dict | None = None) -> Path:
    work = repo_copy(tmp_path / "repo")
    write_micro_params(REPO, work / "params.yaml", extra)
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "micro"],
    ):
        assert run_in(cmd, work).returncode == 0
    return work


def _alpaca_rows(n: int) -> list[dict]:
    # U+2028, U+2029 and U+0085 inside strings: valid JSON Lines that str.splitlines() would break apart
    return [
        {
            "instruction": f"Join these lines:\u2028first {i}\u2028second",
            "input": f"caf\u00e9\u0085next {i}",
            "output": f"first second {i}\u2029",
        }
        for i in range(n)
    ]


def _status(work: Path, *stages: str) -> str:
    out = run_in([DVC, "status", *stages], work)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow
def test_dvc_tracks_local_inputs_and_refuses_changed_models_and_a_bare_python_stops_clearly(
    tmp_path, char_tokenizer, monkeypatch
):
    from ars_opd.checks import check_outputs
    from ars_opd.config import PathsConfig
    from ars_opd.models.loading import ModelPinError, load_model

    ext = tmp_path / "outside"  # outside the repository, as a user's files usually are
    ext.mkdir()
    data = ext / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _alpaca_rows(80)), encoding="utf-8")
    model = save_tiny_model(ext / "model", char_tokenizer)
    work = _git_repo(
        tmp_path,
        {
            "data": {"source": str(data)},
            "models": {"teacher": str(model), "student": str(model)},
            "inputs": {"data": str(data), "teacher": str(model), "student": str(model)},
        },
    )

    first = run_in([DVC, "repro", "subset", "models"], work)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "up to date" in _status(work, "subset", "models")
    paths = yaml.safe_load((work / "params.yaml").read_text())["paths"]
    stats = json.loads((work / paths["subset_stats"]).read_text())
    assert stats["malformed"] == 0 and stats["selected"] == 60 and stats["source_sha256"]
    check = run_in([sys.executable, "-m", "ars_opd.cli", "check", "--stages", "models,subset"], work)
    assert check.returncode == 0, check.stderr

    # one more row in the data file: subset is reported changed, models is not
    with open(data, "a", encoding="utf-8") as f:
        f.write(json.dumps({"instruction": "one more", "output": "row"}) + "\n")
    status = _status(work, "subset")
    assert "subset:" in status and f"modified:           {data}" in status, status
    assert "up to date" in _status(work, "models")

    # other weights in the model directory: models is reported changed, and a load is refused until re-pinned
    save_tiny_model(model, char_tokenizer, seed=1)
    status = _status(work, "models")
    assert "models:" in status and f"modified:           {model}" in status, status
    with pytest.raises(ModelPinError, match="Run `dvc repro`"):
        load_model(work / paths["models_dir"], "teacher")
    monkeypatch.chdir(work)  # ars-opd check names both changes too
    problems = "\n".join(check_outputs(PathsConfig(**paths), ("models", "subset")))
    assert f"teacher: the teacher model directory {model} changed after the models stage pinned it" in problems
    assert f"the data source {data} changed after the subset stage read it" in problems
    again = run_in([DVC, "repro", "models", "subset"], work)
    assert (
        again.returncode == 0 and "Running stage 'models'" in again.stdout and "Running stage 'subset'" in again.stdout
    )
    load_model(work / paths["models_dir"], "teacher")
    assert (
        "up to date" in _status(work, "subset", "models")
        and check_outputs(PathsConfig(**paths), ("models", "subset")) == []
    )
    _bare_python_stops_clearly_and_keeps_committed_outputs(tmp_path, work, paths)


def _bare_python_stops_clearly_and_keeps_committed_outputs(tmp_path: Path, work: Path, paths: dict) -> None:
    """`.venv/bin/dvc repro` without the venv on PATH: the stage's `python` lacks the packages."""
    committed = {
        p: (work / p).read_bytes() for p in (paths["subset_metrics"], paths["subset_stats"], paths["models_metrics"])
    }
    fake_bin = tmp_path / "bin"  # a `python` first on PATH without site-packages (-S), as a system one
    fake_bin.mkdir()
    (fake_bin / "python").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    (fake_bin / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    bare = subprocess.run(
        [DVC, "repro", "-f", "subset"], cwd=work, env=env, capture_output=True, text=True, timeout=300
    )
    assert bare.returncode != 0
    out = bare.stdout + bare.stderr
    assert "has no yaml, numpy, torch, transformers" in out and "source .venv/bin/activate" in out
    assert "make repro" in out and "Traceback" not in out
    for p, content in committed.items():  # persist: true, so DVC did not delete them before the failed run
        assert (work / p).read_bytes() == content, p


def test_the_environment_check_runs_before_any_stage_import():
    bare = subprocess.run(
        [sys.executable, "-S", "-m", "stages.subset"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert bare.returncode == 3 and bare.stdout == ""
    assert bare.stderr.startswith(f"ars-opd stage: this Python ({sys.executable}")
    assert "has no yaml, numpy, torch, transformers" in bare.stderr and "Traceback" not in bare.stderr
