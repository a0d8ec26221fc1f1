"""A micro configuration of the whole pipeline: seconds per stage, for stage tests; and the params every test
builds its configuration from.

The committed params, not the workspace's: ``make repro-real`` (any ``dvc exp run``/``dvc exp apply``) leaves
its experiment applied to the working ``params.yaml`` and ``dvc.lock``, and a test config built from that file
would carry the experiment (the real profile's ``data.source: inputs/natural_prompts.jsonl``, relative to a
workspace the test does not have). So tests build configs from the file git holds:

- ``committed_params()``: ``params.yaml`` as committed, a fresh mapping per call (edit it freely);
- ``committed_params_file()``: the same text in a file, for what takes a path (``load_params``,
  ``profile_overrides``); ``load_committed_params()`` loads it with relative paths based at the repository;
- ``micro_params`` / ``write_micro_params`` / ``distill_workspace``: the committed params with
  ``MICRO_OVERRIDES`` (and a test's own) merged on;
- ``repo_copy``: the repository's files with ``params.yaml`` and ``dvc.lock`` as committed.

"As committed" is git's index (``git show :params.yaml``): HEAD's file unless a change to it is staged, so a
new default is seen by the suite once it is ``git add``-ed (DVC experiments never stage it). Outside a git
checkout (an unpacked source archive) there is no experiment to apply and the working file is read. The text
is read once per process (``conftest.py`` reads it at session start, so a broken checkout fails there). The
tests about the working file itself (``test_config.py``'s "the workspace's params.yaml loads") read it
directly.
"""

from __future__ import annotations

import atexit
import copy
import functools
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import yaml

REPO = Path(__file__).resolve().parents[1]

# the files an applied DVC experiment rewrites in the workspace
EXPERIMENT_FILES = ("params.yaml", "dvc.lock")

# A directory every pytest-xdist worker of this session shares (conftest.py's session fixture sets it; None
# outside pytest): what ``made_once`` makes lives there.
SESSION_DIR: Path | None = None

# One thread in every process a micro run starts (the models stage, the teacher's servers, evaluate; the DDP
# workers' threads_per_worker): ``make test`` runs two pytest workers on two cores, and a second thread of a
# micro-sized model only waited for a core (the micro models stage took 40 s of a loaded machine at two threads,
# 16 s at one).
MICRO_OVERRIDES = {
    # native kernels: a test that runs a stage in this process (``run_stage_here``: torch here has dispatched
    # already, so a cap can no longer apply) and compares it bit for bit with the same stage as a subprocess needs
    # both on one kernel set; tests/test_cpu_kernels.py exercises the avx2 default on its own params
    "base": {"threads": 1, "cpu_kernels": "native"},
    "models": {
        "teacher_arch": {
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 2,
            "intermediate_size": 64,
        },
        "student_arch": {
            "hidden_size": 16,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 2,
            "intermediate_size": 32,
        },
        # enough steps that the micro teacher answers with something (an empty answer is a failure)
        "teacher_training": {
            "steps": 100,
            "batch_size": 16,
            "lr": 0.01,
            "warmup_steps": 5,
            "eval_examples": 16,
            "min_accuracy": 0.0,
        },
    },
    "data": {"subset_size": 60, "eval_size": 10},
    "teacher_gen": {"max_tokens": 8, "concurrency": 8, "server": {"threads": 1}},
    "ddp": {"workers": 2, "threads_per_worker": 1},
    "sft": {
        "steps": 6,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "warmup_steps": 1,
        "checkpoint_every": 3,
        "snapshot_every": 3,
    },
    "opd": {
        "steps": 4,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "warmup_steps": 1,
        "checkpoint_every": 2,
        "snapshot_every": 2,
        "max_new_tokens": 6,
        "teacher_server": {"threads": 1},
    },
    "evaluate": {"max_examples": 10, "curve_examples": 4, "max_new_tokens": 8, "threads": 1},
    "report": {"window": 4},
}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def committed_text(name: str = "params.yaml", repo_root: Path = REPO) -> str:
    """``name`` (a path relative to ``repo_root``) as git's index holds it, read once per process; the working
    file where ``repo_root`` is not a git checkout. A checkout where git cannot show it (not tracked, an
    unresolved merge) is an error naming the command, never a silent fall back to the working file."""
    return _committed_text(name, Path(repo_root).resolve())


