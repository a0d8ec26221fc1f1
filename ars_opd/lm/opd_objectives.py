"""The on-policy distillation losses, chosen by name (``opd.loss``) from one registry.

An ``Objective`` says what it needs from the teacher and what it demands of the rollouts, and gives the
per-row loss and logit gradient (``RowTerms``) from which ``Objective.loss`` computes the step's summed loss
out of the student's last hidden states and output head, one chunk of positions at a time
(``ars_opd.lm.head.chunked_head_loss``: no (tokens × vocabulary) tensor on either side). ``check_config``
(run by the opd stage before it starts workers, and by ``ars-opd params``) and the OPD trainer read only
this registry, so a new loss is one new entry here (its rules in ``ars_opd.config.RULES``, which
the params check reads without torch).

The teacher's side is a ``TeacherScores``: what a teacher said about the M scored positions of a batch (the
True entries of its loss mask, in row-major order). A teacher object fills the fields its objective's
``teacher_signal`` names, so a teacher that is not a local model (an endpoint returning log-probabilities)
plugs in at that one boundary.

- ``full_vocab``: the divergence of ``ars_opd.lm.divergences`` (β: 0 forward KL, 1 reverse KL, in between
  generalised JSD) at temperature τ, exact over the vocabulary; needs the teacher's full distribution
  (``TeacherLogits``: the teacher's hidden states and head, projected one chunk at a time).
- ``topk``: the same divergences over each position's teacher top-k (``opd.topk``) ∪ the trained token,
  both distributions renormalised there (``divergences.topk_terms``); needs only what a served teacher's
  ``prompt_logprobs`` return. An approximation: the student's mass outside that set is ignored.
- ``constant_advantage``: a control, not a distillation loss: the sampled-token policy gradient with every
  token's advantage a constant (``opd.constant_advantage``, < 0: each sampled token pushed down alike), so the
  update carries no teacher information; its logged value is the same reverse-KL estimate as sampled_token's.
- ``sampled_token``: the policy-gradient estimator of reverse KL from the teacher's log-probability of
  the sampled tokens alone. Its value is the reverse-KL estimate Σ(log q − log p) of those tokens and its
  gradient the surrogate's (−Σ A·log q is often negative and is no divergence, so it is never logged). The
  gradient is reverse KL's only for tokens drawn from the student at τ with no nucleus cut-off and no
  teacher-written completions, hence ``exact_on_policy``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from ars_opd.config import RULES, ObjectiveRules, OPDConfig
from ars_opd.config import check_objective as check_rules
from ars_opd.lm.divergences import (
    cross_vocab_terms,
    divergence_terms,
    sampled_token_advantage_terms,
    sampled_token_terms,
    span_sampled_token_terms,
    topk_terms,
)
from ars_opd.lm.head import OutputHead, RowTerms, chunked_head_loss, target_logprobs


class TeacherLogits:
    """The teacher's logits at the M scored positions, formed one chunk of rows at a time and never kept.

    hidden: (M, H_T) the teacher's last hidden states at those positions; head: its output head over the
    shared vocabulary; targets: (M,) the tokens the student is trained on, or None. Forming a chunk also
    records log p_T(target) at τ = 1 for those rows (``target_logprobs``, for the log), so the teacher's head
    runs once per chunk: the record is complete once a loss has walked every row.
    """

    def __init__(self, hidden: torch.Tensor, head: OutputHead, targets: torch.Tensor | None = None):
        self.hidden, self.head, self.targets = hidden, head, targets
        self.target_logprobs = torch.full((hidden.shape[0],), float("nan"), device=hidden.device)  # (M,)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """fp32 logits (end − start, V) of rows start..end-1."""
        with torch.no_grad():
            z = self.head.logits(self.hidden[start:end])
            if self.targets is not None:
                y = self.targets[start:end, None]
                self.target_logprobs[start:end] = z.gather(-1, y).squeeze(-1) - torch.logsumexp(z, -1)
        return z


@dataclass
class TeacherScores:
    """What the teacher said about the M scored positions: what the objective's ``teacher_signal`` names."""

    logits: TeacherLogits | None = None
    """The full distribution, chunk by chunk (``teacher_signal == "logits"``)."""
    token_logprobs: torch.Tensor | None = None
    """(M,) log p_T of the targets at the objective's temperature (``teacher_signal == "token_logprobs"``)."""
    logged_logprobs: torch.Tensor | None = None
    """(M,) log p_T of the targets at τ = 1, for the step log (from ``logits`` once the loss has run, if None)."""
    support_ids: torch.Tensor | None = None
    """(M, k+1) the teacher's top-k ∪ the target (``teacher_signal == "topk"``; ``divergences.topk_support``)."""
    support_logprobs: torch.Tensor | None = None
    """(M, k+1) log p_T of ``support_ids`` at τ = 1, −inf at unused slots."""
    span_index: torch.Tensor | None = None
    """(M,) cross-tokenizer OPD: the span of each scored student token (-1: none; ``ars_opd.lm.token_alignment``)."""
    span_logprobs: torch.Tensor | None = None
    """(S,) log p_T of each span (the sum of the teacher's own tokens in it) at the objective's temperature."""
    cross_rows: torch.Tensor | None = None
    """(M,) cross_vocab: for each scored student token that starts its span, the row of ``logits`` (the teacher's
    scored rows) that starts the same span; -1 elsewhere."""
    shared_vocab: tuple[torch.Tensor, torch.Tensor] | None = None
    """cross_vocab: (student ids (K,), teacher ids (K,)) of the tokens both vocabularies spell alike."""
    student_logprobs: torch.Tensor | None = None
    """(M,) log q of the scored tokens at the objective's temperature, no gradient: a span's credit needs all its
    tokens' (``Objective.loss`` fills it before the chunked loss when ``span_index`` is set)."""
    sequence_index: torch.Tensor | None = None
    """(M,) cross-tokenizer OPD: the rollout (row of the micro-batch) of each scored student token, for the span
    credit's leave-one-out baseline (``opd.span_baseline``)."""

    def target_logprobs(self) -> torch.Tensor:
        """(M,) log p_T(target) at τ = 1 (the ``teacher_logprob`` column)."""
        if self.logged_logprobs is not None:
            return self.logged_logprobs
        if self.logits is None:
            raise ValueError("the teacher scores hold neither token log-probabilities nor logits")
        return self.logits.target_logprobs


