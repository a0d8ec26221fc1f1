"""The evaluate stage's held-out prompts, encoded once with what scoring them needs (``HeldOut``), and the check
that ``evaluate.max_new_tokens`` leaves room for every checkable answer.

Every model, and every learning-curve point, is scored on the same encoded rows, so they are encoded here once: in
the student's tokens (the shared ones), in a cross-tokenizer run again in the teacher's own, and with the teacher's
hidden rows on its own completions computed once for every model's fixed-prefix reverse KL.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import torch

from ars_opd.config import ConfigError, EvaluateConfig
from ars_opd.data import synthetic
from ars_opd.data.answers import is_checkable
from ars_opd.data.prompts import encode_completions, encode_prompts, encode_teacher_completions
from ars_opd.evaluation.score_cache import data_sha256
from ars_opd.evaluation.token_losses import TeacherTextRows


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
