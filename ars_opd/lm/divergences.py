"""Token-level divergences between student and teacher distributions, as per-row terms of the chunked head loss.

At every scored row, with temperature τ, teacher p = softmax(z_T / τ) and student q = softmax(z_S / τ) over the
shared vocabulary:

- β = 0: forward KL(p ‖ q);  β = 1: reverse KL(q ‖ p);
- 0 < β < 1: generalised JSD, β·KL(p ‖ m) + (1 − β)·KL(q ‖ m) with m = β·p + (1 − β)·q.

The interior formula tends to 0 at both ends, so β = 0 and β = 1 are computed as the exact KLs, never by
plugging the end values into the JSD. No τ² factor is applied (multiply outside if wanted).

``divergence_terms``, ``sampled_token_terms`` and ``topk_terms`` each return a ``RowTerms`` for
``ars_opd.lm.head.chunked_head_loss``, which forms the logits from the last hidden states one chunk of rows at
a time: for a chunk of student logits z (c, V) in fp32, each row's value and its analytic gradient in z,
computed without autograd. The teacher gets no gradient. The cross-tokenizer terms (``span_sampled_token_terms``,
analytic too, and ``cross_vocab_terms``, whose gradient is autograd's on the chunk's span-start rows) compare a
student and a teacher whose vocabularies differ (``ars_opd.lm.token_alignment``).

Memory: ``divergence_terms`` works in place on the chunk's student and teacher logits: at most three (c × V)
fp32 tensors for reverse KL, four for forward KL and 0 < β < 1, where the out-of-place formulas hold about
eight. Its gradient is ∂D/∂z_S = (1/τ)·q ⊙ (h − ⟨q, h⟩), h = ∂D/∂q.

Precision: each gradient is q ⊙ (h − ⟨q, h⟩)/τ, which is a small difference of large terms wherever the
student is all but certain of one token (h there is O(1), or ~100 when the teacher gives that token a −40
logit) or the JSD saturates (q and p barely overlap; h is then nearly constant on q's mass). Three rules keep
fp32 at the precision its logits allow, where the textbook formulas lose up to all of it: log-softmaxes
subtract the row max before the log-normaliser (``_log_softmax_``); the centring is taken relative to the
row's most likely token (``_centre_``); the JSD is written in softplus(log(βp / ((1 − β)q))), which leaves
no constant to cancel (``_jsd_``). Row sums are ``.sum(-1)`` (pairwise), not matrix products.

``sampled_token_terms`` is the cheaper estimator that needs only the teacher's log-probability of the tokens
the student sampled: per-token advantage A_t = log p_T(y_t) − log p_S(y_t) (detached) and the
policy-gradient loss −Σ A_t·log p_S(y_t), whose gradient is that of the reverse KL in expectation.

``topk_terms`` is the sparse form for a teacher that returns only its top-k log-probabilities (a served
teacher's ``prompt_logprobs``): the same divergences over each row's top-k ∪ the target, both sides
renormalised there; ``topk_support`` builds that support.

The tests compare these with independent references (autograd of the textbook formulas over whole tensors,
``tests/oracles.py``). No I/O, no globals.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


class DivergenceInputError(ValueError):
    """Student and teacher logits of different shapes, or β / τ out of range."""


def _check_beta_temperature(beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0 or math.isnan(beta):
        raise DivergenceInputError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}")
    if not temperature > 0:
        raise DivergenceInputError(f"temperature must be > 0, got {temperature}")


def _log_softmax_(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(z / τ) over the last dimension, in z's own storage.

    The row max is subtracted first, as ``torch.log_softmax`` does: z − max is exact near the max (Sterbenz),
    and what remains to subtract, log Σ exp(z − max) ∈ [0, log V], is small. The logsumexp itself is about
    max z/τ (60 for logits of 30 at τ = 0.5): subtracted in one step it would round every log-probability to
    its ulp, 4e-6 absolute, and the gradients would carry that at the tokens that hold the mass.
    """
    if temperature != 1.0:
        z.div_(temperature)
    z.sub_(z.amax(-1, keepdim=True))
    return z.sub_(torch.logsumexp(z, -1, keepdim=True))


def _logit(beta: float) -> float:
    """log(β / (1 − β)) for 0 < β < 1."""
    return math.log(beta) - math.log1p(-beta)


