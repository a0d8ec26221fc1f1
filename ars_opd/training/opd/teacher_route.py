"""OPD with several teachers (``teachers.named``): each rollout scored by its own teacher, and the columns per teacher.

``RoutedTeacher`` stands where OPD's one teacher stands (``ars_opd.training.opd.teachers``: ``attach`` then
``score`` per micro-batch) and dispatches: every row of a micro-batch carries its teacher's index
(``teacher_index`` (B,), the route applied to the row's prompt: ``ars_opd.models.teachers.Route``), each teacher
scores the sub-batch of its own rows exactly as it would score a micro-batch of them alone, and the
``TeacherScores`` of the M scored positions are assembled back in the micro-batch's row-major order:

- a local teacher (``LocalTeacher``: its weights in this worker, loaded once per worker) runs its no-grad forward
  on its rows alone; for the full-vocabulary losses its logits stay unformed until the loss asks for a chunk of
  positions (``RoutedLogits``: a chunk's rows of each teacher are a contiguous run of that teacher's own rows, so
  each teacher's head runs on exactly its positions, chunk by chunk, and nothing (M × V) is kept);
- an endpoint teacher (``EndpointTeacher``) gets the step's sequences of its rows in ``attach``, all endpoint
  teachers at once, each from a thread of its own (its event loop and connection pool are its own), so their
  requests are in flight together; its answers are stored in the micro-batches under its own keys.

What each teacher returns for its rows is what it returns for a micro-batch of those rows alone, so a routed
row's loss is the single-teacher run's loss of the same row (tests/test_teacher_route.py, loss for loss).
Local and endpoint teachers mix when the loss needs what both give (token log-probabilities, or the top-k);
the full-vocabulary losses need every teacher local (``config.check_teachers``). Top-k supports of different
widths (a served teacher's drop ids outside the vocabulary) are padded with their first id at −inf, which
``topk_terms`` ignores.

Per teacher the step log gets the rollout columns again over that teacher's rows (``PER_TEACHER``, logged as
``task/<teacher>/<column>``; the all-teacher ``task/<column>`` stay as they are): ``rollout_columns`` for what
the rollouts are (count, lengths, EOS and cut shares, correct share), ``scored_columns`` for what the loss
measured on them (the teacher's log-probability, the student's entropy, the divergence in each half). The budget
charges each row's teacher forward at its own teacher's size (``forward_flops``).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ars_opd.lm.opd_objectives import Objective, TeacherScores
from ars_opd.lm.routed_logits import RoutedLogits
from ars_opd.training.opd.teachers import ATTACHED, EndpointTeacher, LocalTeacher

ROW_KEY = "teacher_index"  # (B,) long: each row's teacher, its index in the route's names
# the columns kept per teacher (task/<teacher>/<name>): what the rollouts were and what the loss measured on them
ROLLOUT_COLUMNS = ("rollouts", "response_length", "response_length_sq", "eos_rate", "truncation_rate")
SCORED_COLUMNS = ("teacher_logprob", "entropy", "divergence_first_half", "divergence_second_half")
PER_TEACHER = (*ROLLOUT_COLUMNS, "correct_rate", *SCORED_COLUMNS)
# the row-aligned tensors of a micro-batch a teacher reads (sliced to its rows)
_ROW_TENSORS = ("input_ids", "attention_mask", "loss_mask", "targets")

Member = LocalTeacher | EndpointTeacher


def column(teacher: str, name: str) -> str:
    """A per-teacher column's name in the task's metrics (the log writes it as ``task/<teacher>/<name>``)."""
    return f"{teacher}/{name}"


def _attached_key(k: int, key: str) -> str:
    return f"route{k}_{key}"


class RoutedTeacher:
    """Several teachers behind OPD's one-teacher interface (see the module docstring)."""

    def __init__(self, names: tuple[str, ...], members: list[Member], parameters: list[int], vocab: int):
        if len(names) != len(members) or len(names) != len(parameters):
            raise ValueError("one member and one parameter count per teacher name")
        self.names, self.members, self.parameters, self.vocab = names, members, parameters, vocab

    @property
    def endpoints(self) -> list[int]:
        return [k for k, m in enumerate(self.members) if isinstance(m, EndpointTeacher)]

    def attach(self, batches: list[dict[str, torch.Tensor]], objective: Objective) -> None:
        """Every endpoint teacher scores the step's sequences of its rows, all teachers at once; each micro-batch
        then holds each endpoint teacher's scores of its rows under that teacher's keys. Local teachers: nothing."""
        endpoints = self.endpoints
        if not endpoints:
            return

        def one(k: int) -> None:
            subs = [_rows_of(t, t[ROW_KEY] == k) for t in batches]
            if not any(sub["input_ids"].shape[0] for sub in subs):
                return
            self.members[k].attach(subs, objective)  # its scores of its rows, as for micro-batches of them alone
            for t, sub in zip(batches, subs):
                t.update({_attached_key(k, key): sub[key] for key in ATTACHED})

        if len(endpoints) == 1:
            one(endpoints[0])
            return
        with ThreadPoolExecutor(max_workers=len(endpoints)) as pool:  # each endpoint's own loop, in its own thread
            list(pool.map(one, endpoints))

    def score(self, tensors: dict[str, torch.Tensor], objective: Objective, temperature: float) -> TeacherScores:
        index = tensors[ROW_KEY]  # (B,)
        mask = tensors["loss_mask"]
        owner = index[mask.nonzero()[:, 0]]  # (M,) each scored position's teacher
        m, device = int(owner.numel()), mask.device
        got: list[tuple[int, TeacherScores, torch.Tensor]] = []
        for k, member in enumerate(self.members):
            rows = index == k
            if not bool(rows.any()):
                continue
            sub = _rows_of(tensors, rows)
            if isinstance(member, EndpointTeacher):
                sub.update({key: tensors[_attached_key(k, key)] for key in ATTACHED})
            got.append((k, member.score(sub, objective, temperature), (owner == k).nonzero().squeeze(-1)))
        if objective.teacher_signal == "logits":
            parts = [(s.logits, positions) for _, s, positions in got]
            return TeacherScores(logits=RoutedLogits(parts, m, self.vocab, device))
        out = TeacherScores()
        for field in ("token_logprobs", "logged_logprobs"):
            if all(getattr(s, field) is not None for _, s, _ in got):
                setattr(out, field, _placed(m, [(getattr(s, field), p) for _, s, p in got], device))
        if objective.teacher_signal == "topk":
            width = max(s.support_ids.shape[1] for _, s, _ in got)
            ids = torch.zeros((m, width), dtype=torch.long, device=device)
            lps = torch.full((m, width), -math.inf, dtype=torch.float32, device=device)
            for _, s, p in got:
                w = s.support_ids.shape[1]
                ids[p, :w] = s.support_ids
                ids[p, w:] = s.support_ids[:, :1]  # padding: the first id again, at −inf (ignored)
                lps[p, :w] = s.support_logprobs.float()
            out.support_ids, out.support_logprobs = ids, lps
        return out

    def forward_flops(self, tensors: dict[str, torch.Tensor]) -> float:
        """2·P_teacher per real token of each row, each row at its own teacher's size (the budget's teacher forward;
        an endpoint's is counted as the run's compute too, as ``opd.teacher: endpoint`` counts it)."""
        real = tensors["attention_mask"].sum(1)
        index = tensors[ROW_KEY]
        return float(sum(2 * p * int(real[index == k].sum()) for k, p in enumerate(self.parameters)))


