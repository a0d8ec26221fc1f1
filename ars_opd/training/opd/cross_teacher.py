"""The teacher of cross-tokenizer OPD (``opd.cross_tokenizer``): it scores the student's text in its own tokens.

The student's rollouts are token ids of the student's vocabulary. For each completion ``attach`` renders the text,
tokenises it with the teacher's tokenizer and aligns the two tokenisations into spans
(``ars_opd.lm.token_alignment``), then builds the teacher's own rows: its prompt (the row's messages under the
teacher's chat template, encoded once at the start) followed by its tokens of the text, and its end-of-turn token
where the student ended. Only the aligned teacher tokens are scored (``teacher_loss_mask``).

``score`` then gives the objective what it needs at the student's scored positions:

- ``sampled_token``: each student token's span (``span_index``) and each span's teacher log-probability
  (``span_logprobs``, the sum of its teacher tokens' at τ): the chain rule makes the per-sequence estimate
  exact (``divergences.span_sampled_token_terms``); and each token's rollout (``sequence_index``), for the span
  credit's leave-one-out baseline (``opd.span_baseline``);
- ``cross_vocab``: the teacher's distribution at each span's first token (the position where both sides predict
  the next token from the same text) through ``TeacherLogits`` over the teacher's vocabulary, and the
  student-to-teacher row map (``divergences.cross_vocab_terms``).

The teacher is the local model (its forward on its own rows, one per micro-batch, no grad) or a scoring endpoint
(``prompt_logprobs`` of the teacher's own token ids, all of the step's rows at once in ``attach``; sampled_token
only). Cost over same-tokenizer OPD: the tokenisation and alignment on the CPU (prefix decodes, quadratic in a
completion's tokens), the teacher's forward on its own, possibly longer, rows, and one no-grad pass of the
student's head over the completion positions (a span's credit needs all of its tokens' log q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ars_opd.lm.divergences import span_shares
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.opd_objectives import Objective, TeacherLogits, TeacherScores
from ars_opd.lm.token_alignment import UNALIGNED, CrossTokenizer, special_ids

TEACHER_KEYS = ("teacher_input_ids", "teacher_attention_mask", "teacher_loss_mask", "teacher_targets")


@dataclass(frozen=True)
class TeacherSide:
    """What the teacher's rows are made of: each training row's prompt in the teacher's tokens (its own chat
    template), its vocabulary and pad id, and how many positions it reads (None: unbounded)."""

    prompts: list[list[int]]
    vocab: int
    pad_id: int
    max_positions: int | None = None


class CrossTokenizerTeacher:
    """See the module docstring. ``vocab``: the STUDENT's vocabulary (what the trainer's head covers); ``model``:
    the local teacher, or None with ``endpoint`` (an ``EndpointTeacher`` whose client scores the teacher's rows)."""

    def __init__(
        self,
        cross: CrossTokenizer,
        side: TeacherSide,
        vocab: int,
        *,
        model: torch.nn.Module | None = None,
        endpoint=None,
        chunk_size: int = 256,
    ):
        if (model is None) == (endpoint is None):
            raise ValueError("a cross-tokenizer teacher is a local model or an endpoint, exactly one")
        self.cross, self.teacher_prompts = cross, side.prompts
        self.vocab, self.teacher_vocab, self.pad_id = vocab, side.vocab, side.pad_id
        self.max_positions, self.chunk_size, self.endpoint = side.max_positions, chunk_size, endpoint
        self.model = model.eval().requires_grad_(False) if model is not None else None
        self.head = OutputHead.of(self.model, side.vocab) if model is not None else None
        self._shared: tuple[torch.Tensor, torch.Tensor] | None = None

    def _rows(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The teacher's rows of one micro-batch and the alignment of its scored positions."""
        mask, targets = t["loss_mask"], t["targets"]
        seqs, starts, spans_t, spans_s = [], [], [], []
        offset = 0
        unaligned = 0
        for b, row in enumerate(t["row_index"].tolist()):
            completion = targets[b][mask[b]].tolist()
            ra = self.cross.align(completion)
            a = ra.alignment
            prompt = self.teacher_prompts[row]
            seqs.append(list(prompt) + list(ra.teacher_ids))
            starts.append(len(prompt))
            spans_s += [s + offset if s != UNALIGNED else UNALIGNED for s in a.student_span]
            spans_t.append([s + offset if s != UNALIGNED else UNALIGNED for s in a.teacher_span])
            offset += a.n_spans
            unaligned += a.unaligned_student
        width = max(len(s) for s in seqs)
        if self.max_positions is not None and width > self.max_positions:
            raise ValueError(
                f"a teacher row is {width} tokens, beyond the teacher's {self.max_positions} positions: its tokenizer "
                "spells the student's text in more tokens; lower opd.max_new_tokens or opd.max_prompt_tokens"
            )
        B = len(seqs)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, width), dtype=torch.long)
        loss_mask = torch.zeros((B, width), dtype=torch.bool)
        tgt = torch.full((B, width), -100, dtype=torch.long)
        teacher_span = []
        for b, (seq, p, spans) in enumerate(zip(seqs, starts, spans_t)):
            ids[b, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attn[b, : len(seq)] = 1
            for u, s in enumerate(spans):  # position p - 1 + u predicts the teacher's completion token u
                if s != UNALIGNED:
                    loss_mask[b, p - 1 + u] = True
                    tgt[b, p - 1 + u] = seq[p + u]
                    teacher_span.append(s)
        return {
            "teacher_input_ids": ids,
            "teacher_attention_mask": attn,
            "teacher_loss_mask": loss_mask,
            "teacher_targets": tgt,
            "teacher_span": torch.tensor(teacher_span, dtype=torch.long),
            "student_span": torch.tensor(spans_s, dtype=torch.long),
            "n_spans": torch.tensor(offset),
            "unaligned": torch.tensor(unaligned),
        }

    def attach(self, batches: list[dict[str, torch.Tensor]], objective: Objective) -> None:
        """Align every row of the step's micro-batches (CPU tensors) and store the teacher's rows in them; an
        endpoint scores them all here."""
        for t in batches:
            t.update(self._rows(t))
        if self.endpoint is None:
            return
        sequences = []
        for t in batches:
            lengths = t["teacher_attention_mask"].sum(1).tolist()
            sequences += [t["teacher_input_ids"][b, :n].tolist() for b, n in enumerate(lengths)]
        rows = self.endpoint.score_rows(sequences, k=1)
        i = 0
        for t in batches:
            lp = []
            for b in range(t["teacher_input_ids"].shape[0]):
                for pos in t["teacher_loss_mask"][b].nonzero().squeeze(-1).tolist():
                    lp.append(rows[i].logprobs[pos])  # entry pos predicts token pos + 1
                i += 1
            t["teacher_token_logprobs"] = torch.tensor(lp, dtype=torch.float32)

    @torch.no_grad()
    def score(self, tensors: dict[str, torch.Tensor], objective: Objective, temperature: float) -> TeacherScores:
        if "teacher_span" not in tensors:
            raise RuntimeError("CrossTokenizerTeacher.score before attach: the step's rows were not aligned")
        span_s, span_t = tensors["student_span"], tensors["teacher_span"]
        n_spans = int(tensors["n_spans"])
        if objective.teacher_signal == "logits":  # cross_vocab: the teacher's distribution at each span's start
            if self.model is None:
                raise ValueError("the cross_vocab loss needs the teacher's distributions: a local teacher")
            hidden = self._hidden(tensors)
            targets = tensors["teacher_targets"][tensors["teacher_loss_mask"]]
            (at_1,) = target_logprobs(hidden, self.head, targets, (1.0,), self.chunk_size)
            shared = self.shared_vocab(hidden.device)
            return TeacherScores(
                logits=TeacherLogits(hidden, self.head),
                cross_rows=_student_to_teacher_starts(span_s, span_t).to(hidden.device),
                shared_vocab=shared,
                logged_logprobs=span_shares(span_s, _span_sums(at_1, span_t, n_spans)),
            )
        if objective.teacher_signal != "token_logprobs":
            raise ValueError(f"cross-tokenizer OPD cannot give the teacher signal {objective.teacher_signal!r}")
        if self.endpoint is not None:
            if temperature != 1.0:
                raise ValueError("an endpoint's log-probabilities are at temperature 1 (opd.temperature must be 1.0)")
            at_1 = at_t = tensors["teacher_token_logprobs"].float()
        else:
            hidden = self._hidden(tensors)
            targets = tensors["teacher_targets"][tensors["teacher_loss_mask"]]
            at_1, at_t = target_logprobs(hidden, self.head, targets, (1.0, temperature), self.chunk_size)
        span_t_lp = _span_sums(at_t, span_t, n_spans)
        span_1_lp = _span_sums(at_1, span_t, n_spans)
        return TeacherScores(
            span_index=span_s,
            span_logprobs=span_t_lp,
            logged_logprobs=span_shares(span_s, span_1_lp),
            sequence_index=tensors["loss_mask"].nonzero()[:, 0].to(span_s.device),  # row-major, as the scored rows
        )

    def shared_vocab(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(student ids, teacher ids) of the tokens both vocabularies spell alike (``shared_vocabulary``), on
        ``device``; mapped once."""
        if self._shared is None:
            self._shared = shared_vocabulary(self.cross.student, self.cross.teacher, self.vocab, self.teacher_vocab)
        return tuple(x.to(device) for x in self._shared)

    def _hidden(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = tensors["teacher_loss_mask"]
        out = last_hidden_states(self.model, tensors["teacher_input_ids"], tensors["teacher_attention_mask"])
        return select_rows(out, mask)


def _span_sums(values: torch.Tensor, spans: torch.Tensor, n_spans: int) -> torch.Tensor:
    out = torch.zeros(n_spans, dtype=torch.float32, device=values.device)
    return out.index_add_(0, spans.to(values.device), values.float())


def _student_to_teacher_starts(span_s: torch.Tensor, span_t: torch.Tensor) -> torch.Tensor:
    """(M,) for each scored student token that starts its span, the index of the teacher's scored row that starts
    the same span (both predict their next token from the same text); -1 elsewhere."""
    rows = torch.full_like(span_s, -1)
    first_t: dict[int, int] = {}
    for u, s in enumerate(span_t.tolist()):
        first_t.setdefault(s, u)
    seen: set[int] = set()
    for m, s in enumerate(span_s.tolist()):
        if s >= 0 and s not in seen:
            seen.add(s)
            rows[m] = first_t.get(s, -1)
    return rows


def token_strings(tokenizer, vocab: int) -> dict[str, int]:
    """Each ordinary token's text as its tokenizer decodes it alone, to its first id: special tokens, and pieces that
    are no whole text (a byte-level token inside a multi-byte character decodes to U+FFFD), are left out. A
    SentencePiece tokenizer decodes a lone "▁the" as "the", so there a word and its space-prefixed form share a
    string: the map is exact-string matching of what each tokenizer writes, nothing more."""
    special = special_ids(tokenizer)
    out: dict[str, int] = {}
    texts = tokenizer.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False)
    for i, text in enumerate(texts):
        if i in special or not text or "\ufffd" in text:
            continue
        out.setdefault(text, i)
    return out


def shared_vocabulary(student, teacher, student_vocab: int, teacher_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(student ids (K,), teacher ids (K,)): the tokens whose decoded text is the same string on both sides
    (``token_strings``), in the student's id order."""
    s, t = token_strings(student, student_vocab), token_strings(teacher, teacher_vocab)
    pairs = sorted((i, t[text]) for text, i in s.items() if text in t)
    if not pairs:
        raise ValueError("the two vocabularies share no token: the cross_vocab loss has nothing to compare")
    ids_s, ids_t = zip(*pairs)
    return torch.tensor(ids_s, dtype=torch.long), torch.tensor(ids_t, dtype=torch.long)


def max_positions(model_or_config) -> int | None:
    config = getattr(model_or_config, "config", model_or_config)
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n is not None and not math.isinf(n) else None
