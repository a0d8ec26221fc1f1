"""The two teachers OPD can score its rollouts with: in this process, or behind a scoring endpoint.

Both fill the ``TeacherScores`` that the objective's ``teacher_signal`` names (``ars_opd.lm.opd_objectives``)
for the M scored positions of a micro-batch (the True entries of its loss mask, row-major), through
``score(tensors, objective, temperature)``:

- ``LocalTeacher``: the frozen teacher model in every worker (``opd.teacher: local``): one no-grad forward
  per micro-batch to its last hidden states; full logits are formed chunk by chunk inside the loss, the
  targets' log-probabilities or the top-k chunk by chunk here. Neither forms (B, T, V) logits.
- ``EndpointTeacher``: a served teacher (``opd.teacher: endpoint``; vLLM or the bundled server).
  The trainer never loads teacher weights. ``attach`` sends every sequence of the step's micro-batches
  (prompt + completion token ids, padding dropped) for scoring at once, with bounded concurrency and the
  teacher client's retries (``ars_opd.teacher.client.score``), and stores the answers in each micro-batch's
  tensors (``teacher_logprobs`` (M,), ``teacher_support_ids`` / ``teacher_support_logprobs`` (M, k+1)), so
  ``score`` only reads them. Scoring is all or nothing per step: a sequence that still fails after its
  retries raises ``ScoringError`` naming the endpoint before the step trains. The endpoint's numbers are
  log-softmax at temperature 1 (``check_config`` refuses what would need another temperature). Returned ids
  outside the shared vocabulary (a teacher head's padding rows) are dropped from the top-k support.
"""

from __future__ import annotations

import asyncio
import atexit
import math
from typing import TYPE_CHECKING

import torch

from ars_opd.lm.divergences import topk_support
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows, target_logprobs, topk_logprobs
from ars_opd.lm.opd_objectives import Objective, TeacherLogits, TeacherScores

if TYPE_CHECKING:  # the HTTP client is imported where used: LocalTeacher needs only torch (bench/gpu.py)
    from ars_opd.teacher.client.endpoint import ClientSettings
    from ars_opd.teacher.client.score import SequenceScores

ATTACHED = ("teacher_logprobs", "teacher_support_ids", "teacher_support_logprobs")


class LocalTeacher:
    """The frozen teacher in this process: one no-grad forward per micro-batch, to its last hidden states.

    ``score`` returns what the objective's ``teacher_signal`` names for the batch's scored positions: the
    teacher's logits as ``TeacherLogits`` (hidden states and head, projected chunk by chunk inside the loss),
    the targets' log-probabilities, or the top-k ∪ target (computed here, chunk by chunk).
    """

    def __init__(self, model: torch.nn.Module, vocab: int, chunk_size: int = 256, topk: int = 20):
        self.model, self.vocab, self.chunk_size = model.eval().requires_grad_(False), vocab, chunk_size
        self.head = OutputHead.of(self.model, vocab)
        self.topk = topk

    def attach(self, batches: list[dict[str, torch.Tensor]], objective: Objective) -> None:
        """Nothing to do ahead of the step: the local forward runs per micro-batch in ``score``."""

    @torch.no_grad()
    def score(self, tensors: dict[str, torch.Tensor], objective: Objective, temperature: float) -> TeacherScores:
        mask = tensors["loss_mask"]  # (B, T)
        targets = tensors["targets"][mask]  # (M,)
        hidden = select_rows(last_hidden_states(self.model, tensors["input_ids"], tensors["attention_mask"]), mask)
        if objective.teacher_signal == "logits":
            return TeacherScores(logits=TeacherLogits(hidden, self.head, targets))
        if objective.teacher_signal == "topk":
            top_ids, top_lp, at_1 = topk_logprobs(hidden, self.head, targets, self.topk, self.chunk_size)
            ids, lps = topk_support(top_ids, top_lp, targets, at_1)
            return TeacherScores(support_ids=ids, support_logprobs=lps, logged_logprobs=at_1)
        at_1, at_t = target_logprobs(hidden, self.head, targets, (1.0, temperature), self.chunk_size)
        return TeacherScores(token_logprobs=at_t, logged_logprobs=at_1)


