"""The cross-tokenizer span credit with a leave-one-out baseline (``opd.span_baseline: leave_one_out``).

Each scored student token t of rollout i, in span s, gets the credit c_t = d_s − b_i, d_s = Σ_{u∈s} log q(y_u) − log
p(s), and b_i the mean credit d_{s(u)} over the aligned tokens u of the micro-batch's other rollouts. Oracles:

- the textbook formula written here in float64 (a Python loop over rollouts for b), its gradient by autograd of the
  surrogate Σ_t sg(c_t)·log q(y_t); the fp32 terms must match it within a first-order bound derived from the
  inputs' own rounding (tests/tolerances.py), and the baseline-free credit must miss it by far more than that;
- an exact enumeration of every joint outcome of two small rollouts: the expected gradient with the baseline equals
  the one without (the control variate is unbiased), and a baseline taken from the rollout's own spans does not.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ars_opd.config import ConfigError, OPDConfig, check_objective
from ars_opd.lm.divergences import span_sampled_token_terms
from tolerances import (
    FN_ULPS,
    U32,
    U64,
    first_order_bound,
    gamma,
    logprob_bound,
    sum_bound,
    two_computations,
    vs_oracle,
)

# three rollouts of a micro-batch: each row's rollout, span (-1: a token after the last boundary the teacher can
# spell) and the spans' teacher log-probabilities; spans of one to three student tokens
SEQUENCE = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
SPANS = [0, 0, 1, 2, 2, 3, 4, 4, 4, 5, 6, -1, 7, -1]
M, V = len(SPANS), 50


def _inputs(seed: int, offset: float):
    """fp32 logits (M, V), sampled-looking targets, and teacher span log-probabilities ``offset`` nats below the
    student's per token (the last cross-tokenizer study's regime: nearly every d_s positive and large)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(M, V, generator=g) * 3
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g).squeeze(-1)
    spans = torch.tensor(SPANS)
    n_spans = int(spans.max()) + 1
    lq = torch.log_softmax(z.double(), -1).gather(-1, y[:, None]).squeeze(-1)
    q_span = torch.zeros(n_spans, dtype=torch.float64).index_add(0, spans[spans >= 0], lq[spans >= 0])
    n = torch.bincount(spans[spans >= 0], minlength=n_spans).double()
    lp = (q_span - offset * n + torch.randn(n_spans, generator=g, dtype=torch.float64)).float()
    return z, y, spans, torch.tensor(SEQUENCE), lp


def _run(terms, z: torch.Tensor, chunk: int = 4):
    """The terms over the M rows, chunk by chunk as ``chunked_head_loss`` calls them (each chunk's logits its own)."""
    values, grads = [], []
    for start in range(0, z.shape[0], chunk):
        end = min(start + chunk, z.shape[0])
        v, g = terms(z[start:end].clone(), start, end, True)
        values.append(v)
        grads.append(g)
    return torch.cat(values), torch.cat(grads)


def _textbook_baseline(credit: torch.Tensor, aligned: torch.Tensor) -> torch.Tensor:
    """b_i: the mean of the other rollouts' aligned credits, written out rollout by rollout (float64)."""
    b = torch.zeros_like(credit)
    for t, i in enumerate(SEQUENCE):
        others = [u for u, j in enumerate(SEQUENCE) if j != i and bool(aligned[u])]
        b[t] = sum(credit[u] for u in others) / len(others) if others else 0.0
    return b


