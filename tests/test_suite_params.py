"""The suite builds its configs from the committed params.yaml, whatever experiment the workspace has applied.

``make repro-real`` (``ars-opd profile run``: a DVC experiment) leaves the real profile applied to the working
params.yaml, unstaged; a test config built from that file carried the experiment (its ``data.source:
inputs/natural_prompts.jsonl``, relative to a workspace the test does not have) and the stage tests failed on
it. Here a git copy of the repository gets the same: its committed params.yaml, then the real profile merged onto
the working file, as the experiment leaves it; the builders in tests/micro.py must still give the committed
defaults.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

import micro
from ars_opd.config import load_params
from ars_opd.profiles import merged, read_profile
from micro import MICRO_OVERRIDES, committed_params, committed_text, micro_params, write_micro_params

REPO = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def applied_workspace(tmp_path) -> tuple[Path, str]:
    """A git repository holding the committed params.yaml and dvc.lock, then the real profile applied to its
    working params.yaml and its dvc.lock rewritten, neither staged (as ``dvc exp run`` and ``dvc exp apply``
    leave them); and the committed params text."""
    work = tmp_path / "repo"
    work.mkdir()
    committed = committed_text("params.yaml", REPO)
    (work / "params.yaml").write_text(committed)
    (work / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    _git(work, "init", "-q")
    _git(work, "add", "params.yaml", "dvc.lock")
    _git(work, "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "defaults")
    applied = merged(yaml.safe_load(committed), read_profile(REPO / "profiles" / "real.yaml"))
    (work / "params.yaml").write_text(yaml.safe_dump(applied, sort_keys=False))
    (work / "dvc.lock").write_text("schema: '2.0'\nstages: {models: {cmd: python -m stages.models}}\n")
    return work, committed


def test_the_builders_give_the_committed_defaults_after_a_profile_is_applied(applied_workspace, tmp_path):
    work, committed = applied_workspace
    working = yaml.safe_load((work / "params.yaml").read_text())
    assert working["data"]["source"] == "inputs/natural_prompts.jsonl"  # the experiment is in the working file
    defaults = yaml.safe_load(committed)
    assert defaults["data"]["source"] != working["data"]["source"]

    assert committed_text("params.yaml", work) == committed
    assert committed_params(work) == defaults
    built = micro_params(work, {"opd": {"steps": 3}})
    assert built == micro_params(REPO, {"opd": {"steps": 3}})
    assert built["data"]["source"] == defaults["data"]["source"] and built["models"]["teacher"] == "builtin"
    micro_arch = MICRO_OVERRIDES["models"]["teacher_arch"]
    assert {k: built["models"]["teacher_arch"][k] for k in micro_arch} == micro_arch and built["opd"]["steps"] == 3
    # what the stage tests do with it: write it into a bare directory and load it there (where the experiment's
    # params failed: "data.source: no such file or directory: 'inputs/natural_prompts.jsonl'")
    run = tmp_path / "run"
    run.mkdir()
    p = load_params(write_micro_params(work, run / "params.yaml"))
    assert p.data.source == defaults["data"]["source"] and p.models.teacher == "builtin"


def test_repo_copy_takes_params_and_lock_as_committed(applied_workspace, tmp_path, monkeypatch):
    """``repo_copy`` copies the working tree (the code under test), but params.yaml and dvc.lock as committed."""
    work, committed = applied_workspace
    (work / "code.py").write_text("x = 1\n")  # untracked, not ignored: copied as it is
    monkeypatch.setattr(micro, "REPO", work)
    dest = micro.repo_copy(tmp_path / "copy")
    assert (dest / "params.yaml").read_text() == committed
    assert (dest / "dvc.lock").read_text() == "schema: '2.0'\nstages: {}\n"
    assert (dest / "code.py").read_text() == "x = 1\n"


def test_outside_git_the_working_file_is_the_committed_one_and_a_file_git_cannot_show_is_an_error(tmp_path):
    """An unpacked source archive has no git and no experiment: its params.yaml is read. In a checkout, a file
    git's index does not hold is an error naming the command, not a silent read of the working file."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "params.yaml").write_text("data: {}\n")
    assert committed_text("params.yaml", plain) == "data: {}\n"
    (tmp_path / "git").mkdir()
    _git(tmp_path / "git", "init", "-q")
    (tmp_path / "git" / "params.yaml").write_text("data: {}\n")
    with pytest.raises(RuntimeError, match=r"`git show :params.yaml` in .* failed"):
        committed_text("params.yaml", tmp_path / "git")