class EndpointTeacher:
    """A served teacher, scored through ``prompt_logprobs`` (see the module docstring)."""

    def __init__(self, settings: "ClientSettings", model: str, vocab: int, topk: int = 20):
        self.settings, self.model, self.vocab, self.topk = settings, model, vocab, topk
        # one event loop and one connection pool for the whole run, driven from the training thread
        self._loop = asyncio.new_event_loop()
        self._client = None
        atexit.register(self.close)  # the worker has no teardown hook: close the connections at exit

    def _client_in_loop(self):
        """The run's client, made inside its event loop (its connection pool belongs to that loop)."""
        if self._client is None:
            from ars_opd.teacher.client.endpoint import make_client

            async def make():
                return make_client(self.settings)

            self._client = self._loop.run_until_complete(make())
        return self._client

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._client is not None:
            self._loop.run_until_complete(self._client.close())
            self._client = None
        self._loop.close()
        atexit.unregister(self.close)

    def attach(self, batches: list[dict[str, torch.Tensor]], objective: Objective) -> None:
        """Score every sequence of the step's micro-batches (CPU tensors) and store the scores in them."""
        sequences = []
        for t in batches:
            lengths = t["attention_mask"].sum(1).tolist()  # right-padded rows: the real tokens come first
            sequences += [t["input_ids"][b, :n].tolist() for b, n in enumerate(lengths)]
        # sampled_token needs only the actual tokens, but k >= 1 is what every vLLM version answers alike
        k = self.topk if objective.teacher_signal == "topk" else 1
        scores = self.score_rows(sequences, k)
        i = 0
        for t in batches:
            rows = scores[i : i + t["input_ids"].shape[0]]
            i += len(rows)
            t.update(_gather(rows, t["loss_mask"], t["targets"], self.vocab))

    def score_rows(self, sequences: list[list[int]], k: int) -> "list[SequenceScores]":
        """The endpoint's prompt log-probabilities (top ``k``) of every sequence, in order, all or nothing."""
        from ars_opd.teacher.client.score import score_sequences

        client = self._client_in_loop()
        return self._loop.run_until_complete(score_sequences(client, self.model, sequences, k, self.settings))

    def score(self, tensors: dict[str, torch.Tensor], objective: Objective, temperature: float) -> TeacherScores:
        if any(k not in tensors for k in ATTACHED):
            raise RuntimeError("EndpointTeacher.score before attach: the step's sequences were not scored")
        lp = tensors["teacher_logprobs"]  # (M,) at τ = 1
        if objective.teacher_signal == "topk":
            return TeacherScores(
                support_ids=tensors["teacher_support_ids"],
                support_logprobs=tensors["teacher_support_logprobs"],
                logged_logprobs=lp,
            )
        if objective.teacher_signal == "token_logprobs":
            if temperature != 1.0:
                raise ValueError("an endpoint's log-probabilities are at temperature 1 (opd.temperature must be 1.0)")
            return TeacherScores(token_logprobs=lp, logged_logprobs=lp)
        raise ValueError(f"a scoring endpoint cannot give the teacher signal {objective.teacher_signal!r}")


def _gather(
    rows: "list[SequenceScores]", loss_mask: torch.Tensor, targets: torch.Tensor, vocab: int
) -> dict[str, torch.Tensor]:
    """The scored positions' entries, in the loss mask's row-major order: (M,), (M, K), (M, K)."""
    lp, ids, lps = [], [], []
    for b, row in enumerate(rows):
        for t in loss_mask[b].nonzero().squeeze(-1).tolist():
            # position t predicts token t + 1; row.* hold positions 1..L-1, so entry t is that prediction
            y = int(targets[b, t])
            if y not in row.support_ids[t]:
                raise ValueError(f"the endpoint's scores for row {b} do not include its token at position {t + 1}")
            lp.append(row.logprobs[t])
            pairs = [(i, v) for i, v in zip(row.support_ids[t], row.support_logprobs[t]) if i < vocab]
            ids.append([i for i, _ in pairs])
            lps.append([v for _, v in pairs])
    width = max((len(x) for x in ids), default=1)
    support = torch.tensor([x + [x[0]] * (width - len(x)) for x in ids], dtype=torch.long)  # (M, K)
    support_lp = torch.tensor([v + [-math.inf] * (width - len(v)) for v in lps], dtype=torch.float32)
    return {
        "teacher_logprobs": torch.tensor(lp, dtype=torch.float32),
        "teacher_support_ids": support,
        "teacher_support_logprobs": support_lp,
    }
