"""Whether a row's answer can be checked, and checking it: one rule for the evaluation and the training log.

A row is checkable when a program can say whether an answer to it is right: a synthetic task's row (the whole
answer must equal the reference: ``ars_opd.data.synthetic.is_correct_for``; on the long-horizon tasks the final
answer) or a checkable natural kind's row with its reference (the reference in the answer's first sentence:
``ars_opd.data.natural_check``). Open-ended rows have no right answer. The evaluate stage's exact match and the
OPD step log's ``correct_rate`` both call these, so a training curve and the held-out figure count alike.
"""

from __future__ import annotations

from ars_opd.data import natural_check, synthetic


def is_checkable(row: dict) -> bool:
    """Whether a program can check a held-out row's answer: a synthetic task's or a checkable natural kind's row
    with its reference. Open-ended rows (no reference, or a kind no rule checks) are not."""
    task = row.get("task")
    return row.get("reference") is not None and (task in synthetic.TASK_NAMES or task in natural_check.CHECKABLE_KINDS)


def is_correct(row: dict, answer: str) -> bool:
    """A checkable row's answer checked by its kind's rule: the synthetic tasks' exact match
    (``synthetic.is_correct_for``), or the natural kinds' reference in the first sentence
    (``natural_check.is_correct``, which needs the question the model was asked, the last user turn)."""
    if row["task"] in synthetic.TASK_NAMES:
        return synthetic.is_correct_for(row["task"], answer, row["reference"])
    question = next(m["content"] for m in reversed(row["messages"]) if m["role"] == "user")
    return natural_check.is_correct(row["task"], answer, row["reference"], question)
