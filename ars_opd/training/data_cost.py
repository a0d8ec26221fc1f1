"""What the teacher spent writing the text a run trains on: its generated tokens, each row counted once.

The equal-budget comparison can count the teacher's cost of the SFT data, as the published comparisons of
distillation against SFT do: 2·P_teacher FLOPs per token the teacher generated for the rows an arm's lineage
trained on (``ars_opd.evaluation.equal_budget``). A run adds those tokens to its budget
(``teacher_tokens``, cumulative from scratch like the other fields of ``ars_opd.training.budget``) at the
step that first draws each row; ``TeacherText`` tells which rows those are.

Who pays: the teacher writes each completion once (teacher_gen's cache), so a row is charged to the first run
of a lineage that trains on it. The sft stage charges its rows; OPD (whose GKD steps train on the SFT stage's
rows) and the control arm repeating the SFT stage's rows charge nothing new; the control on fresh rows
(``control.data: fresh``) charges each held-back row it trains on (``ars_opd.training.train_rows``).

Rows are drawn by ``batch_plan.step_indices``, a pure function of the step, the rank and that rank's sampler
seed, so every rank computes the whole world's draws of a step from every rank's seed, with no
communication, and a resumed run replays the steps before it. An injected ``shard_skew`` fault's
substitutions are not counted (a testing aid, never a real run).
"""

from __future__ import annotations

from ars_opd.config import ControlConfig
from ars_opd.data.prompts import teacher_ended
from ars_opd.training.batch_plan import BatchGeometry, step_indices


def generated_tokens(tokenizer, rows: list[dict]) -> list[int]:
    """Tokens the teacher generated for each teacher_gen row: its completion's tokens, and the EOS it ended
    with (``ars_opd.data.prompts.teacher_ended``: a completion cut at the length limit has none, and is
    trained on without one). Thinking that teacher_gen stripped (``strip_thinking``) is not counted: this is
    the text the run trains on."""
    if not rows:
        return []
    ids = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    return [len(x) + teacher_ended(r) for x, r in zip(ids, rows)]


def charges_teacher_text(stage: str, control: ControlConfig) -> bool:
    """Whether ``stage`` pays for the teacher text it trains on: sft does, a fresh control does (its rows are
    new to the lineage), OPD and a repeating control do not (the SFT stage's rows, paid for by it)."""
    return stage == "sft" or (stage == "sft_continued" and control.data == "fresh")


class TeacherText:
    """The teacher-generated tokens of the rows the whole world first trains on at each step."""

    def __init__(self, tokens: list[int], geometry: BatchGeometry, sampler_seeds: list[int], charged: bool = True):
        self.tokens, self.geometry, self.sampler_seeds, self.charged = tokens, geometry, sampler_seeds, charged
        self.drawn = bytearray(len(tokens))
        self.next_step = 0  # every step before it is marked in ``drawn``

    def _draw(self, step: int) -> int:
        new = 0
        for rank, seed in enumerate(self.sampler_seeds):
            for i in step_indices(step, len(self.tokens), self.geometry, seed, rank):
                if not self.drawn[i]:
                    self.drawn[i] = 1
                    new += self.tokens[i]
        return new

    def new_tokens(self, step: int) -> int:
        """Tokens of the rows no step before ``step`` drew (0 for a run that charges nothing)."""
        if not self.charged:
            return 0
        while self.next_step < step:  # a resumed run: replay the steps before it
            self._draw(self.next_step)
            self.next_step += 1
        if step < self.next_step:
            raise ValueError(f"step {step} was counted already (next is {self.next_step}): steps run in order")
        self.next_step = step + 1
        return self._draw(step)
