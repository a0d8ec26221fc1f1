"""The ``models`` stage: produce the shared tokenizer, the teacher and the student base, and pin them.

Built-in default (``models.teacher: builtin``): build the character + whole-word tokenizer, train a tiny
teacher on the synthetic tasks until it is good at them (held-out exact match is reported, and gated by
``models.teacher_training.min_accuracy``), and initialise a smaller student. Deterministic for a seed.

Pretrained (hub ids or local directories): resolve and pin each model (commit hash or file hash), load
both tokenizers, refuse a pair that does not share one, and save the shared tokenizer. Weights stay where
they are (hub cache or the local directory); the manifest says exactly which files later stages load.

A local ``.gguf`` file (``ars_opd.models.gguf``) is read by transformers' own GGUF support and written as a
plain fp32 HF directory here, pinned by the file's sha256; every later stage, and vLLM, reads that directory.
A student ``{prune_from: teacher, keep_layers: ...}`` (``ars_opd.models.pruning``) is made of the pinned
teacher's layers, checked against the teacher run through those layers, and written here; the manifest
records which layers it kept. Its tokenizer is the teacher's by construction.

Output layout (``paths.models_dir``): ``tokenizer/``, ``teacher/`` and ``student/`` (when built, converted or
pruned here), ``manifest.json`` (refs, vocab sizes, embedding rows, parameter counts, provenance),
``teacher_train_log.json`` (built-in only). Metrics go to ``paths.models_metrics``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ars_opd.artifacts import atomic_outputs, provenance, write_json
from ars_opd.config import (
    BUILTIN,
    BaseConfig,
    ConfigError,
    ModelsConfig,
    SyntheticConfig,
    TeacherTrainingConfig,
    is_gguf,
    to_dict,
)
from ars_opd.data import synthetic
from ars_opd.models.builtin import build_causal_lm, count_parameters, exact_match, task_spec, train_builtin_teacher
from ars_opd.models.loading import (
    GGUF,
    MANIFEST,
    PRUNED,
    WRITTEN_SOURCES,
    ModelRef,
    builtin_ref,
    embedding_rows,
    resolve_pretrained,
    sha256_of_files,
    written_ref,
)
from ars_opd.models.tokenizer import build_char_word_tokenizer, check_shared_tokenizer, tokenizer_fingerprint
from ars_opd.seeding import derive_seed

# the text the pruned student's directory is checked on (its logits against the teacher's skipped-layer run)
PRUNE_CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


class TeacherTooWeakError(RuntimeError):
    """The built-in teacher missed ``models.teacher_training.min_accuracy``."""


def weak_teacher_message(accuracy: float, n: int, training: TeacherTrainingConfig) -> str:
    """Why the gate failed and the two params that fix it, with their current values."""
    default_steps = TeacherTrainingConfig().steps
    return (
        f"the built-in teacher reached {accuracy:.1%} exact match on {n} held-out prompts after "
        f"models.teacher_training.steps = {training.steps} steps, below models.teacher_training.min_accuracy = "
        f"{training.min_accuracy:.1%}. Either train it longer: raise models.teacher_training.steps (default "
        f"{default_steps}); or, if you shortened its training on purpose "
        "(a quick trial run), lower models.teacher_training.min_accuracy (0 turns the gate off). Nothing was written."
    )


def _build_builtin(
    out: Path, cfg: ModelsConfig, synth: SyntheticConfig, seed: int, progress: bool
) -> tuple[dict, dict | None]:
    """(metrics, the pruned student's manifest fields or None): the built-in tokenizer and teacher, and the
    built-in student or one pruned from the trained teacher."""
    tokenizer = build_char_word_tokenizer(synthetic.instruction_words())
    tokenizer.save_pretrained(out / "tokenizer")

    teacher = build_causal_lm(cfg.teacher_arch, tokenizer, derive_seed(seed, "teacher-init"))
    pruned = cfg.pruned_student is not None
    student = None if pruned else build_causal_lm(cfg.student_arch, tokenizer, derive_seed(seed, "student-init"))
    prune_extra = None
    t0 = time.perf_counter()
    log = train_builtin_teacher(
        teacher, tokenizer, cfg.teacher_training, synth, derive_seed(seed, "teacher-data"), progress=progress
    )
    train_s = time.perf_counter() - t0
    if pruned:  # made of the trained teacher's layers, written and checked as any pruned student
        teacher.save_pretrained(out / "teacher", safe_serialization=True)
        tokenizer.save_pretrained(out / "teacher")
        prune_extra = _prune_student(out, cfg, str(out / "teacher"), tokenizer)
        student = AutoModelForCausalLM.from_pretrained(str(out / "student"), dtype=torch.float32)
    eval_rows = synthetic.generate(
        cfg.teacher_training.eval_examples,
        seed=derive_seed(seed, "teacher-eval"),
        tasks=synth.tasks,
        spec=task_spec(synth),
    )
    t1 = time.perf_counter()
    teacher_eval = exact_match(teacher, tokenizer, eval_rows)
    student_eval = exact_match(student, tokenizer, eval_rows)
    eval_s = time.perf_counter() - t1
    if teacher_eval["exact_match"] < cfg.teacher_training.min_accuracy:
        raise TeacherTooWeakError(
            weak_teacher_message(teacher_eval["exact_match"], teacher_eval["n"], cfg.teacher_training)
        )
    for role, model in (("teacher", teacher), ("student", student)):
        if not (out / role).exists():
            model.save_pretrained(out / role, safe_serialization=True)
            tokenizer.save_pretrained(out / role)
    write_json(out / "teacher_train_log.json", log)
    return {
        "teacher_params": count_parameters(teacher),
        "student_params": count_parameters(student),
        "teacher_exact_match": teacher_eval["exact_match"],
        "teacher_exact_match_per_task": teacher_eval["per_task"],
        "student_base_exact_match": student_eval["exact_match"],
        "eval_examples": teacher_eval["n"],
        "teacher_final_loss": log[-1]["loss"] if log else None,
        "teacher_train_steps": cfg.teacher_training.steps,
        "teacher_train_seconds": round(train_s, 1),
        "eval_seconds": round(eval_s, 1),
    }, prune_extra


def _pin_one(out: Path, role: str, name: str, revision: str | None, trust_remote_code: bool) -> ModelRef:
    """Pin one pretrained model: a GGUF file is converted into ``out/role``; a hub id or directory is resolved."""
    if is_gguf(name):
        from ars_opd.models.gguf import convert_gguf

        extra = convert_gguf(name, out / role, trust_remote_code)
        return written_ref(out, role, GGUF, extra["gguf_file"], extra)
    return resolve_pretrained(name, revision)


def _prune_student(out: Path, cfg: ModelsConfig, teacher_path: str, tokenizer) -> dict:
    """Write the student made of the teacher's layers to ``out/student``; returns the manifest's extra fields."""
    from ars_opd.models.pruning import decoder_layers, write_pruned

    recipe = cfg.pruned_student
    teacher = AutoModelForCausalLM.from_pretrained(
        teacher_path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code
    ).eval()
    try:
        kept = recipe.layers(len(decoder_layers(teacher)))
    except ConfigError as e:
        raise ConfigError(f"models.student.{e.key}", e.message) from None
    probe = tokenizer.apply_chat_template(PRUNE_CHECK_MESSAGES, add_generation_prompt=True, tokenize=True)
    probe = probe["input_ids"] if hasattr(probe, "keys") else probe
    extra = write_pruned(teacher, kept, out / "student", list(probe))
    tokenizer.save_pretrained(out / "student")
    return {**extra, "keep_layers": to_dict(recipe.keep_layers)}


def _pin_pretrained(out: Path, cfg: ModelsConfig) -> tuple[dict, dict[str, ModelRef]]:
    refs = {"teacher": _pin_one(out, "teacher", cfg.teacher, cfg.teacher_revision, cfg.trust_remote_code)}
    teacher_tok = _tokenizer(refs["teacher"], "teacher", cfg.trust_remote_code)
    if cfg.pruned_student is not None:
        extra = _prune_student(out, cfg, refs["teacher"].path, teacher_tok)
        refs["student"] = written_ref(out, "student", PRUNED, "teacher", extra)
        student_tok = teacher_tok
    else:
        refs["student"] = _pin_one(out, "student", cfg.student, cfg.student_revision, cfg.trust_remote_code)
        student_tok = _tokenizer(refs["student"], "student", cfg.trust_remote_code)
        check_shared_tokenizer(teacher_tok, student_tok)
    if not student_tok.chat_template:
        raise ValueError(
            f"student tokenizer of {refs['student'].name} has no chat template; "
            "prompts are rendered with it, so choose an instruct/chat model"
        )
    student_tok.save_pretrained(out / "tokenizer")
    metrics = {
        f"{role}_params": ref.extra["parameters"]
        for role, ref in refs.items()
        if ref.extra and "parameters" in ref.extra
    }
    return metrics, refs


def _tokenizer(ref: ModelRef, role: str, trust_remote_code: bool):
    try:
        return AutoTokenizer.from_pretrained(ref.path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise RuntimeError(f"cannot load the {role} tokenizer from {ref.name} ({ref.path}): {e}") from None


def prepare_models(
    base: BaseConfig,
    cfg: ModelsConfig,
    synth: SyntheticConfig,
    models_dir: str,
    metrics_path: str,
    progress: bool = True,
) -> dict:
    """Run the models stage; write ``models_dir`` and ``metrics_path`` all or nothing; return the metrics."""
    if base.threads:
        torch.set_num_threads(base.threads)
    with atomic_outputs(models_dir, metrics_path) as (out, metrics_tmp):
        out.mkdir(parents=True)
        if cfg.teacher == BUILTIN:
            metrics, prune_extra = _build_builtin(out, cfg, synth, base.seed, progress)
            refs = {role: builtin_ref(out, role) for role in ("teacher", "student")}
            if prune_extra is not None:
                refs["student"] = written_ref(out, "student", PRUNED, "teacher", prune_extra)
        else:
            metrics, refs = _pin_pretrained(out, cfg)
        paths = {role: Path(ref.path) for role, ref in refs.items()}
        tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"), trust_remote_code=cfg.trust_remote_code)
        manifest = {
            role: {**ref.to_json(), "embedding_rows": embedding_rows(str(paths[role]))} for role, ref in refs.items()
        }
        for role in manifest:  # paths inside models_dir are relative to it, so the manifest is portable
            if refs[role].source in WRITTEN_SOURCES:
                manifest[role]["path"] = role
        if manifest["student"]["source"] == PRUNED:
            manifest["student"]["pruned_from"] = {
                "role": "teacher",
                "revision": manifest["teacher"]["revision"],
                "source": manifest["teacher"]["source"],
            }
        manifest["tokenizer"] = {**tokenizer_fingerprint(tok), "sha256": sha256_of_files(out / "tokenizer")}
        manifest["vocab_rule"] = (
            "logits are compared over the tokenizer's ids only (0..vocab_size-1); embedding rows beyond "
            "the tokenizer are padding and are dropped on both sides"
        )
        manifest["provenance"] = provenance(
            {"base": to_dict(base), "models": to_dict(cfg), "synthetic": to_dict(synth)}
        )
        write_json(out / MANIFEST, manifest)
        metrics["tokenizer_vocab_size"] = manifest["tokenizer"]["vocab_size"]
        metrics["teacher_embedding_rows"] = manifest["teacher"]["embedding_rows"]
        metrics["student_embedding_rows"] = manifest["student"]["embedding_rows"]
        write_json(metrics_tmp, metrics)
    return metrics
