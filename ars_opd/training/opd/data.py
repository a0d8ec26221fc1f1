"""The rows an OPD run trains on: the prompts encoded once, with the teacher's cached completions (GKD's teacher-text
steps and the anchor), each row's task label and, where a program can check its answer, the row itself.

``encode_rows`` keeps the rows whose prompt fits ``opd.max_prompt_tokens`` (and, across tokenizers, leaves room in
the teacher's context), drops teacher completions cut at their length limit with ``truncated_completions: drop``
when teacher text is trained on, and counts every row it leaves out for the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ars_opd.config import OPDConfig
from ars_opd.data.answers import is_checkable
from ars_opd.data.prompts import encode_prompts, encode_teacher_completions, teacher_ended


@dataclass
class OPDData:
    """The encoded prompts a run trains on, with the teacher's cached completions and each row's task label."""

    prompts: list[list[int]]
    completions: list[list[int]]  # the teacher's, for GKD's teacher-text steps
    tasks: list[str | None] | None = None  # each row's task label (synthetic data), for a task-selective fault
    counts: dict = field(default_factory=dict)  # rows kept and dropped, for the manifest
    # each row as the answer check reads it (task, reference, messages) where a program can check its answer
    # (``ars_opd.data.answers``: the synthetic tasks, the natural prompts' checkable kinds), else None
    check_rows: list[dict | None] | None = None
    teacher_prompts: list[list[int]] | None = None  # opd.cross_tokenizer: each prompt in the teacher's own tokens
    teachers: list[int] | None = None  # several teachers (teachers.named): each row's, by its index in the route

    def checkable(self) -> bool:
        """Whether any row's answer can be checked (the correct_rate column then counts those rows)."""
        return bool(self.check_rows) and any(r is not None for r in self.check_rows)


def encode_rows(
    tokenizer,
    rows: list[dict],
    cfg: OPDConfig,
    teacher_tokenizer=None,
    teacher_positions: int | None = None,
    route: list[int] | None = None,
) -> OPDData:
    """The rows whose prompt fits the budget, encoded, and the counts. A teacher completion has an EOS only
    where the teacher ended it; with ``truncated_completions: drop`` and teacher-text steps
    (on_policy_fraction < 1) a row whose completion the teacher was cut off in is left out. Across tokenizers
    (``teacher_tokenizer``) the prompts are also encoded in the teacher's tokens, and a row whose teacher prompt
    leaves fewer than ``max_new_tokens`` of the teacher's ``teacher_positions`` is left out (counted): its
    teacher row could not be scored. A text the teacher spells in more tokens than the student can still overrun
    at a step; the teacher then stops the run naming the lengths. ``route``: each row's teacher of several (its
    index in the route's names), kept for the rows kept."""
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    completions = encode_teacher_completions(tokenizer, rows)
    fits = [i for i, p in enumerate(prompts) if len(p) <= cfg.max_prompt_tokens]
    drop_cut = cfg.truncated_completions == "drop" and cfg.on_policy_fraction < 1
    keep = [i for i in fits if not (drop_cut and not teacher_ended(rows[i]))]
    counts = {
        "rows": len(rows),
        "kept": len(keep),
        "dropped_prompt_over_budget": len(rows) - len(fits),
        "dropped_teacher_truncated": len(fits) - len(keep),
        "teacher_truncated": sum(not teacher_ended(r) for r in rows),
    }
    teacher_prompts = None
    if teacher_tokenizer is not None:  # the same messages under the teacher's own chat template
        teacher_prompts = encode_prompts(teacher_tokenizer, [rows[i]["messages"] for i in keep])
        if teacher_positions is not None:  # a prompt the teacher cannot read with room for an answer: left out
            room = [j for j, tp in enumerate(teacher_prompts) if len(tp) + cfg.max_new_tokens <= teacher_positions]
            counts["dropped_teacher_prompt_over_context"] = len(keep) - len(room)
            counts["kept"] = len(room)
            keep, teacher_prompts = [keep[j] for j in room], [teacher_prompts[j] for j in room]
    return OPDData(
        [prompts[i] for i in keep],
        [completions[i] for i in keep],
        [rows[i].get("task") for i in keep],
        counts,
        [rows[i] if is_checkable(rows[i]) else None for i in keep],
        teacher_prompts,
        [route[i] for i in keep] if route is not None else None,
    )
