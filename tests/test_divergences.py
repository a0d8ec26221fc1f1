"""The library's divergences against independent oracles (torch.distributions, float64 formulas, autograd).

The library computes them from hidden states (``chunked_head_loss`` over ``divergence_terms`` /
``sampled_token_terms``, as the pipeline does); with an identity output head the hidden rows are the logits
(the head's products with 0 and 1 are exact) and their gradient is the logits' gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from ars_opd.lm.divergences import DivergenceInputError, divergence_terms, sampled_token_terms
from ars_opd.lm.head import OutputHead, chunked_head_loss
from oracles import divergence_sum, sampled_token_loss
from tolerances import (
    FN_ULPS,
    U32,
    gamma,
    log_softmax_bound,
    loss_bound,
    loss_grad_bound,
    two_computations,
    vs_oracle,
)


def _logits(B=3, T=5, V=37, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g) * scale).to(dtype)


def _mask(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    m = torch.rand(B, T, generator=g) > 0.3
    m[0, 0] = True
    return m


def _identity(V, dtype=torch.float32):
    return OutputHead(torch.eye(V, dtype=dtype), None)


def _divergence(s, t, mask, beta=1.0, temperature=1.0, chunk_size=256):
    """The library's summed divergence of student logits s (..., V) from teacher logits t at the masked-in
    positions, and their count: the pipeline's path, with the logits as hidden rows of an identity head."""
    t_rows = t.detach()[mask].float()
    terms = divergence_terms(lambda start, end: t_rows[start:end].clone(), beta, temperature)
    return chunked_head_loss(s[mask], _identity(s.shape[-1], s.dtype), terms, chunk_size), int(mask.sum())


def _sampled_token(s, teacher_logprobs, tokens, mask, temperature=1.0, chunk_size=256):
    """The library's sampled-token loss (value: the reverse-KL estimate; gradient: the surrogate's) from
    student logits s (..., V), the same way."""
    terms = sampled_token_terms(teacher_logprobs[mask], tokens[mask], temperature)
    return chunked_head_loss(s[mask], _identity(s.shape[-1], s.dtype), terms, chunk_size)


@pytest.mark.parametrize("beta, direction", [(0.0, "forward"), (1.0, "reverse")])
def test_endpoints_equal_torch_distributions_kl(beta, direction):
    s, t, m = _logits(seed=1), _logits(seed=2), _mask()
    val, n = _divergence(s, t, m, beta=beta, chunk_size=4)
    q, p = Categorical(logits=s.double()), Categorical(logits=t.double())
    kl = kl_divergence(p, q) if direction == "forward" else kl_divergence(q, p)  # (B, T)
    assert n == int(m.sum())
    _, bound = loss_bound("divergence", s[m], zt=t[m], beta=beta)
    assert abs(val.double() - kl[m].sum()) <= vs_oracle(bound)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_interior_jsd_equals_float64_formula(beta):
    s, t, m = _logits(seed=3), _logits(seed=4), _mask(seed=1)
    val, _ = _divergence(s, t, m, beta=beta, chunk_size=5)
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)
    mix = beta * p + (1 - beta) * q
    jsd = beta * (p * (p / mix).log()).sum(-1) + (1 - beta) * (q * (q / mix).log()).sum(-1)
    _, bound = loss_bound("divergence", s[m], zt=t[m], beta=beta)
    assert abs(val.double() - jsd[m].sum()) <= vs_oracle(bound)


def test_interior_does_not_collapse_to_zero_near_the_endpoints():
    s, t, m = _logits(seed=5), _logits(seed=6), _mask()
    beta = 1 - 1e-6
    rkl = _divergence(s, t, m, beta=1.0)[0]
    near = _divergence(s, t, m, beta=beta)[0]
    # the JSD family goes to 0; β = 1 is the KL itself, by definition. KL is convex in its second argument,
    # so KL(p‖m) <= (1 − β)·KL(p‖q), KL(q‖m) <= β·KL(q‖p): JSD_β <= β(1 − β)·(KL(p‖q) + KL(q‖p)), plus rounding
    fwd, rev = (loss_bound("divergence", s[m], zt=t[m], beta=b)[0] for b in (0.0, 1.0))
    _, bound = loss_bound("divergence", s[m], zt=t[m], beta=beta)
    assert rkl > 1.0 and near <= beta * (1 - beta) * (fwd + rev) + bound


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_identical_logits_give_zero(beta):
    s, m = _logits(seed=7), _mask()
    val, _ = _divergence(s, s.clone(), m, beta=beta)
    _, bound = loss_bound("divergence", s[m], zt=s[m], beta=beta)  # the exact value is 0
    assert abs(val.item()) <= bound


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_chunked_equals_unchunked_and_autograd_values_and_gradients(beta, temperature):
    t, m = _logits(seed=9), _mask(seed=2)
    grads, vals = [], []
    for fn, kwargs in ((_divergence, {"chunk_size": 1}), (_divergence, {"chunk_size": 10**6}), (divergence_sum, {})):
        s = _logits(seed=8).requires_grad_(True)
        val, _ = fn(s, t, m, beta=beta, temperature=temperature, **kwargs)
        val.backward()
        vals.append(val.item())
        grads.append(s.grad)
    # three fp32 evaluations of one value and gradient (other chunks; the oracle's textbook formulas and
    # autograd, another order of operations)
    _, bound = loss_bound("divergence", _logits(seed=8)[m], zt=t[m], beta=beta, tau=temperature)
    grad_bound = torch.zeros(grads[0].shape, dtype=torch.float64)
    grad_bound[m] = loss_grad_bound("divergence", _logits(seed=8)[m], t[m], beta=beta, tau=temperature)
    for v, g in zip(vals[1:], grads[1:]):
        assert abs(v - vals[0]) <= two_computations(bound)
        assert ((g - grads[0]).abs() <= two_computations(grad_bound)).all()
    assert grads[0][~m].abs().max() == 0  # masked positions get no gradient