def _centre_(f: torch.Tensor, q: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """f − ⟨q, f⟩ per row, in f's storage (c, V); ``work`` (c, V) is overwritten (it takes the product).

    Every divergence gradient here is q ⊙ (f − ⟨q, f⟩)/τ for some f = ∂D/∂q. Where q holds nearly all its mass
    on one token a, f_a − ⟨q, f⟩ = Σ_{u≠a} q_u (f_a − f_u) is small, and forming it as f_a minus a sum
    dominated by q_a·f_a cancels to the ulp of |f_a| (f_a = log q_a − log p_a can be ~100 when the teacher
    gives a −40 logit to the student's top token). The result is invariant under f → f − f_a (Σq = 1), and
    after that shift the q_a term is exactly 0: what remains sums to the size of the answer, at full relative
    precision however close q_a is to 1.
    """
    f.sub_(f.gather(-1, q.argmax(-1, keepdim=True)))
    return f.sub_(torch.mul(q, f, out=work).sum(-1, keepdim=True))


def _jsd_(
    p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, work: torch.Tensor, beta: float, tau: float, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Generalised JSD per row (c,) and, if asked, ∂JSD/∂z_S (c, V), from p, q and x = log(β p / ((1 − β) q)).

    p, q: (c, V) probabilities, each summing to 1 over the row (zero at slots outside a top-k support, where x
    must be finite); x, work: (c, V), both overwritten; the gradient is returned in ``work``'s storage. With
    m = βp + (1 − β)q, log(m / βp) = softplus(−x) and log(m / (1 − β)q) = softplus(x), so

        JSD = H(β) − β·⟨p, softplus(−x)⟩ − (1 − β)·⟨q, softplus(x)⟩,   H(β) = −β log β − (1 − β) log(1 − β),
        ∂JSD/∂z_S = −(1 − β)/τ · q ⊙ (ℓ − ⟨q, ℓ⟩),   ℓ = softplus(x) ≥ 0.

    Why this form: ∂JSD/∂q = (1 − β)·(log q − log m) = (1 − β)·(−log(1 − β) − ℓ), and the constant drops out
    of the centring exactly. Kept inside log q − log m it would drop out only to fp32 rounding: wherever q
    dominates p (the student confident where the teacher is not, a saturated JSD) log q − log m ≈ −log(1 − β)
    on all of q's mass, and the gradient, of the order of the small ℓ there, would be the difference of two
    O(1) numbers. ℓ = log1p(eˣ) keeps full relative precision however small it is, and ``_centre_`` keeps it
    through the centring. Row sums are ``.sum(-1)`` (pairwise) of a product written into storage that is free
    at that point, so no further (c, V) tensor is needed.
    """
    zero = x.new_zeros(())
    entropy = -beta * math.log(beta) - (1 - beta) * math.log1p(-beta)
    x.neg_()  # exact: the sign flip loses nothing, and is undone below
    div = torch.logaddexp(x, zero, out=work).mul_(p).sum(-1)  # ⟨p, softplus(−x)⟩ (c,)
    x.neg_()
    ell = torch.logaddexp(x, zero, out=work)  # softplus(x) (c, V)
    div = entropy - beta * div - (1 - beta) * torch.mul(q, ell, out=x).sum(-1)
    if not need_grad:
        return div, None
    return div, _centre_(ell, q, x).mul_(q).mul_(-(1 - beta) / tau)


def divergence_terms(
    teacher_rows: Callable[[int, int], torch.Tensor],
    beta: float = 1.0,
    temperature: float = 1.0,
    teacher_temperature: float | None = None,
) -> Callable:
    """``RowTerms`` of the divergence (β: 0 forward KL, 1 reverse KL, between generalised JSD) at temperature τ:
    per-row D and ∂D/∂z_S for student logits z (c, V). ``teacher_temperature`` τ_T: the teacher's side is
    p = softmax(z_T / τ_T) instead of softmax(z_T / τ) (τ_T < 1 sharpens it towards its most likely token); the
    gradient formulas are unchanged, since p is a constant of the student.

    teacher_rows(start, end) gives the teacher's logits (c, V) for the same rows (fp32, no grad, the caller's to
    overwrite). Written in place: a chunk holds at most three (c × V) fp32 tensors at once for reverse KL and
    four for forward KL and 0 < β < 1 (z, the teacher's rows, q and p; the row sums take storage already
    spent), where the out-of-place form holds about eight. Raises DivergenceInputError for β ∉ [0, 1] or
    τ <= 0, and for teacher rows of another shape than the student's.
    """
    _check_beta_temperature(beta, temperature)
    beta, tau = float(beta), float(temperature)
    tau_t = tau if teacher_temperature is None else float(teacher_temperature)
    if not tau_t > 0:
        raise DivergenceInputError(f"teacher_temperature must be > 0, got {teacher_temperature}")

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        zt = teacher_rows(start, end)
        if zt.shape != z.shape:
            raise DivergenceInputError(
                f"student logits {tuple(z.shape)} and teacher logits {tuple(zt.shape)} "
                "differ; restrict both heads to the shared vocabulary"
            )
        log_q, log_p = _log_softmax_(z, tau), _log_softmax_(zt, tau_t)  # (c, V) each, in place
        q = log_q.exp()
        if beta == 1.0:  # reverse KL(q || p); ∂/∂z_S = q ⊙ (s − D)/τ with s = log q − log p
            s = log_p.neg_().add_(log_q)
            div = torch.mul(q, s, out=log_q).sum(-1)  # log q is spent: its storage takes the products
            return div, (_centre_(s, q, log_q).mul_(q).div_(tau) if need_grad else None)
        p = log_p.exp()
        if beta == 0.0:  # forward KL(p || q); ∂/∂z_S = (q − p)/τ
            div = log_p.sub_(log_q).mul_(p).sum(-1)
            return div, (q.sub_(p).div_(tau) if need_grad else None)
        x = log_p.sub_(log_q).add_(_logit(beta))  # log(β p / ((1 − β) q)), in the teacher's storage
        return _jsd_(p, q, x, log_q, beta, tau, need_grad)

    return terms


def sampled_token_terms(teacher_logprobs: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> Callable:
    """``RowTerms`` of the sampled-token estimator for rows with targets ``tokens`` (M,) and log p_T (M,) at τ.

    Each row's value is the reverse-KL estimate log q(y) − log p_T(y); its gradient is that of the surrogate
    −A·log q(y) with A = log p_T(y) − log q(y) detached, i.e. A·(q − onehot(y))/τ.
    """
    if not temperature > 0:
        raise DivergenceInputError(f"temperature must be > 0, got {temperature}")

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        y = tokens[start:end, None]  # (c, 1)
        log_q = _log_softmax_(z, temperature)  # (c, V), in place
        logq_y = log_q.gather(-1, y).squeeze(-1)
        advantage = teacher_logprobs[start:end].float() - logq_y  # (c,); no autograd runs here, so it is detached
        if not need_grad:
            return -advantage, None
        grad = log_q.exp_().scatter_add_(-1, y, torch.full_like(y, -1.0, dtype=log_q.dtype))  # q − onehot(y)
        return -advantage, grad.mul_((advantage / temperature)[:, None])

    return terms


def sampled_token_advantage_terms(
    teacher_logprobs: torch.Tensor, tokens: torch.Tensor, advantage: torch.Tensor | float, temperature: float = 1.0
) -> Callable:
    """``RowTerms`` of a policy gradient with a given advantage: each row's value is the reverse-KL estimate
    log q(y) − log p_T(y) (what ``sampled_token_terms`` logs), its gradient that of −A·log q(y) for the given A, a
    constant or (M,) per row, i.e. A·(q − onehot(y))/τ. With A a constant < 0 it is the control of a fixed negative
    signal: every sampled token pushed down alike, no teacher information in the update (the teacher's log p only
    in the logged value); with a per-row A it is a penalty term (``penalty_terms``)."""
    if not temperature > 0:
        raise DivergenceInputError(f"temperature must be > 0, got {temperature}")

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        y = tokens[start:end, None]  # (c, 1)
        log_q = _log_softmax_(z, temperature)  # (c, V), in place
        value = log_q.gather(-1, y).squeeze(-1) - teacher_logprobs[start:end].float()
        if not need_grad:
            return value, None
        a = advantage[start:end].float() if isinstance(advantage, torch.Tensor) else torch.full_like(value, advantage)
        grad = log_q.exp_().scatter_add_(-1, y, torch.full_like(y, -1.0, dtype=log_q.dtype))  # q − onehot(y)
        return value, grad.mul_((a / temperature)[:, None])

    return terms


def span_shares(span_index: torch.Tensor, span_values: torch.Tensor) -> torch.Tensor:
    """(M,) each row's equal share of its span's value: span_values[s] / the number of rows in span s, for the M rows
    of ``span_index`` (-1: in no span, share 0; a batch may have no span at all)."""
    aligned = span_index >= 0
    n_spans = span_values.shape[0]
    spans = torch.where(aligned, span_index, n_spans)  # one spare slot for the rows in no span
    count = torch.zeros(n_spans + 1, dtype=torch.float32, device=span_index.device)
    count.index_add_(0, spans, torch.ones(spans.shape[0], dtype=torch.float32, device=span_index.device))
    values = torch.cat([span_values.float(), span_values.new_zeros(1, dtype=torch.float32)])
    return (values / count.clamp(min=1))[spans] * aligned.float()


def leave_one_out_baseline(credit: torch.Tensor, sequence_index: torch.Tensor, aligned: torch.Tensor) -> torch.Tensor:
    """(M,) each row's baseline: the mean credit of the aligned rows of the OTHER rollouts (sequences) of the batch,
    b_i = Σ_{j≠i} Σ_{t∈j} c_t / Σ_{j≠i} n_j over aligned rows t (0 where no other rollout has one).

    credit (M,) each row's credit (0 where not aligned), sequence_index (M,) its rollout, aligned (M,) bool. Summed
    in float64 (a micro-batch's credits can be hundreds of rows of a few nats each), returned in fp32.
    """
    seq = sequence_index.long()
    n_seq = int(seq.max()) + 1 if seq.numel() else 0
    weight = aligned.double()
    sums = torch.zeros(n_seq, dtype=torch.float64, device=credit.device).index_add_(0, seq, credit.double() * weight)
    counts = torch.zeros(n_seq, dtype=torch.float64, device=credit.device).index_add_(0, seq, weight)
    others_sum, others_n = sums.sum() - sums[seq], counts.sum() - counts[seq]
    return torch.where(others_n > 0, others_sum / others_n.clamp(min=1), 0.0).float()


def span_sampled_token_terms(
    span_index: torch.Tensor,
    span_teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    sequence_index: torch.Tensor | None = None,
) -> Callable:
    """``RowTerms`` of the sampled-token estimator of reverse KL over spans (cross-tokenizer OPD).

    The M rows are the student's sampled tokens; ``span_index`` (M,) gives each its span (-1: in no span, no loss),
    ``span_teacher_logprobs`` (S,) the teacher's log-probability of each span at τ (the sum of its own tokens'), and
    ``student_logprobs`` (M,) log q(y) at τ of every row, taken before the loss (a span's credit needs all its
    tokens, which may lie in other chunks). With d_s = Σ_{t ∈ s} log q(y_t) − log p_T(s) (detached):

    - a row's value is log q(y_t) − log p_T(s)/n_s (n_s: the span's student tokens), so the rows of a sequence sum
      to log q(sequence) − log p_T(its text), the sequence-exact estimate of reverse KL;
    - a row's gradient is that of the surrogate d_s·log q(y_t): d_s·(onehot(y) − q)/τ, the span's log-ratio as
      each of its tokens' credit. Where every span is one token on both sides this is ``sampled_token_terms``.

    ``sequence_index`` (M,), the rollout of each row (``opd.span_baseline: leave_one_out``): each row's credit becomes
    d_s − b_i, with b_i the mean credit of the other rollouts' aligned rows (``leave_one_out_baseline``), so the
    gradient is (d_s − b_i)·(onehot(y) − q)/τ. b_i is a function of the other rollouts only, which were sampled
    independently of rollout i, so E[b_i·∇log q(y_t)] = E[b_i]·E[∇log q(y_t)] = 0: the expected gradient is
    unchanged (a control variate), and only its variance moves. A baseline from rollout i itself (its own mean span
    log-ratio) would hold d_s and so correlate with y_t: biased. The value is unchanged (the estimate, not the
    surrogate).
    """
    if not temperature > 0:
        raise DivergenceInputError(f"temperature must be > 0, got {temperature}")
    aligned = span_index >= 0
    n_spans = span_teacher_logprobs.shape[0]
    spans = torch.where(aligned, span_index, n_spans)  # one spare slot for the tokens in no span (maybe all)
    q_span = torch.zeros(n_spans + 1, dtype=torch.float32, device=span_index.device)
    q_span.index_add_(0, spans, student_logprobs.float())
    p_span = torch.cat([span_teacher_logprobs.float(), q_span.new_zeros(1)])
    keep = aligned.float()
    credit = (q_span - p_span)[spans] * keep  # (M,)
    if sequence_index is not None:
        credit = (credit - leave_one_out_baseline(credit, sequence_index, aligned)) * keep
    share = span_shares(span_index, span_teacher_logprobs)  # (M,)

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        y = tokens[start:end, None]  # (c, 1)
        log_q = _log_softmax_(z, temperature)  # (c, V), in place
        value = (log_q.gather(-1, y).squeeze(-1) - share[start:end]) * keep[start:end]
        if not need_grad:
            return value, None
        grad = log_q.exp_().scatter_add_(-1, y, torch.full_like(y, -1.0, dtype=log_q.dtype))  # q − onehot(y)
        return value, grad.mul_((-credit[start:end] / temperature)[:, None])

    return terms


def _log_rest(logp: torch.Tensor) -> torch.Tensor:
    """log(1 − Σ exp(logp)) over the last dimension: the log-mass outside the given entries (floored at −80, so a
    set holding all the mass has a finite, negligible rest)."""
    inside = torch.logsumexp(logp, -1).clamp(max=-1e-7)  # both branches get a safe input: no NaN gradient either
    near = inside > -math.log(2)
    return torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, inside, -1.0))),
        torch.log1p(-torch.exp(torch.where(near, -1.0, inside))),
    ).clamp(min=-80.0)


def cross_vocab_value(
    z_student: torch.Tensor,
    z_teacher: torch.Tensor,
    shared_student: torch.Tensor,
    shared_teacher: torch.Tensor,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The cross_vocab loss of rows whose student logits (k, V_S) and teacher logits (k, V_T) predict the next token
    from the same text, differentiable in ``z_student``; (k,).

    Two terms, after the idea of GOLD (TRL's cross-tokenizer distillation) and of the Universal Logit Distillation
    loss (ULD, Boizard et al. 2024), written here from their definitions:

    1. over the K tokens both vocabularies spell alike (``shared_*``, the same ids order) plus one bucket for all
       the rest: the divergence of ``divergence_terms`` (β: 0 forward KL, 1 reverse KL, between generalised JSD)
       between p̄ = (p[shared_T], 1 − Σ p[shared_T]) and q̄ = (q[shared_S], 1 − Σ q[shared_S]), so the mass a side
       puts outside the shared tokens counts too;
    2. ULD's vocabulary-free distance on the tokens outside the shared set: each side's probabilities sorted in
       decreasing order, the shorter padded with zeros, and Σ_i |p↓_i − q↓_i| (the optimal-transport cost between
       the two sorted distributions with unit cost for a different rank).

    Neither term is a divergence between the two full distributions (they live on different vocabularies); both
    are 0 when the two sides agree on the shared tokens and on the sorted profile of the rest.
    """
    _check_beta_temperature(beta, temperature)
    ls = torch.log_softmax(z_student.float() / temperature, -1)
    lt = torch.log_softmax(z_teacher.float() / temperature, -1)
    qs, pt = ls[:, shared_student], lt[:, shared_teacher]
    q_bar = torch.cat([qs, _log_rest(qs)[:, None]], -1)
    p_bar = torch.cat([pt, _log_rest(pt)[:, None]], -1)
    if beta == 1.0:
        shared = (q_bar.exp() * (q_bar - p_bar)).sum(-1)
    elif beta == 0.0:
        shared = (p_bar.exp() * (p_bar - q_bar)).sum(-1)
    else:
        log_m = torch.logaddexp(math.log(beta) + p_bar, math.log1p(-beta) + q_bar)
        shared = beta * (p_bar.exp() * (p_bar - log_m)).sum(-1) + (1 - beta) * (q_bar.exp() * (q_bar - log_m)).sum(-1)
    rest_s = torch.ones(ls.shape[-1], dtype=torch.bool, device=ls.device)
    rest_s[shared_student] = False
    rest_t = torch.ones(lt.shape[-1], dtype=torch.bool, device=lt.device)
    rest_t[shared_teacher] = False
    q_sorted = ls[:, rest_s].exp().sort(-1, descending=True).values
    p_sorted = lt[:, rest_t].exp().sort(-1, descending=True).values
    width = max(q_sorted.shape[-1], p_sorted.shape[-1])
    q_sorted = torch.nn.functional.pad(q_sorted, (0, width - q_sorted.shape[-1]))
    p_sorted = torch.nn.functional.pad(p_sorted, (0, width - p_sorted.shape[-1]))
    return shared + (q_sorted - p_sorted).abs().sum(-1)


