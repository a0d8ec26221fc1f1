"""The ``models`` stage: produce the tokenizer(s), the teacher and the student base, and pin them.

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
records which layers it kept. Its tokenizer is the teacher's by construction. ``prune_from`` may also name
another pretrained model (hub id, directory or ``.gguf`` file): that source is pinned like a teacher (a GGUF
converted into ``student_source/``) and the student pruned from it the same way.

Cross tokenizers (``opd.cross_tokenizer``, passed as ``cross_tokenizer``): the teacher and student may tokenise
differently, e.g. the built-in teacher (character tokenizer) beside a student pruned from a real model, since
OPD then scores the student's text under the teacher's own tokenisation, aligned span by span
(``ars_opd.lm.token_alignment``). Either side may then be built-in and the other pretrained. Without the flag a
pair whose tokenizers differ is refused, naming the flag. ``tokenizer/`` is always the student's (every
training stage tokenises with it); with the flag the teacher's own tokenizer (vocabulary, chat template,
special tokens) is also saved to ``teacher_tokenizer/`` (``loading.load_teacher_tokenizer``), even when the
two are identical, so the cross-tokenizer path can run on identical tokenizers as an oracle of itself.

Metrics: with the built-in teacher, its held-out exact match (the gate) and the student's base exact match,
each scored with its own tokenizer; a student that is not built-in nor pruned from the built-in teacher is
scored on the first ``STUDENT_EVAL_ROWS`` eval rows only (``student_eval_examples``): a real student of ~100M
parameters generates slowly on two cores, and its base score on the synthetic tasks is a reference point,
not a gate. With a pretrained teacher no exact match is computed (the synthetic tasks are not its setting).

Output layout (``paths.models_dir``): ``tokenizer/``, ``teacher_tokenizer/`` (with the flag), ``teacher/`` and
``student/`` (when built, converted or pruned here), ``student_source/`` (a GGUF a student is pruned from),
``manifest.json`` (refs, vocab sizes, embedding rows, parameter counts, whether the tokenizers are shared,
provenance), ``teacher_train_log.json`` (built-in teacher only). Metrics go to ``paths.models_metrics``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from ars_opd.artifacts import atomic_outputs, provenance, write_json
from ars_opd.config import (
    BUILTIN,
    BaseConfig,
    ConfigError,
    ModelsConfig,
    SyntheticConfig,
    TeachersConfig,
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
    STUDENT_SOURCE,
    TEACHER_TOKENIZER,
    WRITTEN_SOURCES,
    ModelRef,
    builtin_ref,
    embedding_rows,
    resolve_pretrained,
    sha256_of_files,
    written_ref,
)
from ars_opd.models.prepare_teachers import MANIFEST_KEY, build_named_teachers, manifest_section, pin_named_teachers
from ars_opd.models.tokenizer import (
    TokenizerMismatchError,
    build_char_word_tokenizer,
    mismatch_message,
    tokenizer_differences,
    tokenizer_fingerprint,
)
from ars_opd.seeding import derive_seed

# the text the pruned student's directory is checked on (its logits against the teacher's skipped-layer run)
PRUNE_CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
# most eval rows a student that is not built-in is scored on (greedy generation of a real model on 2 cores)
STUDENT_EVAL_ROWS = 50


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


def _pruned_from_teacher(cfg: ModelsConfig) -> bool:
    recipe = cfg.pruned_student
    return recipe is not None and recipe.prune_from == "teacher"


def _builtin_student(cfg: ModelsConfig) -> bool:
    """The student shares the built-in tokenizer by construction: built-in, or pruned from the built-in teacher."""
    return cfg.student == BUILTIN or (cfg.teacher == BUILTIN and _pruned_from_teacher(cfg))


def _build_builtin(
    out: Path,
    cfg: ModelsConfig,
    synth: SyntheticConfig,
    seed: int,
    progress: bool,
    tokenizer: PreTrainedTokenizerBase,
    refs: dict[str, ModelRef],
    student_tok: PreTrainedTokenizerBase,
) -> dict:
    """Train and gate the built-in teacher, and make the student that depends on it (built-in, or pruned from the
    trained teacher); a student pinned before (pretrained, or pruned from another source: ``refs['student']``) is
    only scored. Adds the teacher's (and a built or pruned student's) ref to ``refs``; returns the metrics."""
    teacher = build_causal_lm(cfg.teacher_arch, tokenizer, derive_seed(seed, "teacher-init"))
    from_teacher = _pruned_from_teacher(cfg)
    builtin_student = cfg.student == BUILTIN
    student = None
    if builtin_student:
        student = build_causal_lm(cfg.student_arch, tokenizer, derive_seed(seed, "student-init"))
    t0 = time.perf_counter()
    log = train_builtin_teacher(
        teacher, tokenizer, cfg.teacher_training, synth, derive_seed(seed, "teacher-data"), progress=progress
    )
    train_s = time.perf_counter() - t0
    if from_teacher:  # made of the trained teacher's layers, written and checked as any pruned student
        teacher.save_pretrained(out / "teacher", safe_serialization=True)
        tokenizer.save_pretrained(out / "teacher")
        prune_extra = _prune_student(out, cfg, str(out / "teacher"), tokenizer)
        refs["student"] = written_ref(out, "student", PRUNED, "teacher", prune_extra)
        student = AutoModelForCausalLM.from_pretrained(str(out / "student"), dtype=torch.float32)
    elif not builtin_student:  # pinned before training: its own weights and its own tokenizer
        student = AutoModelForCausalLM.from_pretrained(
            refs["student"].path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code
        ).eval()
    eval_rows = synthetic.generate(
        cfg.teacher_training.eval_examples,
        seed=derive_seed(seed, "teacher-eval"),
        tasks=synth.tasks,
        spec=task_spec(synth),
    )
    t1 = time.perf_counter()
    teacher_eval = exact_match(teacher, tokenizer, eval_rows)
    if teacher_eval["exact_match"] < cfg.teacher_training.min_accuracy:
        raise TeacherTooWeakError(
            weak_teacher_message(teacher_eval["exact_match"], teacher_eval["n"], cfg.teacher_training)
        )
    # each model answers under its own tokenizer and chat template; a real student only on the first rows
    student_rows = eval_rows if _builtin_student(cfg) else eval_rows[:STUDENT_EVAL_ROWS]
    student_eval = exact_match(student, student_tok, student_rows)
    eval_s = time.perf_counter() - t1
    if not (out / "teacher").exists():
        teacher.save_pretrained(out / "teacher", safe_serialization=True)
        tokenizer.save_pretrained(out / "teacher")
    if builtin_student:
        student.save_pretrained(out / "student", safe_serialization=True)
        tokenizer.save_pretrained(out / "student")
        refs["student"] = builtin_ref(out, "student")
    refs["teacher"] = builtin_ref(out, "teacher")
    write_json(out / "teacher_train_log.json", log)
    return {
        "teacher_params": count_parameters(teacher),
        "student_params": count_parameters(student),
        "teacher_exact_match": teacher_eval["exact_match"],
        "teacher_exact_match_per_task": teacher_eval["per_task"],
        "student_base_exact_match": student_eval["exact_match"],
        "eval_examples": teacher_eval["n"],
        "student_eval_examples": student_eval["n"],
        "teacher_final_loss": log[-1]["loss"] if log else None,
        "teacher_train_steps": cfg.teacher_training.steps,
        "teacher_train_seconds": round(train_s, 1),
        "eval_seconds": round(eval_s, 1),
    }


def _pin_one(out: Path, role: str, name: str, revision: str | None, trust_remote_code: bool) -> ModelRef:
    """Pin one pretrained model: a GGUF file is converted into ``out/role``; a hub id or directory is resolved."""
    if is_gguf(name):
        from ars_opd.models.gguf import convert_gguf

        extra = convert_gguf(name, out / role, trust_remote_code)
        return written_ref(out, role, GGUF, extra["gguf_file"], extra)
    return resolve_pretrained(name, revision)


def _prune_student(out: Path, cfg: ModelsConfig, source_path: str, tokenizer) -> dict:
    """Write the student made of the layers of the model at ``source_path`` (the teacher, or the pinned
    ``prune_from`` source) to ``out/student`` with ``tokenizer`` (the source's); returns the manifest's extra
    fields."""
    from ars_opd.models.pruning import decoder_layers, write_pruned

    recipe = cfg.pruned_student
    source = AutoModelForCausalLM.from_pretrained(
        source_path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code
    ).eval()
    try:
        kept = recipe.layers(len(decoder_layers(source)))
    except ConfigError as e:
        raise ConfigError(f"models.student.{e.key}", e.message) from None
    probe = tokenizer.apply_chat_template(PRUNE_CHECK_MESSAGES, add_generation_prompt=True, tokenize=True)
    probe = probe["input_ids"] if hasattr(probe, "keys") else probe
    extra = write_pruned(source, kept, out / "student", list(probe))
    tokenizer.save_pretrained(out / "student")
    return {**extra, "keep_layers": to_dict(recipe.keep_layers)}


def _pin_student(
    out: Path,
    cfg: ModelsConfig,
    refs: dict[str, ModelRef],
    teacher_tok: PreTrainedTokenizerBase,
    builtin_tok: PreTrainedTokenizerBase | None,
) -> tuple[PreTrainedTokenizerBase, str]:
    """(the student's tokenizer, a name for messages). A pretrained student is pinned and one pruned from another
    source is made here (``refs['student']``, and ``refs[STUDENT_SOURCE]`` for that source), before any training,
    so a missing file or a refused pair fails fast; a student pruned from a pretrained teacher is made here too.
    A built-in student, or one pruned from the built-in teacher, is made by ``_build_builtin`` or the caller."""
    trc = cfg.trust_remote_code
    recipe = cfg.pruned_student
    if recipe is not None and recipe.prune_from == "teacher":
        if "teacher" in refs:  # pretrained teacher, pinned: prune it now
            extra = _prune_student(out, cfg, refs["teacher"].path, teacher_tok)
            refs["student"] = written_ref(out, "student", PRUNED, "teacher", extra)
        return teacher_tok, "the student pruned from the teacher"
    if recipe is not None:
        refs[STUDENT_SOURCE] = _pin_one(out, STUDENT_SOURCE, recipe.prune_from, None, trc)
        tok = _tokenizer(refs[STUDENT_SOURCE], "student source", trc)
        _require_chat_template(tok, "student", recipe.prune_from)  # before the pruning spends time on it
        extra = _prune_student(out, cfg, refs[STUDENT_SOURCE].path, tok)
        refs["student"] = written_ref(out, "student", PRUNED, STUDENT_SOURCE, extra)
        return tok, recipe.prune_from
    if cfg.student == BUILTIN:
        return builtin_tok, BUILTIN
    refs["student"] = _pin_one(out, "student", cfg.student, cfg.student_revision, trc)
    return _tokenizer(refs["student"], "student", trc), refs["student"].name


def _require_chat_template(tok: PreTrainedTokenizerBase, role: str, name: str) -> None:
    """Prompts are rendered with a model's own chat template: refuse, naming the side, a tokenizer without one."""
    if not tok.chat_template:
        raise ValueError(
            f"{role} tokenizer of {name} has no chat template; prompts are rendered with it, so choose an "
            "instruct/chat model"
        )


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
    *,
    cross_tokenizer: bool = False,
    teachers: TeachersConfig | None = None,
) -> dict:
    """Run the models stage; write ``models_dir`` and ``metrics_path`` all or nothing; return the metrics.

    cross_tokenizer: ``opd.cross_tokenizer``; allows a teacher and student whose tokenizers differ (refused,
    naming the flag, without it) and saves the teacher's own tokenizer to ``teacher_tokenizer/``.
    teachers: ``teachers``; with teachers named, each is pinned, converted or trained beside ``models.teacher``
    (``ars_opd.models.prepare_teachers``) and recorded under the manifest's ``teachers`` and the metrics'
    ``teachers``; without, nothing here changes."""
    several = teachers is not None and teachers.active
    if base.threads:
        torch.set_num_threads(base.threads)
    trc = cfg.trust_remote_code
    with atomic_outputs(models_dir, metrics_path) as (out, metrics_tmp):
        out.mkdir(parents=True)
        uses_builtin = BUILTIN in (cfg.teacher, cfg.student)
        builtin_tok = build_char_word_tokenizer(synthetic.instruction_words()) if uses_builtin else None
        refs: dict[str, ModelRef] = {}
        # everything pretrained is pinned (and a student pruned from it written) before a built-in teacher trains
        if cfg.teacher == BUILTIN:
            teacher_tok, teacher_name = builtin_tok, BUILTIN
        else:
            refs["teacher"] = _pin_one(out, "teacher", cfg.teacher, cfg.teacher_revision, trc)
            teacher_tok, teacher_name = _tokenizer(refs["teacher"], "teacher", trc), refs["teacher"].name
        student_tok, student_name = _pin_student(out, cfg, refs, teacher_tok, builtin_tok)
        differences = tokenizer_differences(teacher_tok, student_tok)
        if differences and not cross_tokenizer:
            raise TokenizerMismatchError(mismatch_message(differences))
        _require_chat_template(student_tok, "student", student_name)
        if cross_tokenizer:  # the teacher then renders the student's text under its own template
            _require_chat_template(teacher_tok, "teacher", teacher_name)
        student_tok.save_pretrained(out / "tokenizer")  # every training stage tokenises with the student's
        if cross_tokenizer:
            teacher_tok.save_pretrained(out / TEACHER_TOKENIZER)
        # several teachers: the pretrained and served ones pinned before any training, so a missing one fails fast
        named = pin_named_teachers(out, teachers, trc, student_tok) if several else {}

        if cfg.teacher == BUILTIN:
            metrics = _build_builtin(out, cfg, synth, base.seed, progress, builtin_tok, refs, student_tok)
        else:  # a pretrained teacher: nothing to train or gate
            if cfg.student == BUILTIN:  # beside it only with opd.cross_tokenizer
                student = build_causal_lm(cfg.student_arch, builtin_tok, derive_seed(base.seed, "student-init"))
                student.save_pretrained(out / "student", safe_serialization=True)
                builtin_tok.save_pretrained(out / "student")
                refs["student"] = builtin_ref(out, "student")
            metrics = {
                f"{role}_params": refs[role].extra["parameters"]
                for role in ("teacher", "student")
                if refs[role].extra and "parameters" in refs[role].extra
            }
            if cfg.student == BUILTIN:
                metrics["student_params"] = count_parameters(student)
        if several:  # the built-in ones trained beside the models stage's own teacher, now pinned
            built, metrics[MANIFEST_KEY] = build_named_teachers(
                out, teachers, cfg, synth, base.seed, builtin_tok, refs["teacher"], progress
            )
            named.update(built)

        paths = {role: Path(ref.path) for role, ref in refs.items()}
        tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"), trust_remote_code=trc)
        manifest = {
            role: {**refs[role].to_json(), "embedding_rows": embedding_rows(str(paths[role]))}
            for role in ("teacher", "student", STUDENT_SOURCE)
            if role in refs
        }
        for role in manifest:  # paths inside models_dir are relative to it, so the manifest is portable
            if refs[role].source in WRITTEN_SOURCES:
                manifest[role]["path"] = role
        if manifest["student"]["source"] == PRUNED:
            origin = refs["student"].name  # "teacher" or STUDENT_SOURCE
            manifest["student"]["pruned_from"] = {
                "role": origin,
                "revision": manifest[origin]["revision"],
                "source": manifest[origin]["source"],
            }
            if origin == STUDENT_SOURCE:
                manifest["student"]["pruned_from"]["name"] = manifest[origin]["name"]
        manifest["tokenizer"] = {**tokenizer_fingerprint(tok), "sha256": sha256_of_files(out / "tokenizer")}
        manifest["cross_tokenizer"] = bool(cross_tokenizer)
        manifest["tokenizers_shared"] = not differences
        if cross_tokenizer:
            teacher_saved = AutoTokenizer.from_pretrained(str(out / TEACHER_TOKENIZER), trust_remote_code=trc)
            manifest[TEACHER_TOKENIZER] = {
                **tokenizer_fingerprint(teacher_saved),
                "sha256": sha256_of_files(out / TEACHER_TOKENIZER),
            }
            manifest["vocab_rule"] = (
                "cross tokenizers (opd.cross_tokenizer): the teacher's and the student's vocabularies are not "
                "compared id by id; each model scores its own tokenisation of the text (teacher_tokenizer/ and "
                "tokenizer/), compared span by span (ars_opd.lm.token_alignment). Within each model, logits cover "
                "its tokenizer's ids only (0..vocab_size-1); embedding rows beyond it are padding and are dropped"
            )
        else:
            manifest["vocab_rule"] = (
                "logits are compared over the tokenizer's ids only (0..vocab_size-1); embedding rows beyond "
                "the tokenizer are padding and are dropped on both sides"
            )
        config = {"base": to_dict(base), "models": to_dict(cfg), "synthetic": to_dict(synth)}
        if several:
            manifest[MANIFEST_KEY] = manifest_section(named, teachers)
            config[MANIFEST_KEY] = to_dict(teachers)
        manifest["provenance"] = provenance(config)
        write_json(out / MANIFEST, manifest)
        metrics["tokenizer_vocab_size"] = manifest["tokenizer"]["vocab_size"]
        if cross_tokenizer:
            metrics["teacher_tokenizer_vocab_size"] = manifest[TEACHER_TOKENIZER]["vocab_size"]
        metrics["teacher_embedding_rows"] = manifest["teacher"]["embedding_rows"]
        metrics["student_embedding_rows"] = manifest["student"]["embedding_rows"]
        write_json(metrics_tmp, metrics)
    return metrics