def test_temperature_applies_to_both_sides():
    s, t, m = _logits(seed=10), _logits(seed=11), _mask()
    val, _ = _divergence(s, t, m, beta=1.0, temperature=2.5)
    direct = kl_divergence(Categorical(logits=s.double() / 2.5), Categorical(logits=t.double() / 2.5))[m].sum()
    _, bound = loss_bound("divergence", s[m], zt=t[m], beta=1.0, tau=2.5)
    assert abs(val.double() - direct) <= vs_oracle(bound)
    only_student = kl_divergence(Categorical(logits=s.double() / 2.5), Categorical(logits=t.double()))[m].sum()
    assert abs(val.double() - only_student) > vs_oracle(bound)  # the other formula is out of rounding's reach


def test_bf16_inputs_computed_in_fp32_are_never_negative():
    s = _logits(seed=12, dtype=torch.bfloat16)
    t = (s.float() + 1e-3 * _logits(seed=13)).to(torch.bfloat16)
    for beta in (0.0, 0.5, 1.0):
        val, _ = _divergence(s, t, torch.ones(s.shape[:-1], dtype=torch.bool), beta=beta)
        # the divergence is >= 0; its fp32 evaluation of the (exactly representable) bf16 inputs within rounding
        _, bound = loss_bound("divergence", s.float().flatten(0, 1), zt=t.float().flatten(0, 1), beta=beta)
        assert val.dtype == torch.float32 and val.item() >= -bound


def test_input_errors_are_clear():
    s, t = _logits(), _logits(seed=1)
    with pytest.raises(ValueError, match="every position is masked"):
        _divergence(s, t, torch.zeros(s.shape[:-1], dtype=torch.bool))
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(DivergenceInputError, match="beta must be in"):
            _divergence(s, t, _mask(), beta=beta)
    with pytest.raises(DivergenceInputError, match="temperature"):
        _divergence(s, t, _mask(), temperature=0.0)
    with pytest.raises(DivergenceInputError, match="shared vocabulary"):
        _divergence(s, t[..., :-1], _mask())


def test_reverse_kl_gradient_grows_as_teacher_probability_of_sampled_token_falls():
    V, y = 50, 7
    student = torch.zeros(1, 1, V)
    student[0, 0, y] = 4.0  # the student likes token y (q(y) ≈ 0.52)
    norms = []
    for p_y in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        rest = (1 - p_y) / (V - 1)
        probs = torch.full((V,), rest)
        probs[y] = p_y
        teacher = probs.log().view(1, 1, V)
        s = student.clone().requires_grad_(True)
        _divergence(s, teacher, torch.ones(1, 1, dtype=torch.bool), beta=1.0)[0].backward()
        norms.append(s.grad.norm().item())
    assert all(a < b for a, b in zip(norms, norms[1:])), norms