def cross_vocab_terms(
    teacher_rows: Callable[[torch.Tensor], torch.Tensor],
    cross_rows: torch.Tensor,
    shared_student: torch.Tensor,
    shared_teacher: torch.Tensor,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> Callable:
    """``RowTerms`` of ``cross_vocab_value`` at the rows where ``cross_rows`` (M,) names a teacher row (a span's
    first token on both sides); every other row has value and gradient 0. ``teacher_rows(idx)`` gives the teacher's
    logits (k, V_T) of its rows ``idx``. The gradient is autograd's of ``cross_vocab_value`` on the chunk's rows."""
    _check_beta_temperature(beta, temperature)

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        rows = cross_rows[start:end]
        sel = (rows >= 0).nonzero().squeeze(-1)
        value = torch.zeros(end - start, dtype=torch.float32, device=z.device)
        grad = torch.zeros_like(z, dtype=torch.float32) if need_grad else None
        if sel.numel():
            with torch.no_grad():
                zt = teacher_rows(rows[sel]).float()
            with torch.enable_grad():
                zs = z[sel].detach().float().requires_grad_(need_grad)
                v = cross_vocab_value(zs, zt, shared_student, shared_teacher, beta, temperature)
                if need_grad:
                    (g,) = torch.autograd.grad(v.sum(), zs)
                    grad[sel] = g
            value[sel] = v.detach()
        return value, grad

    return terms


def topk_support(
    top_ids: torch.Tensor, top_logprobs: torch.Tensor, targets: torch.Tensor, target_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ∪ the target per row: (ids (M, k+1), log p_T (M, k+1) with −inf at unused slots).

    top_ids, top_logprobs: (M, k) the teacher's k most likely tokens and their log-probabilities (τ = 1);
    targets, target_logprobs: (M,). The target takes the last slot unless it is already among the top-k,
    in which case that slot repeats it with log-prob −inf (ignored by ``topk_terms``).
    """
    inside = (top_ids == targets[:, None]).any(-1)  # (M,)
    ids = torch.cat([top_ids, targets[:, None]], -1)  # (M, k+1)
    last = torch.where(inside, torch.full_like(target_logprobs, -math.inf), target_logprobs.float())
    return ids, torch.cat([top_logprobs.float(), last[:, None]], -1)


def topk_terms(
    support_ids: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float = 1.0, temperature: float = 1.0
) -> Callable:
    """``RowTerms`` of the divergence restricted to each row's support S (the teacher's top-k ∪ the target).

    support_ids: (M, K) token ids; teacher_logprobs: (M, K) log p_T at τ = 1, −inf at unused slots. Both
    distributions are renormalised over S at temperature τ: p̃ = softmax(log p_T / τ over S) (which equals the
    exact softmax(z_T / τ) restricted to S and renormalised) and q̃ = softmax(z_S[S] / τ); the per-row value is
    the divergence of ``divergence_terms`` (β: 0 forward KL, 1 reverse KL, between generalised JSD) between
    p̃ and q̃, and the gradient reaches the student's logits on S only. The student's mass outside S is neither
    penalised nor rewarded: that is the approximation's bias (the README states it).
    """
    _check_beta_temperature(beta, temperature)
    beta, tau = float(beta), float(temperature)

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        ids = support_ids[start:end]  # (c, K)
        lp_t = teacher_logprobs[start:end].float()  # (c, K)
        valid = torch.isfinite(lp_t)
        log_p = torch.log_softmax(lp_t / tau, -1)  # (c, K), −inf where not valid
        log_q = torch.log_softmax(z.gather(-1, ids).masked_fill(~valid, -math.inf) / tau, -1)  # (c, K)
        p, q = log_p.exp(), log_q.exp()  # exactly 0 where not valid
        zero = torch.zeros_like(p)  # (c, K); once s or x is formed, the scratch for the products
        if beta == 1.0:
            s = torch.where(valid, log_q - log_p, zero)
            div = (q * s).sum(-1)
            g = _centre_(s, q, zero).mul_(q).div_(tau) if need_grad else None
        elif beta == 0.0:
            div = torch.where(valid, p * (log_p - log_q), zero).sum(-1)
            g = (q - p) / tau if need_grad else None
        else:  # x = 0 at unused slots keeps the softplus terms finite there, where p = q = 0
            x = torch.where(valid, log_p - log_q + _logit(beta), zero)
            div, g = _jsd_(p, q, x, zero, beta, tau, need_grad)
        if g is None:
            return div, None
        # duplicate ids (an unused slot repeats the target) add a zero: scatter_add keeps the real one
        return div, torch.zeros_like(z).scatter_add_(-1, ids, g)

    return terms
