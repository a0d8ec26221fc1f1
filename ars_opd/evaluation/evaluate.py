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
student both arms start from (``paths.distill_init``, marked ``"start": true``).

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
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from ars_opd.artifacts import atomic_outputs, provenance, read_jsonl, write_json, write_jsonl
from ars_opd.config import ConfigError, EvaluateConfig, PathsConfig, TeachersConfig, to_dict
from ars_opd.data import synthetic
from ars_opd.data.answers import is_checkable, is_correct
from ars_opd.data.prompts import encode_completions, encode_prompts, encode_teacher_completions
from ars_opd.evaluation.arms import ARMS, MODELS, TRAINED
from ars_opd.evaluation.row_teachers import RowTeachers, per_teacher, teacher_row
from ars_opd.evaluation.score_cache import ScoreCache, code_versions, data_sha256, dir_sha256, tokenizers_context
from ars_opd.evaluation.steps import step_metrics
from ars_opd.evaluation.tables import render_table
from ars_opd.evaluation.token_losses import (
    EXACT,
    SAMPLED_CROSS_TOKENIZER,
    TeacherTextRows,
    own_samples,
    reverse_kl_cross_tokenizer,
    reverse_kl_on_own_samples,
    teacher_text_scores,
)
from ars_opd.lm.generation import decode_completion, eos_token_ids, generate_token_ids
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
from ars_opd.training.budget import SNAPSHOTS, matmul_parameters, read_budget

# what each learning-curve point records (the equal-FLOPs views read these off the curves)
CURVE_METRICS = (
    "exact_match",
    "reverse_kl",
    "teacher_nll",
    "exact_match_sampled",
    "reverse_kl_fixed_prefix",
    "reverse_kl_first_sentence",
    "reverse_kl_per_sequence",
)


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


@dataclass
class HeldOut:
    """The held-out prompts, encoded once, with what scoring them needs. ``teacher``: in a cross-tokenizer run,
    the same rows in the teacher's own tokens (its chat template's prompts, its tokens of the teacher's
    completions and its EOS): what the teacher's row is scored on, and the teacher's side of the students'
    reverse-KL estimate. None when teacher and student share a tokenizer."""

    rows: list[dict]
    prompts: list[list[int]]
    completions: list[list[int]]
    checkable: list[bool]
    teacher: "HeldOut | None" = None
    teacher_text: TeacherTextRows | None = None  # the teacher's hidden rows on its completions (``with_teacher_text``)
    teachers: list[str] | None = None  # several teachers (teachers.named): each row's, by name

    def head(self, n: int) -> "HeldOut":
        teacher = None if self.teacher is None else self.teacher.head(n)
        text = None if self.teacher_text is None else self.teacher_text.head(n)
        teachers = None if self.teachers is None else self.teachers[:n]
        return HeldOut(
            self.rows[:n], self.prompts[:n], self.completions[:n], self.checkable[:n], teacher, text, teachers
        )

    def subset(self, indices: list[int]) -> "HeldOut":
        """These rows at ``indices`` (one teacher's rows of several), without the teacher-side extras."""
        pick = lambda xs: [xs[i] for i in indices]  # noqa: E731
        return HeldOut(pick(self.rows), pick(self.prompts), pick(self.completions), pick(self.checkable))

    def with_teacher_text(self, teacher, tokenizer, cfg: EvaluateConfig, device: torch.device) -> "HeldOut":
        """These rows with the teacher's hidden states on its own completions, computed once for every model's
        fixed-prefix reverse KL (``token_losses.TeacherTextRows``). A cross-tokenizer run has no shared vocabulary
        to take an exact KL over, so it gets none."""
        if self.teacher is not None:
            return self
        text = TeacherTextRows.compute(teacher, tokenizer, self.prompts, self.completions, cfg, device)
        return dataclasses.replace(self, teacher_text=text)

    @cached_property
    def key(self) -> str:
        """sha256 of the rows and their encodings (``score_cache``; the teacher's too where there is one), hashed
        once."""
        teacher = None if self.teacher is None else self.teacher.key
        return data_sha256(self.rows, self.prompts, self.completions, self.checkable, teacher)


