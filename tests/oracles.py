"""Independent references for the library's losses: the textbook formulas over whole tensors, with autograd.

The library computes its divergences chunk by chunk, in place, with analytic gradients and rewritten forms
that keep fp32 precise (``ars_opd.lm.divergences``). These share none of that: each is the formula as
written, in plain out-of-place torch ops on every position at once, differentiated by autograd. They compute
in the promoted dtype of their inputs, fp32 at least (bf16 is upcast): a test runs them in float64 as the
oracle of a derived bound (tests/tolerances.py), or in fp32 as a second fp32 evaluation of the same value
(the order of operations ``tolerances.loss_bound`` bounds). bench/loss_memory.py measures them as the logits
path's baseline.

With q = softmax(z_S / τ) (student) and p = softmax(z_T / τ) (teacher) per position; the teacher is detached:

- forward KL(p ‖ q) = Σ_v p_v (log p_v − log q_v);
- reverse KL(q ‖ p) = Σ_v q_v (log q_v − log p_v);
- generalised JSD_β = β·KL(p ‖ m) + (1 − β)·KL(q ‖ m), m = β·p + (1 − β)·q, log m taken as
  logaddexp(log β + log p, log(1 − β) + log q);
- the sampled-token policy gradient: A = log p_T(y) − log q(y) (detached), surrogate −Σ A·log q(y), and the
  reverse-KL estimate Σ (log q(y) − log p_T(y)).
"""

from __future__ import annotations

import math

import torch


def _dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def log_probs(logits: torch.Tensor, temperature: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """log softmax(z / τ) over the last dimension, in ``dtype`` (default: the logits' own, fp32 at least)."""
    return torch.log_softmax(logits.to(dtype or _dtype(logits)) / temperature, -1)


def _both(student_logits, teacher_logits, temperature):
    dtype = _dtype(student_logits, teacher_logits)
    return log_probs(student_logits, temperature, dtype), log_probs(teacher_logits.detach(), temperature, dtype)


def forward_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p ‖ q) per position: (...,) for logits (..., V)."""
    log_q, log_p = _both(student_logits, teacher_logits, temperature)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(q ‖ p) per position: (...,) for logits (..., V)."""
    log_q, log_p = _both(student_logits, teacher_logits, temperature)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def generalised_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float = 1.0
) -> torch.Tensor:
    """β·KL(p ‖ m) + (1 − β)·KL(q ‖ m), m = βp + (1 − β)q, per position, for 0 < β < 1."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"the generalised JSD takes 0 < beta < 1, got {beta}")
    log_q, log_p = _both(student_logits, teacher_logits, temperature)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)


def divergence(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float = 1.0, temperature: float = 1.0
) -> torch.Tensor:
    """Per position: β = 0 forward KL, β = 1 reverse KL (the KLs themselves, not the JSD's limits), else JSD_β."""
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, temperature)
    return generalised_jsd(student_logits, teacher_logits, beta, temperature)


def divergence_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, int]:
    """Σ of ``divergence`` over the positions where ``mask`` (...) is True, and their count.

    student_logits, teacher_logits: (..., V); the sum has autograd's gradient in the student's logits.
    """
    return divergence(student_logits[mask], teacher_logits[mask], beta, temperature).sum(), int(mask.sum())


def sampled_token_loss(
    student_logits: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The policy-gradient surrogate of the sampled tokens, the reverse-KL estimate, and the token count.

    student_logits (..., V) predicting ``tokens`` (...) at the same positions; teacher_logprobs (...):
    log p_T(y) at τ; mask (...) bool. Returns (−Σ A·log q(y) with grad, Σ (log q(y) − log p_T(y)) detached,
    n) over the masked-in positions, A = log p_T(y) − log q(y) detached.
    """
    logq = log_probs(student_logits[mask], temperature).gather(-1, tokens[mask][:, None]).squeeze(-1)
    advantage = (teacher_logprobs[mask].to(logq.dtype) - logq).detach()
    return -(advantage * logq).sum(), (-advantage).sum(), int(mask.sum())
