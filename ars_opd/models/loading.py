"""Where each stage's models come from: the manifest of the models stage, and loading exactly what it pinned.

Built-in models (``ars_opd.models.builtin``), models converted from a GGUF file (``ars_opd.models.gguf``) and
students pruned from the teacher (``ars_opd.models.pruning``) are complete HF directories inside the models
stage's output, pinned by the sha256 of their files (a GGUF teacher's revision is its file's sha256).
Pretrained models are not copied into the pipeline's outputs (they can be tens of GB): the manifest
pins them instead, as a hub id plus the resolved commit hash, or a local directory plus a sha256 of its
files. ``load_model``/``load_tokenizer`` read the manifest, so later stages load exactly what was pinned.
Hub access goes through ``huggingface_hub.snapshot_download``: the local cache first, the network only
when allowed (``HF_HUB_OFFLINE`` unset) and needed; offline and absent is a clear error, not a hang.

Every load checks the pin (``model_path``) and refuses a model whose files changed since the models
stage ran (``ModelPinError``, which says to run ``dvc repro``): built-in models by their sha256 (a few
MB), hub models by the snapshot of the pinned commit, local directories by their sha256 with a fast
path: the manifest also records each file's size and mtime_ns, and the directory is rehashed only when
one differs. Limits of the fast path: an edit that keeps a file's size and restores its mtime (e.g.
``touch -r``, or a copy with ``cp -p`` / ``rsync -t`` of same-sized content) passes unseen, as it does for
make; a directory copied elsewhere with new mtimes is rehashed on every load (correct, slower).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ars_opd.artifacts import files_sha256, listed_files
from ars_opd.config import BUILTIN

MANIFEST = "manifest.json"
ROLES = ("teacher", "student")
GGUF, PRUNED = "gguf", "pruned"
# models the models stage writes into its own output (models_dir/<role>), pinned by the sha256 of those files:
# built, converted from a GGUF file, or pruned from the teacher
WRITTEN_SOURCES = (BUILTIN, GGUF, PRUNED)
_SOURCE_WORDS = {BUILTIN: "built-in", GGUF: "GGUF-converted", PRUNED: "pruned"}


# the files that make a model: weights, configs, tokenizer files, chat templates and remote code
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".py", ".tiktoken")


class ModelSourceError(RuntimeError):
    """A model or tokenizer named in params cannot be found or loaded."""


class ModelPinError(ModelSourceError):
    """A pinned model's files no longer match the manifest of the models stage."""


def sha256_of_files(directory: Path, suffixes=MODEL_FILE_SUFFIXES) -> str:
    """One sha256 over a model directory's relevant files (names and bytes, in sorted order)."""
    digest, n = files_sha256(directory, suffixes)
    if not n:
        raise ModelSourceError(f"{directory} holds no model files ({', '.join(suffixes)})")
    return digest


def stat_signature(directory: str | Path) -> dict[str, list[int]]:
    """{relative name: [size, mtime_ns]} of the files ``sha256_of_files`` hashes: the pin's fast path."""
    directory = Path(directory)
    out = {}
    for p in listed_files(directory, MODEL_FILE_SUFFIXES):
        st = p.stat()
        out[str(p.relative_to(directory))] = [st.st_size, st.st_mtime_ns]
    return out


@dataclass(frozen=True)
class ModelRef:
    """Where one role's model comes from, as pinned in the manifest."""

    source: str  # "builtin" | "hub" | "local" | "gguf" | "pruned"
    name: str  # hub id, local path, .gguf file, "builtin", or the role a pruned student comes from
    revision: str | None  # hub commit hash; sha256 of files for builtin, local and pruned; of the file for gguf
    path: str  # directory to load from on this machine
    files: dict[str, list[int]] | None = None  # local only: stat_signature at pin time (the fast path)
    extra: dict | None = None  # what the source adds to the manifest (a GGUF's file, a pruned student's layers)

    def to_json(self) -> dict:
        out = {"source": self.source, "name": self.name, "revision": self.revision, "path": self.path}
        if self.files is not None:
            out["files"] = self.files
        out.update(self.extra or {})
        return out


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
        signature = stat_signature(local)  # before hashing: a change while hashing then fails the fast path
        return ModelRef("local", str(local.resolve()), sha256_of_files(local), str(local.resolve()), signature)
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