@functools.lru_cache(maxsize=None)
def _committed_text(name: str, repo_root: Path) -> str:
    if not (repo_root / ".git").exists():
        return (repo_root / name).read_text()
    shown = subprocess.run(["git", "show", f":{name}"], cwd=repo_root, capture_output=True, text=True)
    if shown.returncode != 0:
        raise RuntimeError(f"`git show :{name}` in {repo_root} failed: {shown.stderr.strip()}")
    return shown.stdout


def load_study(name: str):
    """The module ``studies/<name>.py``, imported as ``python studies/<name>.py`` sees it (``studies/`` on the path
    only while it loads, so its sibling imports resolve)."""
    studies = str(REPO / "studies")
    sys.path.insert(0, studies)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(studies)


def committed_params(repo_root: Path = REPO) -> dict:
    """``params.yaml``'s committed defaults (``committed_text``), a fresh mapping per call."""
    return yaml.safe_load(committed_text("params.yaml", repo_root))


@functools.lru_cache(maxsize=None)
def committed_params_file() -> Path:
    """A file holding the repository's committed ``params.yaml``, written once per process in a temporary
    directory removed at exit. Its relative paths mean the repository's: pass ``base=REPO`` to ``load_params``
    (``load_committed_params`` does)."""
    directory = Path(tempfile.mkdtemp(prefix="ars-opd-committed-params-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = directory / "params.yaml"
    path.write_text(committed_text("params.yaml"))
    return path


def load_committed_params(sections: tuple[str, ...] | None = None):
    """``load_params`` of the committed ``params.yaml``, relative paths at the repository root."""
    from ars_opd.config import load_params

    return load_params(committed_params_file(), sections=sections, base=REPO)


def micro_params(repo_root: Path = REPO, extra: dict | None = None) -> dict:
    """``repo_root``'s committed params with ``MICRO_OVERRIDES``, then ``extra``, merged on."""
    params = _merge(committed_params(repo_root), MICRO_OVERRIDES)
    return _merge(params, extra or {})


def write_micro_params(repo_root: Path, dest: Path, extra: dict | None = None) -> Path:
    dest.write_text(yaml.safe_dump(micro_params(repo_root, extra), sort_keys=False))
    return dest


def made_once(name: str, make: Callable[[Path], None]) -> Path:
    """``SESSION_DIR / name``, filled by ``make(directory)`` the first time any test of the session asks for it,
    in whichever pytest-xdist worker: the others wait on a file lock and reuse it. For set-up that several
    tests (possibly in several files, so several workers) need the same of: read-only by convention, so a test
    that changes files copies them first. ``name`` must say everything the contents depend on (a hash of the
    config, say); the session's directory is fresh, so code changes between sessions need no key. Outside
    pytest (no ``SESSION_DIR``) ``make`` fills a fresh temporary directory each call."""
    import fcntl

    if SESSION_DIR is None:
        directory = Path(tempfile.mkdtemp(prefix=f"ars-opd-{name}-"))
        make(directory)
        return directory
    directory = SESSION_DIR / name
    SESSION_DIR.mkdir(parents=True, exist_ok=True)
    with open(SESSION_DIR / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = SESSION_DIR / f"{name}.done"
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a make() that raised part way left it
            directory.mkdir()
            make(directory)
            done.write_text("")
    return directory


def micro_models(p) -> Path:
    """The models stage's outputs (``models/`` and ``models.json``) for the params ``p``'s ``models`` and
    ``synthetic`` sections, at one thread: made once per session for each distinct pair (``made_once``; the
    micro teacher's 100 training steps are most of ``distill_workspace``'s set-up)."""
    import hashlib
    import json

    from ars_opd.config import BaseConfig, to_dict
    from ars_opd.models.prepare import prepare_models

    sections = {"models": to_dict(p.models), "synthetic": to_dict(p.synthetic)}
    key = hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()[:16]

    def make(d: Path) -> None:
        prepare_models(BaseConfig(threads=1), p.models, p.synthetic, str(d / "models"), str(d / "models.json"), False)

    return made_once(f"micro-models-{key}", make)


def teacher_rows(n: int, seed: int) -> list[dict]:
    """``n`` synthetic rows in the teacher_gen output schema, the reference answer as the completion."""
    from ars_opd.data import synthetic
    from ars_opd.data.prompts import alpaca_messages

    return [
        {
            "id": str(i),
            "messages": alpaca_messages(r["instruction"], r["input"]),
            "reference": r["output"],
            "task": r["task"],
            "completion": r["output"],
            "finish_reason": "stop",
            "key": str(i),
        }
        for i, r in enumerate(synthetic.generate(n, seed=seed))
    ]


def distill_workspace(repo_root: Path, root: Path, opd: dict, workers: int = 2, models: dict | None = None) -> None:
    """A micro workspace in ``root`` ready for the stages that start from the SFT student (opd,
    sft_continued): params with these ``opd`` overrides and ``workers``, the built-in micro models (``models``:
    overrides of that section, e.g. a teacher vLLM can serve), 64 teacher training rows, and the base student
    standing in as the SFT student (they only need an HF model directory). The models are the models stage's
    outputs for these params, made once per session (``micro_models``) and copied in."""
    import os

    from ars_opd.artifacts import write_jsonl
    from ars_opd.config import load_params
    from ars_opd.models.loading import load_model

    root.mkdir(parents=True, exist_ok=True)
    extra = {"opd": opd, "ddp": {"workers": workers, "threads_per_worker": 1}}
    write_micro_params(repo_root, root / "params.yaml", {**extra, "models": models} if models else extra)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        p = load_params("params.yaml")
        made = micro_models(p)
        shutil.rmtree(p.paths.models_dir, ignore_errors=True)  # a second call on one root replaces them
        shutil.copytree(made / "models", p.paths.models_dir)
        Path(p.paths.models_metrics).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(made / "models.json", p.paths.models_metrics)
        Path(p.paths.teacher_dir).mkdir(parents=True, exist_ok=True)
        write_jsonl(Path(p.paths.teacher_dir) / "train.jsonl", teacher_rows(64, seed=5))
        load_model(p.paths.models_dir, "student").save_pretrained(Path(p.paths.sft_model))
    finally:
        os.chdir(cwd)


def run_opd_in(root: Path) -> tuple[list[dict], dict, dict]:
    """The opd stage in ``root`` (its params.yaml), called in this process: (its step log's rows, rank 0's summary,
    the stage's manifest)."""
    import json
    import os

    from ars_opd.artifacts import read_jsonl
    from ars_opd.config import load_params
    from ars_opd.training.opd.stage import run_opd
    from ars_opd.training.worker import TrainingJob

    cwd = os.getcwd()
    os.chdir(root)
    try:
        p = load_params("params.yaml")
        summary = run_opd(TrainingJob.from_params("opd", p, progress=False))
        files = p.paths.training("opd")
        return read_jsonl(files.steps), summary, json.loads(Path(files.manifest).read_text())
    finally:
        os.chdir(cwd)


def run_stage_here(root: Path, stage: str) -> None:
    """Run ``python -m stages.<stage>`` in ``root`` as this process: the stage's ``main`` here, its workers
    forked from this process's forkserver (started once for the session, instead of a fresh interpreter and
    forkserver that import torch and transformers for every run). Raises what the stage raises. For tests
    that need the stage's outputs; the ones about the command itself (exit codes, messages, kill -9) start
    it as a subprocess."""
    import importlib
    import os

    module = importlib.import_module(f"stages.{stage}")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        module.main()
    finally:
        os.chdir(cwd)


def repo_copy(dest: Path) -> Path:
    """The repository's tracked and untracked-but-not-ignored files, without data/, copied to ``dest``: the
    working files (the code under test), but ``params.yaml`` and ``dvc.lock`` as committed (an experiment
    applied in the workspace is not the default pipeline)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for f in files:
        if f.startswith("data/") or not (REPO / f).is_file():
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        if f in EXPERIMENT_FILES:
            (dest / f).write_text(committed_text(f, REPO))
        else:
            shutil.copy2(REPO / f, dest / f)
    return dest


def run_in(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd`` with this interpreter's bin directory first on PATH (dvc, ars-opd), output captured."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
