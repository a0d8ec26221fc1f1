"""The repository's .gitignore keeps environments and machine-local files out of git."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=work, capture_output=True, text=True, timeout=60)


def test_a_symlinked_venv_is_ignored(tmp_path):
    work = tmp_path / "repo"
    work.mkdir()
    assert _git(work, "init", "-q").returncode == 0
    shutil.copy(REPO / ".gitignore", work / ".gitignore")
    env = tmp_path / "envs" / "ars-opd"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    (work / ".venv").symlink_to(env, target_is_directory=True)  # e.g. an environment shared between clones
    (work / "data" / "teacher_cache").mkdir(parents=True)
    (work / "data" / "teacher_cache" / "last_run_failures.json").write_text("{}")
    (work / "kept.txt").write_text("")
    untracked = _git(work, "status", "--porcelain", "--untracked-files=all").stdout.split("\n")
    assert sorted(line for line in untracked if line) == ["?? .gitignore", "?? kept.txt"]
    assert _git(work, "check-ignore", "-q", ".venv").returncode == 0
    (work / ".venv").unlink()
    (work / ".venv").mkdir()  # a real directory still is
    (work / ".venv" / "x").write_text("")
    assert _git(work, "check-ignore", "-q", ".venv/x").returncode == 0