def held_out(tokenizer, rows: list[dict], teacher_tokenizer=None) -> HeldOut:
    """``rows`` encoded with ``tokenizer`` (the student's, or the shared one): prompts through its chat template,
    the teacher's completions in its tokens with its EOS where the teacher ended them; with ``teacher_tokenizer``
    (a cross-tokenizer run) the same again in the teacher's own tokens, as ``HeldOut.teacher``."""
    checkable = [is_checkable(r) for r in rows]
    teacher = None
    if teacher_tokenizer is not None:
        teacher = HeldOut(
            rows,
            encode_prompts(teacher_tokenizer, [r["messages"] for r in rows]),
            encode_teacher_completions(teacher_tokenizer, rows),
            checkable,
        )
    return HeldOut(
        rows,
        encode_prompts(tokenizer, [r["messages"] for r in rows]),
        encode_teacher_completions(tokenizer, rows),
        checkable,
        teacher,
    )


def check_answer_room(tokenizer, rows: list[dict], max_new_tokens: int) -> None:
    """Refuse, naming ``evaluate.max_new_tokens``, a budget under which a checkable row's answer can never be
    right, whatever the model writes: a synthetic reference with its EOS (the whole answer must equal it; the
    long-horizon tasks need ~52), or a natural kind's reference alone (it need not end the answer, only appear in
    its first sentence, so no EOS; how much a model writes before it varies by model, so only the bare reference
    is a bound: set the budget from the answers seen, e.g. ``studies/natural_teacher.py``)."""
    refs = [r for r in rows if is_checkable(r)]
    if not refs:
        return
    ended = [r["task"] in synthetic.TASK_NAMES for r in refs]
    ids = encode_completions(tokenizer, [r["reference"] for r in refs], add_eos=False)
    lengths = [len(x) + e for x, e in zip(ids, ended)]
    longest = max(range(len(refs)), key=lengths.__getitem__)
    if lengths[longest] > max_new_tokens:
        what = "with its EOS" if ended[longest] else "(a natural kind's reference alone)"
        raise ConfigError(
            "evaluate.max_new_tokens",
            f"{max_new_tokens} tokens cannot hold the longest checkable reference answer ({lengths[longest]} "
            f"tokens {what}, task {refs[longest]['task']}): raise it to at least {lengths[longest]}",
        )