def _rerun_hint(models_dir: str | Path) -> str:
    return (
        f"Run `dvc repro` to pin the model as it is now (the models stage reruns and so does every stage "
        f"that uses it), or restore the files pinned in {Path(models_dir) / MANIFEST}."
    )


def _changed_files(pinned: dict[str, list[int]], now: dict[str, list[int]]) -> str:
    added, removed = sorted(set(now) - set(pinned)), sorted(set(pinned) - set(now))
    changed = sorted(f for f in set(now) & set(pinned) if now[f] != pinned[f])
    parts = [
        f"{what} {', '.join(names[:5])}{' …' if len(names) > 5 else ''}"
        for what, names in (("size or time changed:", changed), ("added:", added), ("removed:", removed))
        if names
    ]
    return "; ".join(parts) or "same names, sizes and times"


def verify_pin(models_dir: str | Path, role: str, ref: dict) -> str:
    """The directory of ``role``'s pinned model, after checking its files still match the pin; else
    ``ModelPinError`` naming what changed and saying to run ``dvc repro``."""
    if ref["source"] in WRITTEN_SOURCES:
        path = Path(models_dir) / role
        if not path.is_dir():
            raise ModelSourceError(f"{path} is missing: run the models stage (dvc repro models)")
        digest = sha256_of_files(path)
        pinned = ref.get("files_sha256", ref["revision"])
        if digest != pinned:
            raise ModelPinError(
                f"the {_SOURCE_WORDS[ref['source']]} {role} in {path} was changed after the models stage pinned it "
                f"(sha256 {pinned[:12]}… pinned, {digest[:12]}… now). {_rerun_hint(models_dir)}"
            )
        return str(path)
    if ref["source"] == "hub":
        path = resolve_pretrained(ref["name"], ref["revision"]).path
        if Path(path).name != ref["revision"]:
            raise ModelPinError(
                f"the {role} {ref['name']} was pinned at commit {ref['revision']}, but the local "
                f"Hugging Face cache resolves it to {path}. {_rerun_hint(models_dir)}"
            )
        return path
    path = Path(ref["path"])
    if not (path / "config.json").is_file():
        raise ModelPinError(
            f"the {role} model directory {path} pinned by the models stage is gone (no "
            f"config.json). {_rerun_hint(models_dir)}"
        )
    now = stat_signature(path)
    if ref.get("files") is not None and now == ref["files"]:
        return str(path)  # fast path: same files, sizes and modification times as when pinned
    digest = sha256_of_files(path)
    if digest != ref["revision"]:
        what = _changed_files(ref["files"], now) if ref.get("files") is not None else "contents differ"
        raise ModelPinError(
            f"the {role} model directory {path} changed after the models stage pinned it "
            f"(sha256 {ref['revision'][:12]}… pinned, {digest[:12]}… now; {what}). "
            f"{_rerun_hint(models_dir)}"
        )
    return str(path)  # touched but identical (e.g. copied): correct, rehashed on every load until re-pinned


def model_path(models_dir: str | Path, role: str) -> str:
    """Directory to load ``role``'s model from, as pinned by the models stage, verified (``verify_pin``)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return verify_pin(models_dir, role, read_manifest(models_dir)[role])


def load_tokenizer(models_dir: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The shared tokenizer the models stage checked and saved (``trust_remote_code``: a tokenizer class of
    the model's own code, as ``models.trust_remote_code`` allows)."""
    return AutoTokenizer.from_pretrained(str(Path(models_dir) / "tokenizer"), trust_remote_code=trust_remote_code)


TEACHER_TOKENIZER = "teacher_tokenizer"  # under models_dir, written when opd.cross_tokenizer is on
# under models_dir: the pretrained model a student is pruned from when that is not the teacher
# (``models.student.prune_from: <source>``), written there when it is a GGUF file and pinned in the manifest
# under this key like a role
STUDENT_SOURCE = "student_source"


def cross_tokenizer(models_dir: str | Path) -> bool:
    """Whether the models stage pinned a teacher and student that may tokenise differently (``opd.cross_tokenizer``):
    its manifest says so, and the teacher's tokenizer is then saved apart (``load_teacher_tokenizer``)."""
    return bool(read_manifest(models_dir).get("cross_tokenizer", False))


