"""The ``evaluate`` stage: did distillation work? Every student and the teacher on held-out prompts.

Models: the base student, the SFT student, the two arms that start from it with equal steps and the same
optimisation loop (OPD, and continued SFT as its control), and the teacher. For each, on the held-out
prompts of the subset (the teacher_gen eval split, which carries the teacher's completions):

- ``exact_match``: greedy answers compared with the ground truth where the data has a checkable one, over the
  checkable rows only (``checkable_examples`` of ``examples``); null when there are none. Checkable rows: the
  synthetic tasks' (the whole answer must equal the reference, whose values the tests verify against an
  independent recomputation; on the long-horizon tasks the final answer, and ``steps`` adds where in the answer
  each model first goes wrong: ``ars_opd.evaluation.steps``) and the natural prompts' checkable kinds (a chat
  model answers in sentences, so the reference must appear as whole words in the answer's first sentence with
  no other candidate before it: ``ars_opd.data.natural_check``). An open-ended row (no reference) is neither
  right nor wrong: it has no exact match, in the overall number or per kind. Also per task.
- ``reverse_kl``: KL(q ‖ p) per token between the model q and the teacher p, exact over the vocabulary,
  averaged over the tokens of the model's *own* samples (temperature 1, seeded) — the quantity on-policy
  distillation minimises. 0 for the teacher by definition. ``reverse_kl_kind`` (top level and per model) says
  which quantity it is: ``exact``, or ``sampled_cross_tokenizer`` (below).
- ``teacher_nll``: mean per-token negative log-likelihood of the teacher's completions (EOS included where
  the teacher ended the completion, none where it was cut off at its length limit:
  ``ars_opd.data.prompts.teacher_ended``) under the model — how well it imitates the teacher on the teacher's
  own text (the SFT objective).
- per kind (``task``; rows without one are in the overall numbers only): ``examples_per_task``, and for every
  model ``reverse_kl_per_task`` and ``teacher_nll_per_task``, token-weighted means over the kind's rows (each
  row's per-token values summed in float64 from the same fp32 values as the overall mean, whose arithmetic is
  untouched), beside ``exact_match_per_task`` for the checkable kinds.

Cross-tokenizer runs (the models stage's manifest says ``cross_tokenizer``: ``ars_opd.models.loading``): the
students use the student's tokenizer (``tokenizer/``) for their prompts, greedy answers, EOS ids and decoding, as
always; the teacher's row uses the teacher's own (``teacher_tokenizer/``): its chat template renders the same
held-out messages, its EOS ids end and its decoder decodes its answers (``HeldOut.teacher``). Exact match is each
model's own answer checked as always. ``teacher_nll`` is per token of each model's *own* tokenisation of the
teacher's text (the students' per student token, the teacher's per teacher token), so the teacher's row is not
per the same tokens as the students'. ``reverse_kl`` cannot be the exact KL over one vocabulary: it is the
sampled sequence-level estimate per student token on each student's own samples (the same samples as above),
(Σ log q(student tokens) − Σ log p(the teacher's tokens of the same text, after the teacher's own rendering of
the prompt)) / student tokens, over the spans both tokenisations share
(``ars_opd.evaluation.token_losses.reverse_kl_cross_tokenizer``); a single sample's value, and at a few rows the
mean, can be negative. The teacher's own row stays 0. ``reverse_kl_unaligned_tokens``: the student tokens left
out (those that no boundary verified on both sides follows, e.g. past a teacher normaliser's change of the text;
text the teacher writes as its unknown token is aligned, ``ars_opd.lm.token_alignment``).

Generation decodes greedily, or samples softmax(z), and nothing else: a checkpoint's ``generation_config``
(repetition penalty, min_p...) is not applied, and a completion ends at the first of any id the model stops
at (its tokenizer's EOS and its ``generation_config.eos_token_id`` list), in the answers and in the reverse-KL
mask alike (``ars_opd.lm.generation``). Every model loads with ``models.trust_remote_code``, and the padding id
is the pipeline's one rule (``ars_opd.lm.batching.pad_token_id``).

Learning curves: every snapshot a training stage kept (``snapshot_every``) and its final model, scored on
the first ``evaluate.curve_examples`` held-out prompts, with the steps and FLOPs spent from scratch to
reach it (``ars_opd.training.budget``), under ``curves`` in the metrics. Each arm's curve begins at the
student both arms start from (``paths.distill_init``, marked ``"start": true``; ``ars_opd.evaluation.curves``).

Both losses are taken from the models' last hidden states through their output heads one chunk of positions
at a time (``ars_opd.lm.head``), so a real vocabulary never makes (tokens × vocabulary) logits here either;
the teacher is loaded in bf16 on CUDA and fp32 on CPU (``evaluate.teacher_dtype``).

Outputs: one metrics JSON (DVC metrics, nested by model), a markdown table, every greedy answer as JSON
Lines for inspection, and the learning curves through DVCLive (DVC plots against steps), all replaced
together. Runs in one process (evaluation needs no data parallelism at this size).

Sweeps score the same models in experiment after experiment (the base student, the teacher, a seed's SFT
student, a control DVC did not rerun): with ``ARS_OPD_EVAL_CACHE`` set to a directory, each score is stored
under a hash of everything it depends on and read back, the outputs byte for byte the same
(``ars_opd.evaluation.score_cache``).

The stage in parts: ``held_out`` (the held-out rows, encoded once), ``scoring`` (one model scored on them: every
figure above), ``curves`` (the learning curves); this module loads the models, runs them through and writes the
outputs.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import torch

from ars_opd.artifacts import atomic_outputs, provenance, read_jsonl, write_json, write_jsonl
from ars_opd.config import ConfigError, EvaluateConfig, PathsConfig, TeachersConfig, to_dict
from ars_opd.data.answers import is_checkable  # noqa: F401  (where a study and tests ask it)
from ars_opd.evaluation.arms import MODELS, TRAINED
from ars_opd.evaluation.curves import CurveScorer, log_curves
from ars_opd.evaluation.held_out import HeldOut, check_answer_room, held_out
from ars_opd.evaluation.row_teachers import RowTeachers, teacher_row
from ars_opd.evaluation.score_cache import ScoreCache, code_versions, dir_sha256, tokenizers_context
from ars_opd.evaluation.scoring import (  # noqa: F401  (sample_ends, sampled_exact_match: where tests ask them)
    sample_ends,
    sampled_exact_match,
    score_model,
    scored,
)
from ars_opd.evaluation.tables import render_table
from ars_opd.evaluation.token_losses import EXACT, SAMPLED_CROSS_TOKENIZER
from ars_opd.lm.precision import frozen_model_dtype
from ars_opd.models.loading import (
    cross_tokenizer,
    load_model,
    load_model_dir,
    load_teacher_tokenizer,
    load_tokenizer,
    model_path,
    read_manifest,
)
from ars_opd.models.teachers import Route, check_pinned, check_recorded, teacher_path
from ars_opd.training.budget import matmul_parameters, read_budget


def _load(
    paths: PathsConfig, name: str, trust_remote_code: bool, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    if name in ("base", "teacher"):
        model = load_model(
            paths.models_dir,
            "student" if name == "base" else "teacher",
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        )
    else:
        model = load_model_dir(paths.training(name).model, stage=name, trust_remote_code=trust_remote_code)
    return model.to(device).eval().requires_grad_(False)


def _cache_context(cfg: EvaluateConfig, paths: PathsConfig, trust_remote_code: bool, device: torch.device) -> dict:
    """What every stored score depends on besides its model and data (``score_cache``'s docstring): in a
    cross-tokenizer run both tokenizers (``tokenizers_context``)."""
    return {
        "evaluate": to_dict(cfg),
        "device": str(device),
        "trust_remote_code": trust_remote_code,
        "manifest": read_manifest(paths.models_dir),
        **tokenizers_context(paths.models_dir, cross_tokenizer(paths.models_dir)),
        "code": code_versions(),
    }


def _identity(paths: PathsConfig, name: str) -> str:
    """A scored model's name in the store: for the base student and the teacher the revision the models stage
    pinned, verified on disk; for a trained stage's model the hash of its directory."""
    if name not in ("base", "teacher"):
        return f"dir:{dir_sha256(paths.training(name).model)}"
    role = "student" if name == "base" else "teacher"
    model_path(paths.models_dir, role)  # raises if the directory changed after it was pinned
    return f"pinned:{role}:{read_manifest(paths.models_dir)[role]['revision']}"


SAMPLED_NOTE = (
    "Reverse KL here is not the exact KL over one vocabulary: teacher and student tokenize differently "
    "(opd.cross_tokenizer), so it is the sampled sequence-level estimate per student token on each model's own "
    "samples, (sum of log q over the student's tokens - sum of log p over the teacher's tokens of the same text) / "
    "student tokens, over the spans both tokenisations share. A single sample's value can be negative; it is not "
    "comparable with an exact reverse KL. Teacher NLL is per each model's own tokens of the teacher's text."
)


def eval_table(metrics: dict) -> str:
    """The metrics table (``ars_opd.evaluation.tables.render_table``), with a note saying what reverse KL is when
    it is the sampled cross-tokenizer estimate (``reverse_kl_kind``)."""
    table = render_table(metrics)
    if metrics.get("reverse_kl_kind") == SAMPLED_CROSS_TOKENIZER:
        table += f"\n{SAMPLED_NOTE}\n"
    return table


def several_teachers(
    teachers: TeachersConfig, paths: PathsConfig, rows: list[dict], trust_remote_code: bool, device, dtype
) -> RowTeachers:
    """The held-out rows' teachers of several (``teachers.named``), loaded once, after the checks that keep each row
    measured against its own: every row has a teacher (``Route``), its completion is that teacher's text
    (``check_recorded``: the NLL is of the teacher's own completions), the teachers are the ones the models stage
    pinned, each with weights (an endpoint teacher's distribution cannot be had, so it is refused, naming it)."""
    where = paths.completions("eval")
    assigned = Route(teachers).assign(rows, where)
    check_recorded(rows, assigned, where)
    for i, t in enumerate(teachers.named):
        if t.is_endpoint:
            raise ConfigError(
                f"teachers.named[{i}].source",
                f"evaluate measures reverse KL against each row's teacher's full distribution, which the endpoint "
                f"teacher {t.name} does not return; name the weights it serves as a teacher of its own to evaluate",
            )
    entries = check_pinned(paths.models_dir, teachers)
    names = Route(teachers).names
    models = [
        load_model_dir_as_teacher(teacher_path(paths.models_dir, n, entries[n]), trust_remote_code, device, dtype)
        for n in names
    ]
    return RowTeachers(names, models, [names.index(a) for a in assigned])


def load_model_dir_as_teacher(directory: str, trust_remote_code: bool, device, dtype) -> torch.nn.Module:
    """A named teacher's pinned directory as the evaluate stage holds a teacher (frozen, ``evaluate.teacher_dtype``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.to(device).eval().requires_grad_(False)


def evaluate_models(
    cfg: EvaluateConfig, paths: PathsConfig, trust_remote_code: bool = False, teachers: TeachersConfig | None = None
) -> dict:
    """Run the stage; write metrics, table, answers and learning curves; return the metrics. ``teachers``: with
    teachers named, each held-out row is measured against its own (``row_teachers``), the teacher's row of the
    table is each teacher on its own rows, and every model's figures are also given per teacher
    (``per_teacher``, ``examples_per_teacher``)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("evaluate.device is cuda but no CUDA device is visible; set evaluate.device: auto or cpu")
    device = torch.device(
        "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    rows = read_jsonl(paths.completions("eval"))
    if cfg.max_examples:
        rows = rows[: cfg.max_examples]
    if not rows:
        raise ValueError(
            f"{paths.completions('eval')} has no rows: evaluation needs held-out prompts "
            "(teacher_gen.splits must include eval and data.eval_size > 0)"
        )
    tokenizer = load_tokenizer(paths.models_dir, trust_remote_code)  # the student's (the shared one)
    vocab = len(tokenizer)
    check_answer_room(tokenizer, rows, cfg.max_new_tokens)
    teacher_tokenizer = None
    if cross_tokenizer(paths.models_dir):  # the teacher's row in its own tokens: the teacher's answer must fit too
        teacher_tokenizer = load_teacher_tokenizer(paths.models_dir, trust_remote_code)
        check_answer_room(teacher_tokenizer, rows, cfg.max_new_tokens)
    data = held_out(tokenizer, rows, teacher_tokenizer)
    several = teachers is not None and teachers.active
    if several:  # each row against its own teacher
        teacher = several_teachers(
            teachers, paths, rows, trust_remote_code, device, frozen_model_dtype(cfg.teacher_dtype, device)
        )
        data = dataclasses.replace(data, teachers=[teacher.names[k] for k in teacher.index])
    else:
        teacher = _load(paths, "teacher", trust_remote_code, device, frozen_model_dtype(cfg.teacher_dtype, device))
    data = data.with_teacher_text(teacher, tokenizer, cfg, device)  # once, for every model's fixed-prefix KL
    context = (
        (lambda: {**_cache_context(cfg, paths, trust_remote_code, device), "teachers": to_dict(teachers)})
        if several
        else (lambda: _cache_context(cfg, paths, trust_remote_code, device))
    )
    cache = ScoreCache.from_env(context)
    kind = EXACT if teacher_tokenizer is None else SAMPLED_CROSS_TOKENIZER
    metrics: dict = {"examples": len(rows), "checkable_examples": sum(data.checkable), "reverse_kl_kind": kind}
    metrics["examples_per_task"] = dict(sorted(Counter(r["task"] for r in rows if r.get("task") is not None).items()))
    if several:
        metrics["examples_per_teacher"] = {n: data.teachers.count(n) for n in teacher.names}
    answers: list[dict] = [{"id": r["id"], "task": r.get("task")} for r in rows]
    for name in MODELS:
        # the teacher's row in its own tokens in a cross-tokenizer run; every student's in the student's
        own = data.teacher if name == "teacher" and data.teacher is not None else data

        def compute(name: str = name, own: HeldOut = own) -> tuple[dict, list[str]]:
            if name == "teacher" and several:  # each teacher answers its own rows
                parts = {}
                for k, (n, model) in enumerate(zip(teacher.names, teacher.models)):
                    mine = [i for i, o in enumerate(teacher.index) if o == k]
                    if mine:
                        part, texts = score_model(model, model, tokenizer, own.subset(mine), cfg, vocab, device, True)
                        parts[n] = (part, texts, mine)
                return teacher_row(parts, own, len(own.rows))
            if name == "teacher":
                own_tok = tokenizer if teacher_tokenizer is None else teacher_tokenizer
                return score_model(teacher, teacher, own_tok, own, cfg, len(own_tok), device, True, teacher_tokenizer)
            model = _load(paths, name, trust_remote_code, device)
            return score_model(model, teacher, tokenizer, own, cfg, vocab, device, teacher_tokenizer=teacher_tokenizer)

        started = time.perf_counter()
        # every teacher's row: its pins and the route are in the store's context (the manifest, teachers)
        identity = (lambda: f"routed:{','.join(teacher.names)}") if several and name == "teacher" else None
        m, texts = scored(
            cache, identity or (lambda name=name: _identity(paths, name)), own, name == "teacher", compute
        )
        em = "n/a" if m.get("exact_match") is None else f"{m['exact_match']:.1%}"
        what = "reverse KL" if kind == EXACT else "reverse KL (sampled, cross-tokenizer)"
        print(  # a real model takes minutes per model: say where the stage is
            f"evaluate: {name}: exact match {em}, {what} {m['reverse_kl']:.4f}, teacher NLL "
            f"{m['teacher_nll']:.4f} on {len(data.rows)} prompts ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        if name in TRAINED:
            m["budget"] = read_budget(paths.training(name).model)
        if name == "teacher" and several:  # the largest teacher's: the data cost's upper bound (equal sizes: exact)
            m["matmul_parameters"] = max(matmul_parameters(t) for t in teacher.models)
        elif name == "teacher":  # the data-cost view charges 2 of these FLOPs per token the teacher wrote
            m["matmul_parameters"] = matmul_parameters(teacher)
        metrics[name] = m
        for a, t in zip(answers, texts):
            a[name] = t
    curve_data = data.head(cfg.curve_examples) if cfg.curve_examples else data
    metrics["curves"] = {
        "examples": len(curve_data.rows),
        **CurveScorer(
            teacher, tokenizer, curve_data, cfg, vocab, device, trust_remote_code, cache, teacher_tokenizer
        ).curves(paths),
    }
    if cache is not None:
        print(cache.summary())
    table = eval_table(metrics)
    with atomic_outputs(paths.eval_metrics, paths.eval_dir, paths.eval_live) as (metrics_tmp, out, live_tmp):
        log_curves(live_tmp, metrics["curves"])
        out.mkdir(parents=True)
        (out / "table.md").write_text(table)
        write_jsonl(out / "answers.jsonl", answers)
        write_json(out / "manifest.json", provenance({"evaluate": to_dict(cfg)}))
        write_json(metrics_tmp, metrics)
    return metrics
