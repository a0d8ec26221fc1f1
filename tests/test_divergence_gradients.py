"""Precision of the production divergence gradients at real shapes, against float64 autograd of the formula.

``chunked_head_loss`` with ``divergence_terms`` (full vocabulary) and with ``topk_terms`` (a served teacher's
top-k ∪ the target), for every β ∈ {0, 0.1, 0.5, 0.9, 1} and τ ∈ {0.5, 1, 2}, at V = 3,001 with logits at a
trained model's scale (std 10, |z| up to ≈ 45) and a −40 teacher logit, in two regimes: a teacher that broadly
agrees with the student, and one independent of it (the student confident where the teacher is not: the JSD
saturates and its gradient is small next to the O(1) terms it is formed from, which is where cancellation
shows). The oracle is the plain formula in float64 (log-softmaxes, log m as a logsumexp), differentiated by
autograd through z = h·Wᵀ. The loss and the gradients of the hidden rows and of the head weight must be
within bounds derived from fp32's unit roundoff (``_fp32_gradient_bound`` and its kin) and within
10× of what plain fp32 autograd of the same formula reaches on the same inputs; the hidden rows' gradient
also row by row, each relative to its own size, on the rows float64 itself resolves.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch

from ars_opd.lm.divergences import divergence_terms, topk_support, topk_terms
from ars_opd.lm.head import OutputHead, chunked_head_loss

M, H, V, K = 16, 64, 3001, 32  # scored rows, hidden size, vocabulary, teacher's top-k
CHUNK = 5  # uneven chunks (5, 5, 5, 1)
U = 2.0**-24  # fp32 unit roundoff
U64 = 2.0**-53  # float64's
BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
TAUS = (0.5, 1.0, 2.0)

# z (M, V) -> [(row indices (r,), log q (r, n), log p (r, n))]: each row's two distributions at τ, rows grouped
# by support size so that every group is one dense tensor
LogProbs = Callable[[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]


def _inputs(regime: str):
    """Hidden rows (M, H), head (V, H) and teacher logits (M, V), fp32; student logits h·Wᵀ of std 10."""
    g = torch.Generator().manual_seed(0 if regime == "agreeing" else 1)
    h = torch.randn(M, H, generator=g)
    w = torch.randn(V, H, generator=g) * (10.0 / math.sqrt(H))
    zs = h.double() @ w.double().t()
    if regime == "agreeing":
        zt = 0.8 * zs + 4.0 * torch.randn(M, V, generator=g, dtype=torch.float64)
        ruled_out = zs.topk(3, -1).indices[:, 2]  # the teacher rules out the student's third choice
    else:
        zt = 10.0 * torch.randn(M, V, generator=g, dtype=torch.float64)
        ruled_out = zs.argmax(-1)  # ... or its first
    zt[torch.arange(M), ruled_out] = -40.0
    return h, w, zt.float()


def _divergence(log_q: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """Σ over rows of the divergence between p = exp(log_p) and q = exp(log_q) (rows, n), as docs/design.md
    defines it: β = 0 KL(p‖q), β = 1 KL(q‖p), else β·KL(p‖m) + (1 − β)·KL(q‖m) with m = βp + (1 − β)q."""
    p, q = log_p.exp(), log_q.exp()
    if beta == 0.0:
        return (p * (log_p - log_q)).sum()
    if beta == 1.0:
        return (q * (log_q - log_p)).sum()
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), 0)
    return beta * (p * (log_p - log_m)).sum() + (1 - beta) * (q * (log_q - log_m)).sum()


def _full_vocab(zt: torch.Tensor, tau: float) -> LogProbs:
    return lambda z: [(torch.arange(M), torch.log_softmax(z / tau, -1), torch.log_softmax(zt.to(z.dtype) / tau, -1))]


def _teacher_topk(h: torch.Tensor, w: torch.Tensor, zt: torch.Tensor):
    """The support an endpoint's top-k gives: the teacher's K most likely tokens ∪ the student's pick."""
    logp = torch.log_softmax(zt, -1)  # τ = 1, as an endpoint returns them
    top = logp.topk(K, -1)
    targets = (h @ w.t()).argmax(-1)  # inside the teacher's top-k in some rows, at its −40 in others
    return topk_support(top.indices, top.values, targets, logp.gather(-1, targets[:, None]).squeeze(-1))


