"""The models stage's part for several teachers (``teachers.named``): pin, convert or train each, and record it.

Called by ``ars_opd.models.prepare.prepare_models`` in two phases, so that what can fail fast does:

- ``pin_named_teachers`` before the built-in teacher trains: a hub id or a local directory is pinned as
  ``models.teacher`` is (``loading.resolve_pretrained``), a .gguf file converted into ``teachers/<name>/``, and
  each one's tokenizer compared with the student's, since several teachers are offered on the student's tokenizer
  only (a difference is refused, naming the teacher and what differs); an endpoint teacher is recorded by its URL,
  model name and revision (nothing to pin: what it serves is its operator's);
- ``build_named_teachers`` after it: a ``builtin`` teacher is built with ``models.teacher_arch`` (the parameter
  count of the models stage's own teacher) and trained with ``models.teacher_training`` (for its own ``steps`` where
  set) on its own ``tasks`` (default ``synthetic.tasks``), from seeds derived from its name, so two specialists
  differ in their data and initialisation alone; it is gated at ``min_accuracy`` on its own tasks (a specialist is
  not expected to answer the rest) and scored on every task the pipeline's data has, which its metrics report per
  task (how poor a specialist is at the other tasks is part of what it is). A teacher named ``teacher`` points at
  the models stage's own teacher.

Each entry carries ``params_source`` (the source as written in params), which later stages compare with their
params before they trust the manifest (``ars_opd.models.teachers.check_pinned``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ars_opd.artifacts import write_json
from ars_opd.config import (
    BUILTIN,
    ENDPOINT_SOURCE,
    THE_TEACHER,
    ModelsConfig,
    SyntheticConfig,
    TeachersConfig,
    is_gguf,
)
from ars_opd.data import synthetic
from ars_opd.models.builtin import build_causal_lm, count_parameters, exact_match, task_spec, train_builtin_teacher
from ars_opd.models.gguf import convert_gguf
from ars_opd.models.loading import GGUF, ModelRef, builtin_ref, embedding_rows, resolve_pretrained, written_ref
from ars_opd.models.teachers import MANIFEST_KEY, teacher_role
from ars_opd.models.tokenizer import TokenizerMismatchError, tokenizer_differences
from ars_opd.seeding import derive_seed


def _entry(ref: ModelRef, params_source: str, path: str | None = None) -> dict:
    out = {**ref.to_json(), "params_source": params_source, "embedding_rows": embedding_rows(ref.path)}
    if path is not None:  # written inside the models directory: relative, so the manifest is portable
        out["path"] = path
    return out


def pin_named_teachers(
    out: Path, cfg: TeachersConfig, trust_remote_code: bool, student_tok: PreTrainedTokenizerBase
) -> dict[str, dict]:
    """The manifest entries of the pretrained and endpoint teachers, pinned (a GGUF converted) and each pretrained
    one's tokenizer checked against the student's; built-in teachers and ``teacher`` are left to
    ``build_named_teachers``."""
    entries: dict[str, dict] = {}
    for t in cfg.named:
        if t.source in (BUILTIN, THE_TEACHER):
            continue
        if t.is_endpoint:
            ep = t.endpoint
            entries[t.name] = {
                "source": ENDPOINT_SOURCE,
                "params_source": t.source,
                "url": ep.endpoint,
                "model": ep.model,
                "revision": t.revision,
            }
            continue
        role = teacher_role(t.name)
        if is_gguf(t.source):
            (out / role).parent.mkdir(parents=True, exist_ok=True)
            extra = convert_gguf(t.source, out / role, trust_remote_code)
            ref = written_ref(out, role, GGUF, extra["gguf_file"], extra)
            entries[t.name] = _entry(ref, t.source, role)
        else:
            ref = resolve_pretrained(t.source, t.revision)
            entries[t.name] = _entry(ref, t.source)
        tok = AutoTokenizer.from_pretrained(ref.path, trust_remote_code=trust_remote_code)
        differences = tokenizer_differences(tok, student_tok)
        if differences:
            raise TokenizerMismatchError(
                f"teacher {t.name} ({t.source}) does not share the student's tokenizer ({'; '.join(differences)}); "
                "several teachers are offered on the student's tokenizer only (opd.cross_tokenizer serves one "
                "teacher: models.teacher)"
            )
    return entries


def build_named_teachers(
    out: Path,
    cfg: TeachersConfig,
    models: ModelsConfig,
    synth: SyntheticConfig,
    seed: int,
    tokenizer: PreTrainedTokenizerBase | None,
    teacher_ref: ModelRef,
    progress: bool = True,
) -> tuple[dict[str, dict], dict[str, dict]]:
    """(manifest entries, metrics) of the built-in teachers, trained and gated here, and of those named
    ``teacher`` (the models stage's own, ``teacher_ref``). ``tokenizer``: the built-in one (the student's)."""
    entries: dict[str, dict] = {}
    metrics: dict[str, dict] = {}
    for t in cfg.named:
        if t.source == THE_TEACHER:
            entries[t.name] = {
                "source": THE_TEACHER,
                "params_source": t.source,
                "revision": teacher_ref.revision,
                "path": "teacher",
            }
            continue
        if t.source != BUILTIN:
            continue
        if tokenizer is None:  # check_teachers refuses it first; kept for configs built in code
            raise TokenizerMismatchError(
                f"teacher {t.name} is built-in, but the student does not use the built-in tokenizer"
            )
        own = models  # its own training length, the rest of models.teacher_training as it is
        if t.steps is not None:
            own = dataclasses.replace(
                models, teacher_training=dataclasses.replace(models.teacher_training, steps=t.steps)
            )
        entry, metrics[t.name] = _train_builtin(
            out, t.name, t.tasks or synth.tasks, own, synth, seed, tokenizer, progress
        )
        entries[t.name] = entry
    return entries, metrics


def _train_builtin(
    out: Path,
    name: str,
    tasks: tuple[str, ...],
    models: ModelsConfig,
    synth: SyntheticConfig,
    seed: int,
    tokenizer: PreTrainedTokenizerBase,
    progress: bool,
) -> tuple[dict, dict]:
    """One built-in teacher trained on ``tasks``: written to ``teachers/<name>``, gated on its tasks, scored on
    every task of ``synth.tasks`` and its own."""
    # the models stage's own gate and message (prepare imports this module, so not at import time)
    from ars_opd.models.prepare import TeacherTooWeakError, weak_teacher_message

    own = dataclasses.replace(synth, tasks=tuple(tasks))
    model = build_causal_lm(models.teacher_arch, tokenizer, derive_seed(seed, f"teacher-init/{name}"))
    t0 = time.perf_counter()
    log = train_builtin_teacher(
        model, tokenizer, models.teacher_training, own, derive_seed(seed, f"teacher-data/{name}"), progress=progress
    )
    train_s = time.perf_counter() - t0
    every = tuple(dict.fromkeys((*synth.tasks, *tasks)))
    rows = synthetic.generate(
        models.teacher_training.eval_examples,
        seed=derive_seed(seed, f"teacher-eval/{name}"),
        tasks=every,
        spec=task_spec(synth),
    )
    scored = exact_match(model, tokenizer, rows)
    own_rows = [r for r in rows if r["task"] in tasks]
    counts = {t: sum(r["task"] == t for r in own_rows) for t in tasks}
    on_own = sum(round(scored["per_task"].get(t, 0.0) * n) for t, n in counts.items()) / len(own_rows)
    if on_own < models.teacher_training.min_accuracy:
        raise TeacherTooWeakError(
            f"teacher {name} (on its tasks {', '.join(tasks)}): "
            + weak_teacher_message(on_own, len(own_rows), models.teacher_training)
        )
    role = teacher_role(name)
    model.save_pretrained(out / role, safe_serialization=True)
    tokenizer.save_pretrained(out / role)
    entry = {**_entry(builtin_ref(out, role), BUILTIN, role), "tasks": list(tasks)}
    write_json(out / MANIFEST_KEY / f"{name}.train_log.json", log)  # beside its directory, outside its pin
    metrics = {
        "params": count_parameters(model),
        "tasks": list(tasks),
        "exact_match_own_tasks": on_own,
        "exact_match_per_task": scored["per_task"],
        "eval_examples": scored["n"],
        "final_loss": log[-1]["loss"] if log else None,
        "train_steps": models.teacher_training.steps,
        "train_seconds": round(train_s, 1),
    }
    return entry, metrics


def manifest_section(entries: dict[str, dict], cfg: TeachersConfig) -> dict[str, dict]:
    """The manifest's ``teachers`` entries in the params' order."""
    return {t.name: entries[t.name] for t in cfg.named}


__all__ = ["MANIFEST_KEY", "build_named_teachers", "manifest_section", "pin_named_teachers"]