def load_teacher_tokenizer(models_dir: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The teacher's own tokenizer (vocabulary, chat template, special tokens): ``teacher_tokenizer/`` when the
    models stage ran with ``opd.cross_tokenizer``, else the shared one (``load_tokenizer``)."""
    path = Path(models_dir) / TEACHER_TOKENIZER
    if not path.is_dir():
        return load_tokenizer(models_dir, trust_remote_code)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def load_model(
    models_dir: str | Path, role: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> PreTrainedModel:
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


def written_ref(models_dir: str | Path, role: str, source: str, name: str, extra: dict) -> ModelRef:
    """The pin of a model the models stage wrote to ``models_dir/role`` from ``source`` (gguf or pruned): a GGUF
    teacher's revision is its file's sha256 (what the user gave), a pruned student's the sha256 of the files
    written; either way ``files_sha256`` is what ``verify_pin`` checks the directory against."""
    d = Path(models_dir) / role
    files = sha256_of_files(d)
    revision = extra["gguf_sha256"] if source == GGUF else files
    return ModelRef(source, name, revision, str(d), extra={**extra, "files_sha256": files})


def load_model_dir(
    path: str | Path, device: torch.device | str = "cpu", stage: str = "sft", trust_remote_code: bool = False
) -> PreTrainedModel:
    """A model directory written by a training stage (fp32), or a clear error naming the stage to run.

    trust_remote_code: ``models.trust_remote_code``; a student whose architecture is the model's own code
    is saved with that code (``auto_map``), and loading it again needs the same permission as the first load.
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} holds no model: run the {stage} stage first (dvc repro {stage})")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=trust_remote_code).to(
        device
    )


class PinnedModels:
    """The models stage's output, opened once: the manifest, the tokenizers and each pinned model, handed out to
    whatever a stage needs (the student, the teacher, the cross-tokenizer alignment) instead of each reopening
    ``paths.models_dir`` by its directory.

    Each piece is read on first use and kept: the manifest once, each role's pin verified once (``verify_pin``
    hashes the files when their signature changed), each tokenizer loaded once. Sent to a worker process (pickled
    with the job) it travels as its directory alone and opens again there."""

    def __init__(self, models_dir: str | Path, trust_remote_code: bool = False):
        self.root = Path(models_dir)
        self.trust_remote_code = trust_remote_code
        self._cache: dict = {}

    def __getstate__(self) -> dict:
        return {"root": self.root, "trust_remote_code": self.trust_remote_code, "_cache": {}}

    def _once(self, key: str, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def manifest(self) -> dict:
        return self._once("manifest", lambda: read_manifest(self.root))

    def revision(self, role: str) -> str:
        """The revision the models stage pinned ``role`` at (a commit hash or a files' sha256)."""
        return self.manifest[role]["revision"]

    def path(self, role: str) -> str:
        """The directory ``role``'s model loads from, its pin verified (once)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return self._once(f"path:{role}", lambda: verify_pin(self.root, role, self.manifest[role]))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The student's tokenizer (the shared one), as ``load_tokenizer``."""
        return self._once("tokenizer", lambda: load_tokenizer(self.root, self.trust_remote_code))

    @property
    def teacher_tokenizer(self) -> PreTrainedTokenizerBase:
        """The teacher's own tokenizer, as ``load_teacher_tokenizer`` (the shared one unless the run is across
        tokenizers)."""
        if not (self.root / TEACHER_TOKENIZER).is_dir():
            return self.tokenizer
        return self._once("teacher_tokenizer", lambda: load_teacher_tokenizer(self.root, self.trust_remote_code))

    @property
    def cross_tokenizer(self) -> bool:
        return bool(self.manifest.get("cross_tokenizer", False))

    def load(self, role: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
        """``role``'s model exactly as pinned (a fresh copy at each call: the caller owns it)."""
        return AutoModelForCausalLM.from_pretrained(
            self.path(role), dtype=dtype, trust_remote_code=self.trust_remote_code
        )

    def config(self, role: str):
        """``role``'s model config alone (no weights read)."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path(role), trust_remote_code=self.trust_remote_code)