def _topk(ids: torch.Tensor, lp: torch.Tensor, tau: float) -> LogProbs:
    """Both distributions renormalised over each row's valid slots: all K + 1, or the K of the top-k when the
    target is among them (its repeat in the last slot has log-prob −inf)."""
    used = torch.isfinite(lp[:, -1])
    groups = [
        (rows, ids[rows, :n], lp[rows, :n])
        for rows, n in ((used.nonzero()[:, 0], K + 1), ((~used).nonzero()[:, 0], K))
        if rows.numel()
    ]
    return lambda z: [
        (rows, torch.log_softmax(z[rows[:, None], s] / tau, -1), torch.log_softmax(lp.to(z.dtype) / tau, -1))
        for rows, s, lp in groups
    ]


def _autograd(h, w, log_probs: LogProbs, beta: float, dtype):
    """(loss, dL/dh, dL/dW) of the plain formula by autograd, everything in ``dtype``."""
    h = h.detach().to(dtype).clone().requires_grad_(True)
    w = w.detach().to(dtype).clone().requires_grad_(True)
    loss = sum(_divergence(log_q, log_p, beta) for _, log_q, log_p in log_probs(h @ w.t()))
    loss.backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def _ours(h, w, terms):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    loss = chunked_head_loss(h, OutputHead(w, None), terms, chunk_size=CHUNK)
    loss.backward()
    return loss.detach().double(), h.grad.double(), w.grad.double()


def _fp32_gradient_bound(z_max: float, tau: float) -> float:
    """Relative error ‖δg‖/‖g‖ an fp32 evaluation of these gradients is entitled to, from u = 2⁻²⁴ alone.

    By the √n rule (n roundings of random sign add up to about √n·u relative):
    - the logits h·Wᵀ are H-term fp32 dot products, so each carries |δz| ≲ √H·u·Z, Z = max |logit|;
    - softmax(z/τ) turns a logit error δ into a relative error ≤ 2δ/τ in every probability (z_v/τ and the
      log-normaliser each move by ≤ δ/τ), hence an absolute one ≤ 2δ/τ in every log-ratio; the gradients are
      q ⊙ (f − ⟨q, f⟩) with f made of those log-ratios, so they move by the same relative amount as long as
      nothing cancels in forming them (avoiding that is the in-place forms' job, and what this test checks);
    - the products ∂z·W and ∂zᵀ·h that give the two gradients sum V and M terms: √V·u and √M·u.
    Total: u·(2√H·Z/τ + √V + √M). No factor is fitted to the measured errors.
    """
    return U * (2 * math.sqrt(H) * z_max / tau + math.sqrt(V) + math.sqrt(M))


def _fp32_row_bound(z_max: float, tau: float) -> float:
    """``_fp32_gradient_bound`` for the worst single row of dL/dh rather than the whole gradient.

    A whole gradient averages the M·V logits' rounding errors, so their typical size √H·u·Z applies; one row
    can meet the largest of them, and the largest of n errors of random sign is about √(2 ln n) times the
    typical one (the Gaussian extreme). The head-weight term √M·u does not enter a row of dL/dh.
    """
    return U * (2 * math.sqrt(H) * z_max / tau * math.sqrt(2 * math.log(M * V)) + math.sqrt(V))


def _fp32_loss_bound(z_max: float, tau: float, loss: float) -> float:
    """Absolute error |δL| an fp32 evaluation of the summed divergence is entitled to, from u = 2⁻²⁴ alone.

    Per row the divergence is a sum of weights (p, q; each summing to 1) times log-ratios, and each log-ratio
    moves by ≤ 2δ/τ under the logit error δ = √H·u·Z of ``_fp32_gradient_bound``: ≤ 2√H·u·Z/τ per row. Summing
    the row's V terms in fp32 adds ≲ √V·u·Σ|terms|, and Σ|terms| ≤ D_row + 2 (the negative terms
    p·log(p/q) with p < q add up to at most Σ(q − p) ≤ 1, by log x ≤ x − 1), so ≤ √V·u·(L + 2M) over the M rows.
    """
    return U * (2 * math.sqrt(H) * z_max / tau * M + math.sqrt(V) * (abs(loss) + 2 * M))