def _oracle(z, y, spans, lp, tau: float, baseline: bool):
    """The float64 oracle of the terms' rows, from the same fp32 logits and teacher log-probabilities, and the
    first-order bounds of their fp32 evaluation: (value, value bound, gradient, gradient bound, credit c_t)."""
    aligned = spans >= 0
    z64 = z.double().requires_grad_(True)
    lq = torch.log_softmax(z64 / tau, -1).gather(-1, y[:, None]).squeeze(-1)
    n_spans = lp.shape[0]
    leaf = lq.detach().clone().requires_grad_(True)  # log q(y) as the credit reads it (no gradient through it)
    q_span = torch.zeros(n_spans, dtype=torch.float64).index_add(0, spans[aligned], leaf[aligned])
    d = q_span - lp.double()
    credit = torch.where(aligned, d[spans.clamp(min=0)], 0.0)
    b = _textbook_baseline(credit, aligned) if baseline else torch.zeros_like(credit)
    c = torch.where(aligned, credit - b, 0.0)
    (grad_ref,) = torch.autograd.grad((c.detach() * lq).sum(), z64)
    n = torch.bincount(spans[aligned], minlength=n_spans).double()
    value_ref = torch.where(aligned, lq.detach() - (lp.double() / n)[spans.clamp(min=0)], 0.0)

    # the fp32 log-probabilities (z / τ rounded first when τ != 1), then each stage of the credit
    z_div_bound = None if tau == 1.0 else U32 * (z.double() / tau).abs()
    lp_bound = logprob_bound(z.double() / tau, z_div_bound)  # (M, V)
    e_y = lp_bound.gather(-1, y[:, None]).squeeze(-1)
    abs_span = torch.zeros(n_spans, dtype=torch.float64).index_add(0, spans[aligned], leaf.detach().abs()[aligned])
    stages = [
        (leaf, e_y),  # log q(y): the input's own error
        (q_span, torch.stack([sum_bound(int(k), a) for k, a in zip(n, abs_span)])),  # Σ over the span's tokens
        (d, U32 * d.detach().abs()),  # less log p(s)
    ]
    if baseline:
        others = torch.tensor([sum(1 for u, j in enumerate(SEQUENCE) if j != i and SPANS[u] >= 0) for i in SEQUENCE])
        # summed and divided in float64 (M + 2 roundings of the credits' size), rounded once to fp32
        b_own = U32 * b.detach().abs() + 2 * gamma(M + 2, U64) * credit.detach().abs().sum() / others.clamp(min=1)
        stages += [(b, b_own), (c, U32 * c.detach().abs())]  # the baseline, then d_s − b_i
    dc = torch.stack([first_order_bound(c[r], stages) for r in range(M)])  # (M,)
    q = torch.softmax(z.double() / tau, -1)
    onehot = torch.nn.functional.one_hot(y, V).double()
    at_y = onehot * U32 * (q - onehot).abs()  # q − onehot: one rounding, at the target only
    cabs = c.detach().abs()[:, None] / tau
    c_div = 0.0 if tau == 1.0 else U32 * cabs  # c / τ rounded
    # q = exp(log q): the log-probability's error and exp's own; then the product with c / τ, one rounding
    grad_bound = vs_oracle(
        cabs * (q * (lp_bound + FN_ULPS * U32) + at_y) + (dc[:, None] / tau + c_div + U32 * cabs) * (onehot - q).abs()
    )
    share = (lp.double() / n)[spans.clamp(min=0)].abs()
    value_bound = vs_oracle(torch.where(aligned, e_y + U32 * share + U32 * value_ref.abs(), 0.0))
    return value_ref, value_bound, grad_ref, grad_bound, c.detach()


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_leave_one_out_credit_value_and_gradient_match_a_float64_oracle(tau):
    z, y, spans, seq, lp = _inputs(seed=3, offset=6.0)
    lq32 = torch.log_softmax(z / tau, -1).gather(-1, y[:, None]).squeeze(-1)  # the student_logprobs input (fp32)
    value, grad = _run(span_sampled_token_terms(spans, lp, lq32, y, tau, sequence_index=seq), z)
    value_ref, value_bound, grad_ref, grad_bound, _ = _oracle(z, y, spans, lp, tau, baseline=True)
    assert torch.all((value.double() - value_ref).abs() <= value_bound)
    assert torch.all((grad.double() - grad_ref).abs() <= grad_bound)
    assert float(grad[spans < 0].abs().max()) == 0.0  # tokens in no span carry no gradient
    # without the baseline the credit is d_s: the oracle of the baseline is missed by far more than the bound
    _, plain = _run(span_sampled_token_terms(spans, lp, lq32, y, tau), z)
    assert float(((plain.double() - grad_ref).abs() - grad_bound).max()) > 1e3 * float(grad_bound.max())


def test_the_baseline_moves_the_gradient_by_b_times_the_score():
    """On the same rows, the gradient with the baseline minus the one without is −b_i·(onehot(y) − q)/τ (the
    surrogate's difference, −b_i·log q(y_t)); b_i, the other rollouts' mean credit, is several nats here."""
    z, y, spans, seq, lp = _inputs(seed=8, offset=7.0)
    lq32 = torch.log_softmax(z, -1).gather(-1, y[:, None]).squeeze(-1)
    _, with_b = _run(span_sampled_token_terms(spans, lp, lq32, y, sequence_index=seq), z)
    _, without = _run(span_sampled_token_terms(spans, lp, lq32, y), z)
    _, _, ref_b, bound_b, c_b = _oracle(z, y, spans, lp, 1.0, baseline=True)
    _, _, ref_0, bound_0, c_0 = _oracle(z, y, spans, lp, 1.0, baseline=False)
    aligned = spans >= 0
    b = torch.where(aligned, c_0 - c_b, 0.0)  # float64: the baseline, d_s − (d_s − b_i)
    assert float(b[aligned].min()) > 3.0  # a large, positive mean credit: the regime the baseline is for
    q = torch.softmax(z.double(), -1)
    onehot = torch.nn.functional.one_hot(y, V).double()
    expected = -b[:, None] * (onehot - q)
    # the oracles' difference is that formula to float64 rounding (a few roundings on c·(onehot + q), the size of
    # the log-softmax backward's terms); each fp32 side is within its own bound of its oracle
    size = (c_b.abs() + c_0.abs() + b.abs())[:, None] * (onehot + q)
    assert torch.all((ref_b - ref_0 - expected).abs() <= gamma(8, U64) * size)
    fp32 = two_computations(bound_b, bound_0) + gamma(8, U64) * size
    assert torch.all((with_b.double() - without.double() - expected).abs() <= fp32)
    assert float((with_b - without).abs().max()) > 1.0  # and that is no rounding-size change


