"""Where in a long answer a model first goes wrong: the step metrics of the long-horizon synthetic tasks.

On the long-horizon family (``ars_opd.config.LONG_HORIZON_TASKS``) an answer is a chain of steps, each computed
from the one before, so the first wrong step is where the model left the right path; every step after it is
usually wrong too. For the answers of one model to the held-out prompts of these tasks:

- ``step_accuracy``: the share of reference steps the answer gets right, index by index, averaged over answers;
- ``prefix_accuracy[s]``: among the prompts whose reference has more than ``s`` steps, the share of answers
  whose first ``s + 1`` steps are all right: a survival curve over the position of the first error, which
  starts at the first step's accuracy and ends at the share of answers right throughout;
- ``first_error``: how many answers first went wrong at each step index (``"none"``: every reference step
  right and nothing after them).

Present in the evaluate metrics only when the held-out prompts include long-horizon tasks, so an evaluation of
the default tasks is unchanged.
"""

from __future__ import annotations

from collections import Counter

from ars_opd.config import LONG_HORIZON_TASKS
from ars_opd.data import synthetic


def step_metrics(tasks: list[str | None], answers: list[str], references: list[str | None]) -> dict | None:
    """The step metrics of the long-horizon rows among (task, answer, reference); None when there are none."""
    checks = [
        synthetic.check_steps(a, r)
        for t, a, r in zip(tasks, answers, references)
        if t in LONG_HORIZON_TASKS and r is not None
    ]
    if not checks:
        return None
    longest = max(len(c.correct) for c in checks)
    prefix = []
    for s in range(longest):
        reach = [c for c in checks if len(c.correct) > s]
        prefix.append(sum(all(c.correct[: s + 1]) for c in reach) / len(reach))
    firsts = Counter("none" if c.first_error is None else str(c.first_error) for c in checks)
    return {
        "answers": len(checks),
        "step_accuracy": sum(c.step_accuracy for c in checks) / len(checks),
        "prefix_accuracy": prefix,
        "first_error": dict(
            sorted(firsts.items(), key=lambda kv: (kv[0] == "none", int(kv[0]) if kv[0] != "none" else 0))
        ),
    }
