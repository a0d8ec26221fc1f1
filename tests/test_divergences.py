"""token_divergence against independent oracles (torch.distributions, float64 formulas, autograd)."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from ars_opd.lm.divergences import (
    DivergenceInputError, sampled_token_loss, token_divergence, token_divergence_reference,
)


def _logits(B=3, T=5, V=37, seed=0, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g) * scale).to(dtype)


def _mask(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    m = torch.rand(B, T, generator=g) > 0.3
    m[0, 0] = True
    return m


@pytest.mark.parametrize("beta, direction", [(0.0, "forward"), (1.0, "reverse")])
def test_endpoints_equal_torch_distributions_kl(beta, direction):
    s, t, m = _logits(seed=1), _logits(seed=2), _mask()
    val, n = token_divergence(s, t, m, beta=beta, chunk_size=4)
    q, p = Categorical(logits=s.double()), Categorical(logits=t.double())
    kl = kl_divergence(p, q) if direction == "forward" else kl_divergence(q, p)  # (B, T)
    assert n == int(m.sum())
    assert torch.allclose(val.double(), kl[m].sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_interior_jsd_equals_float64_formula(beta):
    s, t, m = _logits(seed=3), _logits(seed=4), _mask(seed=1)
    val, _ = token_divergence(s, t, m, beta=beta, chunk_size=5)
    p, q = torch.softmax(t.double(), -1), torch.softmax(s.double(), -1)
    mix = beta * p + (1 - beta) * q
    jsd = beta * (p * (p / mix).log()).sum(-1) + (1 - beta) * (q * (q / mix).log()).sum(-1)
    assert torch.allclose(val.double(), jsd[m].sum(), rtol=1e-5, atol=1e-6)


def test_interior_does_not_collapse_to_zero_near_the_endpoints():
    s, t, m = _logits(seed=5), _logits(seed=6), _mask()
    rkl = token_divergence(s, t, m, beta=1.0)[0]
    near = token_divergence(s, t, m, beta=1 - 1e-6)[0]
    assert rkl > 1.0 and near < 1e-3  # the JSD family goes to 0; β = 1 is the KL itself, by definition


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_identical_logits_give_zero(beta):
    s = _logits(seed=7)
    val, _ = token_divergence(s, s.clone(), _mask(), beta=beta)
    assert abs(val.item()) < 1e-5


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_chunked_equals_unchunked_and_autograd_values_and_gradients(beta, temperature):
    t, m = _logits(seed=9), _mask(seed=2)
    grads, vals = [], []
    for fn, kwargs in ((token_divergence, {"chunk_size": 1}), (token_divergence, {"chunk_size": 10**6}),
                       (token_divergence_reference, {})):
        s = _logits(seed=8).requires_grad_(True)
        val, _ = fn(s, t, m, beta=beta, temperature=temperature, **kwargs)
        val.backward()
        vals.append(val.item())
        grads.append(s.grad)
    for v, g in zip(vals[1:], grads[1:]):
        assert abs(v - vals[0]) < 1e-4 * max(1, abs(vals[0]))
        assert torch.allclose(g, grads[0], atol=1e-6)
    assert grads[0][~m].abs().max() == 0  # masked positions get no gradient


def test_temperature_applies_to_both_sides():
    s, t, m = _logits(seed=10), _logits(seed=11), _mask()
    val, _ = token_divergence(s, t, m, beta=1.0, temperature=2.5)
    direct = kl_divergence(Categorical(logits=s.double() / 2.5), Categorical(logits=t.double() / 2.5))[m].sum()
    assert torch.allclose(val.double(), direct, rtol=1e-5)
    only_student = kl_divergence(Categorical(logits=s.double() / 2.5), Categorical(logits=t.double()))[m].sum()
    assert not torch.allclose(val.double(), only_student, rtol=1e-3)


def test_bf16_inputs_computed_in_fp32_are_never_negative():
    s = _logits(seed=12, dtype=torch.bfloat16)
    t = (s.float() + 1e-3 * _logits(seed=13)).to(torch.bfloat16)
    for beta in (0.0, 0.5, 1.0):
        val, _ = token_divergence(s, t, torch.ones(s.shape[:-1], dtype=torch.bool), beta=beta)
        assert val.dtype == torch.float32 and val.item() >= -1e-6


def test_input_errors_are_clear():
    s, t = _logits(), _logits(seed=1)
    with pytest.raises(DivergenceInputError, match="every position is masked"):
        token_divergence(s, t, torch.zeros(s.shape[:-1], dtype=torch.bool))
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(DivergenceInputError, match="beta must be in"):
            token_divergence(s, t, _mask(), beta=beta)
    with pytest.raises(DivergenceInputError, match="temperature"):
        token_divergence(s, t, _mask(), temperature=0.0)
    with pytest.raises(DivergenceInputError, match="shared vocabulary"):
        token_divergence(s, t[..., :-1], _mask())


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
        token_divergence(s, teacher, torch.ones(1, 1, dtype=torch.bool), beta=1.0)[0].backward()
        norms.append(s.grad.norm().item())
    assert all(a < b for a, b in zip(norms, norms[1:])), norms


def test_sampled_token_estimator_matches_reverse_kl_gradient_in_expectation():
    torch.manual_seed(0)
    V = 6
    s = torch.randn(1, 1, V)
    t = torch.randn(1, 1, V)
    exact = s.clone().requires_grad_(True)
    token_divergence(exact, t, torch.ones(1, 1, dtype=torch.bool), beta=1.0)[0].backward()
    q = torch.softmax(s[0, 0], -1)
    logp = torch.log_softmax(t[0, 0], -1)
    expected = torch.zeros(V)
    for y in range(V):  # E_{y~q}[grad of the surrogate], summed exactly over the vocabulary
        z = s.clone().requires_grad_(True)
        loss, _, _ = sampled_token_loss(z, logp[y].view(1, 1), torch.tensor([[y]]), torch.ones(1, 1, dtype=torch.bool))
        loss.backward()
        expected += q[y] * z.grad[0, 0]
    assert torch.allclose(expected, exact.grad[0, 0], atol=1e-5)


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
    (token_divergence(a, t, m, beta=1.0, chunk_size=32)[0] * scale).backward()
    sel = x64.grad.abs() > 1e-3 * x64.grad.abs().max()
    ratio = (a.grad.double()[sel] / x64.grad[sel]).mean().item()
    assert abs(ratio - 1) < 3e-4, ratio  # bf16(1/3) / (1/3) = 1.00195


def test_sampled_token_objective_reports_the_divergence_and_trains_on_the_surrogate():
    from ars_opd.lm.head import OutputHead
    from ars_opd.lm.objectives import TeacherScores, get_objective

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
    assert n == int(m.sum()) and torch.allclose(value, (logq - logp)[m].sum(), atol=1e-5)
    b = s.clone().requires_grad_(True)
    surrogate, _, _ = sampled_token_loss(b, logp, y, m, tau)
    surrogate.backward()
    assert torch.allclose(a.grad, b.grad[m], atol=1e-6) and a.grad.abs().sum() > 0