def _rows_of(tensors: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The micro-batch's row-aligned tensors a teacher reads, at ``rows`` (a (B,) bool mask), in order."""
    return {key: tensors[key][rows] for key in _ROW_TENSORS}


def _placed(m: int, parts: list[tuple[torch.Tensor, torch.Tensor]], device) -> torch.Tensor:
    """(M,) from each teacher's values at its global positions."""
    out = torch.full((m,), float("nan"), dtype=torch.float32, device=device)
    for values, positions in parts:
        out[positions] = values.float()
    return out


def rollout_columns(
    names: tuple[str, ...],
    batch: dict[str, torch.Tensor],
    cut: torch.Tensor,
    counted: float,
    correct: Callable[[torch.Tensor], tuple[int, int]] | None = None,
) -> dict[str, tuple[float, float]]:
    """A micro-batch's rollout columns per teacher, each over that teacher's rows as the all-teacher column is over
    all rows: (sum, count) pairs. ``batch``: its ``teacher_index``, ``lengths`` and ``has_eos`` (B,); ``cut`` (B,)
    the rollouts cut at max_new_tokens; ``counted``: 1 where this micro-batch counts the step's rollouts (rank 0's
    first), else 0; ``correct(rows)``: (right, checked) over the rows a (B,) bool mask selects, where the data can
    be checked."""
    index, lengths, has_eos = batch[ROW_KEY], batch["lengths"], batch["has_eos"]
    out: dict[str, tuple[float, float]] = {}
    for k, name in enumerate(names):
        rows = index == k
        n = float(rows.sum())
        out[column(name, "rollouts")] = (n, counted)
        out[column(name, "response_length")] = (float(lengths[rows].sum()), n)
        out[column(name, "response_length_sq")] = (float(lengths[rows].double().pow(2).sum()), n)
        out[column(name, "eos_rate")] = (float(has_eos[rows].sum()), n)
        out[column(name, "truncation_rate")] = (float(cut[rows].sum()), n)
        if correct is not None:
            right, checked = correct(rows)
            out[column(name, "correct_rate")] = (float(right), float(checked))
    return out


def scored_columns(
    names: tuple[str, ...],
    owner: torch.Tensor,
    values: dict[str, torch.Tensor],
    first: torch.Tensor,
    second: torch.Tensor,
) -> dict[str, tuple[float, float]]:
    """A micro-batch's loss columns per teacher over its scored positions: ``owner`` (M,) each position's teacher;
    ``values`` (M,) each what the all-teacher columns sum: ``teacher_logprob``, ``entropy`` and ``divergence`` (the
    objective's per-token value); ``first`` and ``second`` (M,) bool, the positions in each half of their
    completion."""
    out: dict[str, tuple[float, float]] = {}
    for k, name in enumerate(names):
        mine = owner == k
        n = float(mine.sum())
        out[column(name, "teacher_logprob")] = (float(values["teacher_logprob"][mine].sum()), n)
        out[column(name, "entropy")] = (float(values["entropy"][mine].sum()), n)
        f, s = first & mine, second & mine
        out[column(name, "divergence_first_half")] = (float(values["divergence"][f].sum()), float(f.sum()))
        out[column(name, "divergence_second_half")] = (float(values["divergence"][s].sum()), float(s.sum()))
    return out


def metric_names(names: tuple[str, ...], checkable: bool) -> list[str]:
    """The per-teacher columns OPD reports besides its own (``correct_rate`` where the data can be checked)."""
    return [column(t, c) for t in names for c in PER_TEACHER if c != "correct_rate" or checkable]