TermsFactory = Callable[[TeacherScores, torch.Tensor, float, float], RowTerms]


@dataclass(frozen=True)
class Objective(ObjectiveRules):
    """A loss: its rules (``ars_opd.config.RULES``) and how it computes."""

    terms: TermsFactory | None = None
    """(teacher scores, targets (M,), beta, temperature) -> RowTerms: per-row loss and its gradient with
    respect to the student's logits (fp32, (c,) and (c, V)) for a chunk of the M rows."""

    def loss(
        self,
        hidden: torch.Tensor,
        head: OutputHead,
        teacher: TeacherScores,
        targets: torch.Tensor,
        beta: float,
        temperature: float,
        chunk_size: int,
        *,
        row_weights: torch.Tensor | None = None,
        record: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        penalty: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int]:
        """(summed loss over the M rows with grad to ``hidden`` (M, H) and the head, M). ``row_weights`` (M,):
        each row's loss and gradient scaled by its weight (importance weights of rollouts sampled by an older
        policy; ``ars_opd.training.opd``). ``record`` (M,) fp32, if given, receives each row's own value, before
        any weight (the per-token divergence the step log splits by position); ``entropy`` (M,) fp32 the
        student's entropy at τ = 1 at each row (the rollout-health column), from the same logits; ``penalty`` (M,)
        a policy-gradient penalty coefficient per row (``with_penalty``), added after the record and weighted as
        the loss is."""
        if teacher.span_index is not None and teacher.student_logprobs is None:  # one no-grad head pass
            logq = target_logprobs(hidden.detach(), head, targets, (temperature,), chunk_size)[0]
            teacher = dataclasses.replace(teacher, student_logprobs=logq)
        terms = self.terms(teacher, targets, beta, temperature)
        if record is not None:
            terms = recorded(terms, record)
        if penalty is not None:
            terms = with_penalty(terms, targets, penalty)
        if entropy is not None:
            terms = _with_entropy(terms, entropy)
        if row_weights is not None:
            terms = weighted(terms, row_weights)
        return chunked_head_loss(hidden, head, terms, chunk_size), int(hidden.shape[0])


