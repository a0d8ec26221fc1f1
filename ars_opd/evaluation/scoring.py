"""One model scored on the held-out rows (``score_model``), the one function behind every figure of the evaluate
stage: its greedy answers and their exact match, reverse KL on its own samples, the teacher's text under it (NLL
and the fixed-prefix reverse KL), how its samples end; overall, per task and, with several teachers, per teacher.
What each figure is, is the stage's docstring (``ars_opd.evaluation.evaluate``).

The stage's models and its learning curves' points are all scored here, so they are measured alike; ``scored``
reads a score back from the store of scored models where one is set (``score_cache``) instead of computing it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ars_opd.config import EvaluateConfig
from ars_opd.data.answers import is_correct
from ars_opd.evaluation.held_out import HeldOut
from ars_opd.evaluation.row_teachers import per_teacher
from ars_opd.evaluation.score_cache import ScoreCache
from ars_opd.evaluation.steps import step_metrics
from ars_opd.evaluation.token_losses import (
    EXACT,
    SAMPLED_CROSS_TOKENIZER,
    own_samples,
    reverse_kl_cross_tokenizer,
    reverse_kl_on_own_samples,
    teacher_text_scores,
)
from ars_opd.lm.generation import decode_completion, eos_token_ids, generate_token_ids


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


def scored(cache: ScoreCache | None, model, data: HeldOut, is_teacher: bool, compute) -> tuple[dict, list[str]]:
    """``compute()``, or through the store of scored models where one is set (``score_cache``); ``model()``
    names the model for the store, and is called only then (it hashes files)."""
    return compute() if cache is None else cache.score(model(), data.key, is_teacher, compute)