def score_model(
    model,
    teacher,
    tokenizer,
    data: HeldOut,
    cfg: EvaluateConfig,
    vocab: int,
    device: torch.device,
    is_teacher: bool = False,
    teacher_tokenizer=None,
) -> tuple[dict, list[str]]:
    """(exact match over the checkable rows, overall and per task; reverse KL on own samples and teacher NLL,
    overall and per task; the greedy answers).

    ``tokenizer``, ``data`` and ``vocab`` are the scored model's own: the teacher's own in a cross-tokenizer run
    when it is the teacher (``data.teacher``, ``len(teacher_tokenizer)``). A student's ``data`` with a
    ``teacher`` encoding (a cross-tokenizer run) gets the sampled cross-tokenizer reverse-KL estimate against
    ``teacher``, which ``teacher_tokenizer`` (the teacher's own) tokenises; without one the exact reverse KL."""
    eos = eos_token_ids(model, tokenizer)
    greedy = generate_token_ids(
        model, tokenizer, data.prompts, cfg.max_new_tokens, batch_size=cfg.batch_size, eos_ids=eos
    )
    texts = [decode_completion(tokenizer, g, eos) for g in greedy]
    m: dict = {}
    # the own samples (temperature 1, the rollouts' default): behind reverse KL, sampled exact match and their ends
    drawn = own_samples(model, tokenizer, data.prompts, cfg)
    draws = [drawn[0]] + [own_samples(model, tokenizer, data.prompts, cfg, k)[0] for k in range(1, cfg.sampled_draws)]
    m.update(sample_ends(draws[0], eos, cfg.max_new_tokens))
    if any(data.checkable):
        per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r, t, ok in zip(data.rows, texts, data.checkable):
            if ok:
                per_task[r["task"]][0] += int(is_correct(r, t))
                per_task[r["task"]][1] += 1
        m["exact_match"] = sum(c for c, _ in per_task.values()) / sum(n for _, n in per_task.values())
        m["exact_match_per_task"] = {k: c / n for k, (c, n) in sorted(per_task.items())}
        steps = step_metrics([r.get("task") for r in data.rows], texts, [r.get("reference") for r in data.rows])
        if steps is not None:  # long-horizon tasks: where in the answer each model first goes wrong
            m["steps"] = steps
        m["exact_match_sampled"] = sampled_exact_match(
            data, [[decode_completion(tokenizer, c, eos) for c in d] for d in draws]
        )
    else:
        m["exact_match"] = None
        m["exact_match_sampled"] = None
    m["sampled_draws"] = cfg.sampled_draws
    tasks = [r.get("task") for r in data.rows]
    cross = data.teacher is not None or teacher_tokenizer is not None
    m["reverse_kl_kind"] = SAMPLED_CROSS_TOKENIZER if cross else EXACT
    rkl = None
    if is_teacher:  # KL(p || p) = 0 on every token, so on every kind
        m["reverse_kl"] = 0.0
        m["reverse_kl_per_sequence"] = 0.0
        m["reverse_kl_per_task"] = {t: 0.0 for t in sorted({t for t in tasks if t is not None})}
    elif cross:
        if data.teacher is None or teacher_tokenizer is None:
            raise ValueError("a cross-tokenizer score needs the teacher's tokenizer and its encoding of the rows")
        rkl = reverse_kl_cross_tokenizer(
            model,
            teacher,
            tokenizer,
            teacher_tokenizer,
            data.prompts,
            data.teacher.prompts,
            cfg,
            vocab,
            len(teacher_tokenizer),
            device,
            drawn,
        )
        m["reverse_kl"], m["reverse_kl_per_task"] = rkl.mean, rkl.per_task(tasks)
        m["reverse_kl_per_sequence"] = rkl.per_sequence
        m["reverse_kl_unaligned_tokens"] = rkl.unaligned
    else:
        rkl = reverse_kl_on_own_samples(model, teacher, tokenizer, data.prompts, cfg, vocab, device, drawn)
        m["reverse_kl"], m["reverse_kl_per_task"] = rkl.mean, rkl.per_task(tasks)
        m["reverse_kl_per_sequence"] = rkl.per_sequence
    fixed = None if is_teacher or data.teacher_text is None else (teacher, data.teacher_text)
    scores = teacher_text_scores(model, tokenizer, data.prompts, data.completions, cfg, vocab, device, fixed)
    m["teacher_nll"], m["teacher_nll_per_task"] = scores.nll.mean, scores.nll.per_task(tasks)
    if is_teacher and not cross:
        m["reverse_kl_fixed_prefix"] = m["reverse_kl_first_sentence"] = 0.0
    elif scores.reverse_kl is not None:
        m["reverse_kl_fixed_prefix"] = scores.reverse_kl.mean
        m["reverse_kl_fixed_prefix_per_task"] = scores.reverse_kl.per_task(tasks)
        m["reverse_kl_first_sentence"] = scores.reverse_kl_first_sentence.mean
    if data.teachers is not None and not is_teacher:  # several teachers: each one's rows, against it
        losses = {"reverse_kl": rkl, "teacher_nll": scores.nll, "reverse_kl_fixed_prefix": scores.reverse_kl}
        m["per_teacher"] = per_teacher(data.teachers, data.rows, data.checkable, texts, is_correct, losses)
    return m, texts


def sample_ends(samples: list[list[int]], eos: tuple[int, ...], max_new_tokens: int) -> dict:
    """How a model's own samples end: the share that wrote an EOS (``own_eos_rate``), and their mean length in
    tokens up to and including it (``own_length``); a sample that wrote none ran to ``max_new_tokens``."""
    ends = set(eos)
    lengths, ended = [], 0
    for s in samples:
        cut = next((i + 1 for i, t in enumerate(s) if t in ends), None)
        ended += cut is not None
        lengths.append(cut if cut is not None else len(s))
    n = len(samples)
    return {"own_eos_rate": ended / n if n else None, "own_length": sum(lengths) / n if n else None}


def sampled_exact_match(data: HeldOut, draws: list[list[str]]) -> float:
    """Exact match of sampled answers (temperature 1) over the checkable rows, averaged over the draws: the
    chance that one sample is right, which greedy decoding's exact match does not show."""
    right = [
        is_correct(r, texts[i]) for texts in draws for i, (r, ok) in enumerate(zip(data.rows, data.checkable)) if ok
    ]
    return sum(right) / len(right)