def recorded(terms: RowTerms, out: torch.Tensor) -> RowTerms:
    """``terms`` that also copy each row's value into ``out`` (the loss walks every row once, chunk by chunk)."""

    def recorded(z: torch.Tensor, start: int, end: int, need_grad: bool):
        value, grad = terms(z, start, end, need_grad)
        out[start:end] = value.detach().float()
        return value, grad

    return recorded


def _with_entropy(terms: RowTerms, out: torch.Tensor) -> RowTerms:
    """``terms`` that first write each row's entropy H(softmax(z)) at τ = 1 into ``out`` (before ``terms`` may
    overwrite z): with z' = z − max, H = logsumexp(z') − Σ softmax(z')·z', all of it ≥ 0 up to rounding."""

    def with_entropy(z: torch.Tensor, start: int, end: int, need_grad: bool):
        with torch.no_grad():
            shifted = z - z.amax(-1, keepdim=True)  # (c, V)
            lse = torch.logsumexp(shifted, -1)  # (c,)
            out[start:end] = lse - (torch.softmax(shifted, -1) * shifted).sum(-1)
        return terms(z, start, end, need_grad)

    return with_entropy


def with_penalty(terms: RowTerms, targets: torch.Tensor, coefficient: torch.Tensor) -> RowTerms:
    """``terms`` plus a policy-gradient penalty on the sampled tokens: row i's value gains c_i·log q(y_i) and its
    gradient c_i·(onehot(y_i) − q), for c (M,) >= 0 (``opd.truncated_rollouts: penalize``: the overlong penalty
    on a cut rollout's tokens, 0 elsewhere). q is the student's distribution at τ = 1, taken before ``terms`` may
    overwrite z; rows with c = 0 cost nothing beyond the log-softmax."""

    def penalised(z: torch.Tensor, start: int, end: int, need_grad: bool):
        c = coefficient[start:end].float()
        if not bool((c != 0).any()):
            return terms(z, start, end, need_grad)
        y = targets[start:end, None]
        with torch.no_grad():
            log_q = torch.log_softmax(z, -1)  # (c, V), before terms overwrite z
        value, grad = terms(z, start, end, need_grad)
        value = value + c * log_q.gather(-1, y).squeeze(-1)
        if grad is not None:
            q = log_q.exp_()
            q.scatter_add_(-1, y, torch.full_like(y, -1.0, dtype=q.dtype))  # q − onehot(y)
            grad = grad.sub_(q.mul_(c[:, None]))
        return value, grad

    return penalised


def weighted(terms: RowTerms, weights: torch.Tensor) -> RowTerms:
    """``terms`` with row i's value and gradient multiplied by weights[i] (a constant: no gradient through it)."""

    def weighted(z: torch.Tensor, start: int, end: int, need_grad: bool):
        value, grad = terms(z, start, end, need_grad)
        w = weights[start:end].to(value.dtype)
        return value * w, (None if grad is None else grad.mul_(w[:, None].to(grad.dtype)))

    return weighted


