"""Where each stage's models come from: the manifest of the models stage, and loading exactly what it pinned.

Built-in models (``ars_opd.models.builtin``) are complete HF directories inside the models stage's output.
Pretrained models are not copied into the pipeline's outputs (they can be tens of GB): the manifest
pins them instead, as a hub id plus the resolved commit hash, or a local directory plus a sha256 of its
files. ``load_model``/``load_tokenizer`` read the manifest, so later stages load exactly what was pinned.
Hub access goes through ``huggingface_hub.snapshot_download``: the local cache first, the network only
when allowed (``HF_HUB_OFFLINE`` unset) and needed; offline and absent is a clear error, not a hang.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ars_opd.artifacts import files_sha256
from ars_opd.config import BUILTIN

MANIFEST = "manifest.json"
ROLES = ("teacher", "student")


class ModelSourceError(RuntimeError):
    """A model or tokenizer named in params cannot be found or loaded."""


def sha256_of_files(directory: Path, suffixes=(".json", ".safetensors", ".bin", ".model", ".txt", ".jinja")) -> str:
    """One sha256 over a model directory's relevant files (names and bytes, in sorted order)."""
    digest, n = files_sha256(directory, suffixes)
    if not n:
        raise ModelSourceError(f"{directory} holds no model files ({', '.join(suffixes)})")
    return digest


@dataclass(frozen=True)
class ModelRef:
    """Where one role's model comes from, as pinned in the manifest."""

    source: str  # "builtin" | "hub" | "local"
    name: str  # hub id, local path, or "builtin"
    revision: str | None  # hub commit hash; sha256 of files for builtin and local
    path: str  # directory to load from on this machine

    def to_json(self) -> dict:
        return {"source": self.source, "name": self.name, "revision": self.revision, "path": self.path}


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_pretrained(name: str, revision: str | None = None) -> ModelRef:
    """Pin a hub id or local directory: local path as is, hub id to a snapshot with its commit hash.

    Raises ``ModelSourceError`` with what to do when the model is neither on disk nor reachable.
    """
    local = Path(name).expanduser()
    if local.exists():
        if not local.is_dir() or not (local / "config.json").exists():
            raise ModelSourceError(f"{name} exists but is not a model directory (no config.json)")
        return ModelRef("local", str(local.resolve()), sha256_of_files(local), str(local.resolve()))
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelSourceError(f"model directory {name} does not exist")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py", "*.tiktoken"]
    try:
        path = snapshot_download(repo_id=name, revision=revision, local_files_only=True, allow_patterns=patterns)
    except Exception as cache_miss:  # not (completely) in the local cache
        if _hub_offline():
            raise ModelSourceError(
                f"{name}{'@' + revision if revision else ''} is not in the local Hugging Face cache and "
                "HF_HUB_OFFLINE is set, so it cannot be downloaded. Download it on a connected machine "
                f"(`hf download {name}`), point HF_HOME at a cache that has it, or set the param to a "
                f"local model directory. ({type(cache_miss).__name__})"
            ) from None
        try:
            path = snapshot_download(repo_id=name, revision=revision, allow_patterns=patterns)
        except Exception as e:
            raise ModelSourceError(
                f"cannot load {name}{'@' + revision if revision else ''}: not in the local Hugging Face cache "
                f"and the hub could not be reached or refused ({type(e).__name__}: {str(e)[:300]}). Check the "
                "name and revision, your network and HF_TOKEN for gated models, or use a local directory."
            ) from None
    commit = Path(path).name  # snapshots/<commit hash>
    return ModelRef("hub", name, commit, str(path))


def read_manifest(models_dir: str | Path) -> dict:
    p = Path(models_dir) / MANIFEST
    if not p.exists():
        raise ModelSourceError(f"{p} not found: run the models stage first (dvc repro models)")
    return json.loads(p.read_text())


def model_path(models_dir: str | Path, role: str) -> str:
    """Directory to load ``role``'s model from, as pinned by the models stage."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    ref = read_manifest(models_dir)[role]
    if ref["source"] == "builtin":
        return str(Path(models_dir) / role)
    if ref["source"] == "hub":
        return resolve_pretrained(ref["name"], ref["revision"]).path
    return ref["path"]


def load_tokenizer(models_dir: str | Path) -> PreTrainedTokenizerBase:
    """The shared tokenizer the models stage checked and saved."""
    return AutoTokenizer.from_pretrained(str(Path(models_dir) / "tokenizer"))


def load_model(models_dir: str | Path, role: str, dtype: torch.dtype = torch.float32,
               trust_remote_code: bool = False) -> PreTrainedModel:
    """Load ``role``'s model exactly as pinned in the manifest."""
    path = model_path(models_dir, role)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)


def embedding_rows(path: str) -> int:
    """Rows of the output vocabulary from a model's config.json (may exceed the tokenizer's size)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    return int(text_cfg["vocab_size"])


def builtin_ref(models_dir: str | Path, role: str) -> ModelRef:
    d = Path(models_dir) / role
    return ModelRef(BUILTIN, BUILTIN, sha256_of_files(d), str(d))


def load_model_dir(path: str | Path, device: torch.device | str = "cpu", stage: str = "sft") -> PreTrainedModel:
    """A model directory written by a training stage (fp32), or a clear error naming the stage to run."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} holds no model: run the {stage} stage first (dvc repro {stage})")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