def learning_curve(
    stage: str,
    paths: PathsConfig,
    teacher,
    tokenizer,
    data: HeldOut,
    cfg: EvaluateConfig,
    vocab: int,
    device: torch.device,
    trust_remote_code: bool = False,
    cache: ScoreCache | None = None,
    teacher_tokenizer=None,
) -> list[dict]:
    """A training stage's snapshots (``snapshots/step_N`` in its model directory) and its final model, each
    scored on ``data``, with the budget spent to reach it (``budget.json``: steps and FLOPs from scratch).
    A snapshot taken at the final step is the final model and is scored once."""
    model_dir = Path(paths.training(stage).model)
    final_steps = read_budget(model_dir)["steps"]
    dirs = [d for d in sorted((model_dir / SNAPSHOTS).glob("step_*")) if read_budget(d)["steps"] != final_steps]
    return [
        curve_point(d, stage, teacher, tokenizer, data, cfg, vocab, device, trust_remote_code, cache, teacher_tokenizer)
        for d in dirs + [model_dir]
    ]


def curve_point(
    model_dir: Path,
    stage: str,
    teacher,
    tokenizer,
    data: HeldOut,
    cfg: EvaluateConfig,
    vocab: int,
    device: torch.device,
    trust_remote_code: bool = False,
    cache: ScoreCache | None = None,
    teacher_tokenizer=None,
) -> dict:
    """One learning-curve point: the model in ``model_dir`` scored on ``data``, with its budget."""

    def compute() -> tuple[dict, list[str]]:
        model = load_model_dir(model_dir, stage=stage, trust_remote_code=trust_remote_code)
        model = model.to(device).eval().requires_grad_(False)
        return score_model(model, teacher, tokenizer, data, cfg, vocab, device, teacher_tokenizer=teacher_tokenizer)

    m, _ = _scored(cache, lambda: f"dir:{dir_sha256(model_dir)}", data, False, compute)
    point = {**read_budget(model_dir), **{k: m.get(k) for k in CURVE_METRICS}}
    if "per_teacher" in m:  # several teachers: each teacher's rows too, for comparisons at equal budget per teacher
        point["per_teacher"] = m["per_teacher"]
    return point


def learning_curves(
    paths: PathsConfig,
    teacher,
    tokenizer,
    data: HeldOut,
    cfg: EvaluateConfig,
    vocab: int,
    device: torch.device,
    trust_remote_code: bool = False,
    cache: ScoreCache | None = None,
    teacher_tokenizer=None,
) -> dict:
    """Every training stage's curve; each arm's curve starts at the student both arms start from
    (``paths.distill_init``), so the arms can be read off at any budget between their start and end (the
    equal-FLOPs comparison interpolates there). When that student is the sft stage's model its final curve
    point is reused rather than scored again."""
    curves = {
        stage: learning_curve(
            stage, paths, teacher, tokenizer, data, cfg, vocab, device, trust_remote_code, cache, teacher_tokenizer
        )
        for stage in TRAINED
    }
    init = Path(paths.distill_init)
    if init.resolve() == Path(paths.sft_model).resolve():
        start = dict(curves["sft"][-1])
    else:
        start = curve_point(
            init, "sft", teacher, tokenizer, data, cfg, vocab, device, trust_remote_code, cache, teacher_tokenizer
        )
    for arm in ARMS:
        curves[arm] = [{**start, "start": True}] + curves[arm]
    return curves


def _scored(cache: ScoreCache | None, model, data: HeldOut, is_teacher: bool, compute) -> tuple[dict, list[str]]:
    """``compute()``, or through the store of scored models where one is set (``score_cache``); ``model()``
    names the model for the store, and is called only then (it hashes files)."""
    return compute() if cache is None else cache.score(model(), data.key, is_teacher, compute)


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


def log_curves(live_dir: Path, curves: dict) -> None:
    """The learning curves through DVCLive, for ``dvc plots show``/``dvc plots diff``: one series per training
    stage and metric (and its FLOPs from scratch) against optimiser steps from scratch. Only the plot files:
    the numbers are in the evaluate metrics already."""
    from dvclive import Live

    live = Live(dir=str(live_dir), save_dvc_exp=False, dvcyaml=None, resume=False)
    for stage in TRAINED:
        for point in curves.get(stage) or []:
            live.step = int(point["steps"])
            for key in (*CURVE_METRICS, "flops"):
                v = point.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    live.log_metric(f"{stage}/{key}", float(v), plot=True)


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
        m, texts = _scored(
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
        **learning_curves(
            paths, teacher, tokenizer, curve_data, cfg, vocab, device, trust_remote_code, cache, teacher_tokenizer
        ),
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