def _oracle_row_error(log_probs: LogProbs, h, w, beta: float) -> torch.Tensor:
    """Relative error (M,) the float64 oracle can have in each row's gradient, from u₆₄ = 2⁻⁵³.

    Autograd of the plain formula forms g = ∂D/∂log q, from terms of size a = q·(|log q| + |log p| + 3) + p,
    and then the logit gradient d = g − q·Σg. Each rounding is ≤ u₆₄ of the terms it combines and n of them
    add up (√n rule), so ‖δd‖ ≲ u₆₄·√n·‖a + q·Σa‖: relative to ‖d‖ it is large wherever d is the small
    difference of large terms (a student all but certain of one token, a saturated JSD), in float64 as in
    fp32. Rows where it is not far below the fp32 bound cannot be judged against this oracle.
    """
    out = torch.empty(M, dtype=torch.float64)
    for rows, log_q, log_p in log_probs(h.double() @ w.double().t()):
        log_q = log_q.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(_divergence(log_q, log_p, beta), log_q)
        log_q = log_q.detach()
        q, p = log_q.exp(), log_p.exp()
        d = g - q * g.sum(-1, keepdim=True)
        a = q * (log_q.abs() + log_p.abs() + 3) + p
        out[rows] = U64 * math.sqrt(log_q.shape[-1]) * (a + q * a.sum(-1, keepdim=True)).norm(dim=-1) / d.norm(dim=-1)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check(h, w, log_probs: LogProbs, terms, beta: float, tau: float, z_max: float):
    """Ours (``terms`` through ``chunked_head_loss``) against the float64 oracle, with plain fp32 for scale.

    Loss and both gradients: within the derived fp32 bounds, and within 10× of plain fp32 autograd, with a
    floor of u·√V (the rounding of one V-term fp32 sum, which no fp32 evaluation avoids) for when plain fp32
    happens to be near exact. Then the hidden rows' gradient row by row, each relative to its own size, within
    ``_fp32_row_bound`` and 10× plain fp32's worst row, on the rows where the oracle's own error
    (``_oracle_row_error``) is under a tenth of that bound.
    """
    exact = _autograd(h, w, log_probs, beta, torch.float64)
    plain = _autograd(h, w, log_probs, beta, torch.float32)
    ours = _ours(h, w, terms)
    floor = U * math.sqrt(V)
    err, plain_err, loss = abs(ours[0] - exact[0]).item(), abs(plain[0] - exact[0]).item(), abs(exact[0]).item()
    assert err <= _fp32_loss_bound(z_max, tau, loss), ("loss", err, loss)
    assert err <= 10 * plain_err + floor * loss, ("loss vs plain fp32", err, plain_err)
    bound = _fp32_gradient_bound(z_max, tau)
    for name, got, base, want in zip(("hidden", "weight"), ours[1:], plain[1:], exact[1:]):
        assert want.norm() > 0, name
        rel, plain_rel = _rel(got, want), _rel(base, want)
        assert rel <= bound, (name, rel, bound)
        assert rel <= 10 * plain_rel + floor, (name, "vs plain fp32", rel, plain_rel)
    row_bound = _fp32_row_bound(z_max, tau)
    judged = _oracle_row_error(log_probs, h, w, beta) <= row_bound / 10
    assert judged.any()  # else the row-by-row check below would be vacuous

    def row_rel(g):
        return ((g - exact[1]).norm(dim=-1) / exact[1].norm(dim=-1))[judged]

    rows, plain_rows = row_rel(ours[1]), row_rel(plain[1])
    assert (rows <= row_bound).all(), ("hidden rows", rows, row_bound)
    assert rows.max() <= 10 * plain_rows.max() + floor, ("hidden rows vs plain fp32", rows, plain_rows)


@pytest.fixture(scope="module", params=["agreeing", "independent"])
def case(request):
    h, w, zt = _inputs(request.param)
    z_max = max((h @ w.t()).abs().max().item(), zt.abs().max().item())
    return h, w, zt, z_max


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("beta", BETAS)
def test_full_vocab_divergence_gradients_match_float64(case, beta, tau):
    h, w, zt, z_max = case
    terms = divergence_terms(lambda start, end: zt[start:end].clone(), beta, tau)
    _check(h, w, _full_vocab(zt, tau), terms, beta, tau, z_max)


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("beta", BETAS)
def test_topk_divergence_gradients_match_float64(case, beta, tau):
    h, w, zt, z_max = case
    ids, lp = _teacher_topk(h, w, zt)
    _check(h, w, _topk(ids, lp, tau), topk_terms(ids, lp, beta, tau), beta, tau, z_max)


def test_the_topk_supports_have_both_slot_kinds():
    used = torch.cat([torch.isfinite(_teacher_topk(*_inputs(r))[1][:, -1]) for r in ("agreeing", "independent")])
    assert used.any() and not used.all()  # targets outside the teacher's top-k, and inside it (an unused slot)