def test_sampled_token_estimator_matches_reverse_kl_gradient_in_expectation():
    torch.manual_seed(0)
    V = 6
    s = torch.randn(1, 1, V)
    t = torch.randn(1, 1, V)
    exact = s.clone().requires_grad_(True)
    _divergence(exact, t, torch.ones(1, 1, dtype=torch.bool), beta=1.0)[0].backward()
    q = torch.softmax(s[0, 0], -1)
    logp = torch.log_softmax(t[0, 0], -1)
    expected = torch.zeros(V)
    for y in range(V):  # E_{y~q}[grad of the surrogate], summed exactly over the vocabulary
        z = s.clone().requires_grad_(True)
        _sampled_token(z, logp[y].view(1, 1), torch.tensor([[y]]), torch.ones(1, 1, dtype=torch.bool)).backward()
        expected += q[y] * z.grad[0, 0]
    # two fp32 evaluations: the exact gradient, and V surrogate gradients (each within its bound, from the fp32
    # log p: within log_softmax_bound of the exact one) weighted by torch.softmax's q (relative error within
    # the log-softmax's + exp's) and summed over V
    exact_bound = loss_grad_bound("divergence", s[0], t[0], beta=1.0)[0]
    lq = torch.log_softmax(s[0, 0].double(), -1)
    q, rel_q, logp_bound = lq.exp(), log_softmax_bound(s[0, 0]) + FN_ULPS * U32, log_softmax_bound(t[0, 0])
    e = torch.eye(V, dtype=torch.float64)
    surrogate = torch.stack([(logp[y].double() - lq[y]) * (q - e[y]) for y in range(V)])  # (y, V)
    bounds = torch.stack(
        [
            loss_grad_bound("sampled_token", s[0], targets=torch.tensor([y]), teacher_logprobs=logp[y].view(1))[0]
            for y in range(V)
        ]
    )
    bounds = bounds + logp_bound[:, None] * (q - e).abs()
    sampled_bound = (q[:, None] * bounds + (rel_q[:, None] + gamma(V + 1)) * q[:, None] * surrogate.abs()).sum(0)
    assert ((expected - exact.grad[0, 0]).abs() <= two_computations(exact_bound, sampled_bound)).all()


def test_bf16_gradient_keeps_the_loss_scale_exact():
    """The engine multiplies the loss by K / N_global; rounding that scale to bf16 (1/3 -> 0.33398)
    once skewed every gradient of a bf16 step by the same factor."""
    torch.manual_seed(2)
    x = (3 * torch.randn(8, 16, 200)).to(torch.bfloat16)
    t = 3 * torch.randn(8, 16, 200)
    m = torch.ones(8, 16, dtype=torch.bool)
    scale = 1 / 3
    x64 = x.double().requires_grad_(True)
    (kl_divergence(Categorical(logits=x64), Categorical(logits=t.double()))[m].sum() * scale).backward()
    a = x.clone().requires_grad_(True)
    (_divergence(a, t, m, beta=1.0, chunk_size=32)[0] * scale).backward()
    sel = x64.grad.abs() > 1e-3 * x64.grad.abs().max()
    ratio = (a.grad.double()[sel] / x64.grad[sel]).mean().item()
    # bf16(1/3) / (1/3) = 1.00195. Not a rounding bound but a statistical one: the mean over the ~25,000 selected
    # elements of their bf16 roundings (each within ±2^-8, of standard deviation at most 2^-8/√3 ≈ 2.3e-3) has a
    # standard error of ~1.4e-5, so 3e-4 is ~20 of them, and 6 times below the skew of a bf16-rounded scale
    assert abs(ratio - 1) < 3e-4, ratio


def test_sampled_token_objective_reports_the_divergence_and_trains_on_the_surrogate():
    from ars_opd.lm.head import OutputHead
    from ars_opd.lm.opd_objectives import TeacherScores, get_objective

    torch.manual_seed(4)
    s, t = torch.randn(3, 5, 11), torch.randn(3, 5, 11)
    y = torch.randint(0, 11, (3, 5))
    m = torch.rand(3, 5) > 0.3
    tau = 0.7
    logp = torch.distributions.Categorical(logits=t / tau).log_prob(y)
    # an identity head makes the hidden rows the student's logits, so their gradient is the logits' gradient
    a = s[m].clone().requires_grad_(True)
    scores = TeacherScores(token_logprobs=logp[m])
    value, n = get_objective("sampled_token").loss(a, OutputHead(torch.eye(11), None), scores, y[m], 1.0, tau, 2)
    value.backward()
    logq = torch.distributions.Categorical(logits=s / tau).log_prob(y)
    # two fp32 evaluations (an identity head forms the logits exactly), the teacher's log p an exact input
    _, bound = loss_bound("sampled_token", s[m], targets=y[m], tau=tau, teacher_logprobs=logp[m])
    assert n == int(m.sum()) and abs(value - (logq - logp)[m].sum()) <= two_computations(bound)
    b = s.double().requires_grad_(True)  # the float64 oracle's surrogate gradient
    surrogate, _, _ = sampled_token_loss(b, logp.double(), y, m, tau)
    surrogate.backward()
    grad_bound = loss_grad_bound("sampled_token", s[m], targets=y[m], tau=tau, teacher_logprobs=logp[m])
    assert ((a.grad.double() - b.grad[m]).abs() <= vs_oracle(grad_bound)).all() and a.grad.abs().sum() > 0