def test_leave_one_out_keeps_the_expected_gradient_and_an_own_rollout_mean_would_not():
    """Every joint outcome of two rollouts of two tokens (vocabulary 3, the second token's distribution depending on
    the first), each weighed by its probability, in float64: E[Σ_t c_t·∇log q(y_t)] with c = d_s − b_i equals it
    with c = d_s (b_i from the other rollout only), and differs with b_i the rollout's own mean span credit."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(2, 4, 3, generator=g, dtype=torch.float64).requires_grad_(True)  # [rollout, context, token]
    teacher = torch.log_softmax(torch.randn(2, 3, 3, 3, generator=g, dtype=torch.float64) * 2, -1)  # fixed tables
    spans = ([0, 0], [1, 2])  # rollout 0: one span of both tokens; rollout 1: a span per token

    def logq(i, y1, y2):
        return torch.log_softmax(theta[i, 0], -1)[y1], torch.log_softmax(theta[i, 1 + y1], -1)[y2]

    def teacher_span(i, y1, y2, s):  # the teacher's log p of span s of rollout i
        if i == 0:
            return teacher[0, 0, y1, y2] + teacher[0, 1, y2, y1]
        return teacher[1, 0, 0, y1] if s == 1 else teacher[1, 1, y1, y2]

    def expected_gradient(baseline: str) -> tuple[torch.Tensor, float, float]:
        """(E[gradient], Σ_outcomes P·Σ_t |c_t| (the size of every gradient entry's terms: |∂log q(y)/∂θ| <= 1),
        the largest Σ_t |log q(y_t)| of an outcome (what P = exp of it is computed from))."""
        total, size, lq_max = torch.zeros_like(theta), 0.0, 0.0
        for outcome in itertools.product(range(3), repeat=4):
            ys = (outcome[:2], outcome[2:])
            lqs = [logq(i, *ys[i]) for i in range(2)]
            log_prob = sum(a + b for a, b in lqs).detach()
            prob = torch.exp(log_prob)
            credits = []
            for i in range(2):
                d = {}
                for t, s in enumerate(spans[i]):
                    d[s] = d.get(s, 0.0) + lqs[i][t].detach()
                for s in d:
                    d[s] = d[s] - teacher_span(i, *ys[i], s)
                credits.append([d[s] for s in spans[i]])
            surrogate = 0.0
            for i in range(2):
                if baseline == "leave_one_out":
                    b = sum(credits[1 - i]) / 2
                elif baseline == "own":
                    b = sum(credits[i]) / 2
                else:
                    b = 0.0
                c = [credits[i][t] - b for t in range(2)]
                surrogate = surrogate + sum(c[t] * lqs[i][t] for t in range(2))
                size += float(prob) * sum(abs(float(x)) for x in c)
            (grad,) = torch.autograd.grad(surrogate, theta)
            total = total + prob * grad
            lq_max = max(lq_max, sum(abs(float(x.detach())) for pair in lqs for x in pair))
        return total, size, lq_max

    (none, size_0, lq_max), (loo, size_1, _), (own, _, _) = (
        expected_gradient(b) for b in ("none", "leave_one_out", "own")
    )
    # exact arithmetic makes loo − none 0. Each float64 outcome term P·grad: the credits (span sums, the teacher's
    # log p, b's sum and halving, c = d − b: 6 roundings), log q's gradient through the log-softmax backward (exp,
    # the sum over 3 and the division: FN_ULPS + 4), the sum over 4 tokens and the product with P (5); P itself is
    # exp (FN_ULPS) of a sum of 4 log-probabilities, each within a log-softmax's error of the exact one (the shift,
    # exp, the sum over 3, log and the subtraction: about 8 roundings of up to lq_max); then the sum of 81 terms
    per_term = gamma(6 + FN_ULPS + 4 + 5, U64) + FN_ULPS * U64 + gamma(4 + 8, U64) * lq_max
    bound = sum((per_term + gamma(80, U64)) * size for size in (size_0, size_1))
    assert float((loo - none).abs().max()) <= bound
    assert float((own - none).abs().max()) > 1e-2 * float(none.abs().max())  # a baseline from the rollout's own spans


def test_the_span_baseline_is_refused_where_it_means_nothing():
    ok = OPDConfig(cross_tokenizer=True, loss="sampled_token", span_baseline="leave_one_out", micro_batch_size=4)
    assert check_objective(ok).name == "sampled_token"
    for bad, words in (
        (dict(cross_tokenizer=False, loss="sampled_token"), "cross-tokenizer sampled_token"),
        (dict(cross_tokenizer=True, loss="cross_vocab"), "cross-tokenizer sampled_token"),
        (dict(cross_tokenizer=True, loss="sampled_token", micro_batch_size=1, global_batch_size=8), "micro-batch of 1"),
    ):
        cfg = OPDConfig(**{"micro_batch_size": 4, "global_batch_size": 8, **bad, "span_baseline": "leave_one_out"})
        with pytest.raises(ConfigError, match=words) as e:
            check_objective(cfg)
        assert e.value.key == "opd.span_baseline"
