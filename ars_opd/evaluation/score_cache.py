"""The evaluate stage's store of scored models, for sweeps: on only where ``ARS_OPD_EVAL_CACHE`` names a directory.

A sweep of DVC experiments evaluates the same models again and again. Every experiment scores the base student and
the teacher; every arm of a seed scores that seed's SFT student and the study's pinned start; an arm whose control
DVC did not rerun (its settings unchanged) scores the control's final model and all its snapshots again. Scoring
a model (``scoring.score_model``) is a function of its files, the teacher's, the held-out prompts, the evaluate
section and the code alone: greedy answers, and reverse-KL samples drawn after ``torch.manual_seed(evaluate.seed)``
for each model. So each score is stored under the sha256 of all of these and read back instead of recomputed,
and the stage writes the same files, byte for byte (JSON gives a float back exactly).

What the key covers:

- the model: the sha256 of its directory's files (a training stage's snapshots left out: each is a model of its
  own), or for the base student and the teacher the revision the models stage pinned and verified;
- the models stage's manifest (every pinned model and the tokenizer) and the tokenizer's files; in a
  cross-tokenizer run (the manifest's ``cross_tokenizer``) both tokenizers' files, the student's and the
  teacher's own, and the flag itself, so that no score of a same-tokenizer run (an exact reverse KL, the teacher
  scored in the shared tokens) is ever read back for a cross-tokenizer one, or the other way round
  (``tokenizers_context``);
- the held-out rows and their encoded prompts and completions (in a cross-tokenizer run also their encoding in
  the teacher's own tokens);
- the whole evaluate section (device, dtypes, threads, seeds, lengths), ``models.trust_remote_code``;
- every ``.py`` file of the ``ars_opd`` package and the Python, torch and transformers versions: after any
  code change the store starts afresh.

Not a parameter: where scores are stored cannot change a result, and a path in params.yaml would make DVC rerun
the stage when it moved. A stored score is one JSON file, written whole (a temporary file renamed), so a crash
leaves no half entry; an unreadable one is scored again and replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ars_opd.artifacts import code_fingerprint, dumps_canonical, file_sha256, listed_files

ENV = "ARS_OPD_EVAL_CACHE"
Score = tuple[dict, list[str]]


def _sha256_json(obj) -> str:
    return hashlib.sha256(dumps_canonical(obj).encode()).hexdigest()


def dir_sha256(directory: str | Path, skip: tuple[str, ...] = ("snapshots",)) -> str:
    """sha256 over a directory's files (each one's relative name and sha256, sorted), leaving out the top-level
    entries named in ``skip``."""
    directory = Path(directory)
    files = [p.relative_to(directory) for p in listed_files(directory, None)]
    return _sha256_json([[str(rel), file_sha256(directory / rel)] for rel in files if rel.parts[0] not in skip])


def code_versions() -> dict:
    """The code a score depends on: every module of the package, and the versions of what runs it."""
    import torch
    import transformers

    return {
        "ars_opd": code_fingerprint(),
        "python": sys.version,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


class ScoreCache:
    """Scores stored by key in ``directory``; ``context`` is what every key shares (see the module's docstring)."""

    def __init__(self, directory: str | Path, context: dict):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.context = _sha256_json(context)
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_env(cls, context: Callable[[], dict]) -> "ScoreCache | None":
        """The store ``ARS_OPD_EVAL_CACHE`` names, or None when it is unset or empty (``context`` is built only
        when there is one: hashing costs a read of every file)."""
        directory = os.environ.get(ENV, "").strip()
        return cls(directory, context()) if directory else None

    def key(self, model: str, data_key: str, is_teacher: bool) -> str:
        return _sha256_json({"context": self.context, "model": model, "data": data_key, "is_teacher": is_teacher})

    def score(self, model: str, data_key: str, is_teacher: bool, compute: Callable[[], Score]) -> Score:
        """The stored score for this model on this data, or ``compute()``'s, stored."""
        path = self.directory / f"{self.key(model, data_key, is_teacher)}.json"
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            metrics, texts = stored["metrics"], stored["texts"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        else:
            self.hits += 1
            return metrics, texts
        metrics, texts = compute()
        text = json.dumps({"metrics": metrics, "texts": texts}, ensure_ascii=False)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        self.misses += 1
        stored = json.loads(text)  # what a later hit returns, so a first run and a rerun go on from the same objects
        return stored["metrics"], stored["texts"]

    def summary(self) -> str:
        n = self.hits + self.misses
        return f"scores: {self.hits} of {n} read from {self.directory} ({ENV}), {self.misses} computed"


def data_sha256(
    rows: list[dict],
    prompts: list[list[int]],
    completions: list[list[int]],
    checkable: list[bool],
    teacher: str | None = None,
) -> str:
    """The held-out data as scored: its rows, and their prompts and completions as token ids; ``teacher``: the
    key of the same rows in the teacher's own tokens (a cross-tokenizer run), None where there is none."""
    data = {"rows": rows, "prompts": prompts, "completions": completions, "checkable": checkable}
    if teacher is not None:
        data["teacher"] = teacher
    return _sha256_json(data)


TOKENIZER, TEACHER_TOKENIZER = "tokenizer", "teacher_tokenizer"  # under the models stage's output


def tokenizers_context(models_dir: str | Path, cross: bool) -> dict:
    """The tokenizers every stored score depends on: the shared (student's) tokenizer's files, and in a
    cross-tokenizer run (``cross``: ``ars_opd.models.loading.cross_tokenizer``) the flag and the teacher's own
    tokenizer's files (``teacher_tokenizer/``, or the shared one's where the models stage saved none, as
    ``load_teacher_tokenizer`` reads it). A same-tokenizer run's context is the one it always was."""
    models_dir = Path(models_dir)
    out = {"tokenizer": dir_sha256(models_dir / TOKENIZER)}
    if cross:
        teacher = models_dir / TEACHER_TOKENIZER
        out["cross_tokenizer"] = True
        out["teacher_tokenizer"] = dir_sha256(teacher if teacher.is_dir() else models_dir / TOKENIZER)
    return out