def _full_vocab(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
    if teacher.logits is None:
        raise ValueError("the full_vocab loss needs the teacher's logits (TeacherScores.logits)")
    return divergence_terms(teacher.logits.rows, beta, temperature)


def _sampled_token(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
    if teacher.span_index is not None:  # across tokenizers: span by span
        return span_sampled_token_terms(
            teacher.span_index, teacher.span_logprobs, teacher.student_logprobs, targets, temperature
        )
    if teacher.token_logprobs is None:
        raise ValueError("the sampled_token loss needs the teacher's token log-probabilities")
    return sampled_token_terms(teacher.token_logprobs, targets, temperature)


def _span_sampled_token_loo(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
    """``loss: sampled_token`` across tokenizers with ``opd.span_baseline: leave_one_out``: each span credit less the
    mean credit of the micro-batch's other rollouts (``divergences.span_sampled_token_terms``)."""
    if teacher.span_index is None or teacher.sequence_index is None:
        raise ValueError("opd.span_baseline needs a cross-tokenizer teacher's spans and rollouts (opd.cross_tokenizer)")
    return span_sampled_token_terms(
        teacher.span_index,
        teacher.span_logprobs,
        teacher.student_logprobs,
        targets,
        temperature,
        sequence_index=teacher.sequence_index,
    )


def _cross_vocab(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
    if teacher.logits is None or teacher.cross_rows is None or teacher.shared_vocab is None:
        raise ValueError("the cross_vocab loss needs a cross-tokenizer teacher (opd.cross_tokenizer)")
    return cross_vocab_terms(
        lambda rows: teacher.logits.head.logits(teacher.logits.hidden[rows]),
        teacher.cross_rows,
        *teacher.shared_vocab,
        beta,
        temperature,
    )


def constant_advantage(advantage: float) -> TermsFactory:
    """The factory of ``loss: constant_advantage`` with this advantage (``opd.constant_advantage``)."""

    def factory(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
        if teacher.token_logprobs is None:
            raise ValueError("the constant_advantage loss logs the teacher's token log-probabilities: none were given")
        return sampled_token_advantage_terms(teacher.token_logprobs, targets, advantage, temperature)

    return factory


def _topk(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
    if teacher.support_ids is None or teacher.support_logprobs is None:
        raise ValueError("the topk loss needs the teacher's top-k log-probabilities (TeacherScores.support_*)")
    return topk_terms(teacher.support_ids, teacher.support_logprobs, beta, temperature)


_TERMS: dict[str, TermsFactory] = {
    "full_vocab": _full_vocab,
    "sampled_token": _sampled_token,
    "topk": _topk,
    "cross_vocab": _cross_vocab,
    "constant_advantage": constant_advantage(-1.0),
}
OBJECTIVES: dict[str, Objective] = {name: Objective(**vars(rules), terms=_TERMS[name]) for name, rules in RULES.items()}


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise KeyError(f"unknown OPD loss {name!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def sharpened_full_vocab(teacher_temperature: float) -> TermsFactory:
    """The factory of ``loss: full_vocab`` against the teacher at its own temperature (``opd.teacher_temperature``)."""

    def factory(teacher: TeacherScores, targets, beta, temperature) -> RowTerms:
        if teacher.logits is None:
            raise ValueError("the full_vocab loss needs the teacher's logits (TeacherScores.logits)")
        return divergence_terms(teacher.logits.rows, beta, temperature, teacher_temperature)

    return factory


def objective_for(cfg: OPDConfig) -> Objective:
    """The objective ``cfg.loss`` names, with the section's own settings where it has any (constant_advantage's
    advantage, full_vocab's teacher temperature, the cross-tokenizer span credit's baseline)."""
    objective = get_objective(cfg.loss)
    if cfg.span_baseline == "leave_one_out":
        objective = dataclasses.replace(objective, terms=_span_sampled_token_loo)
    if cfg.loss == "constant_advantage":
        objective = dataclasses.replace(objective, terms=constant_advantage(cfg.constant_advantage))
    if cfg.teacher_temperature is not None:
        objective = dataclasses.replace(objective, terms=sharpened_full_vocab(cfg.teacher_temperature))
    return objective


def check_config(cfg: OPDConfig) -> Objective:
    """The objective ``cfg.loss`` names, if ``cfg`` lets it train correctly (``config.check_objective``);
    else ``ConfigError`` naming the key."""
    return OBJECTIVES[check_rules(cfg).name]
