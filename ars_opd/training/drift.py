"""Replica drift: are the data-parallel replicas still the same model?

DDP all-reduces gradients and never touches weights after the initial broadcast; every rank applies the
same reduced update, so on a healthy run every rank's parameters and optimizer state are bit-identical at
every step. A desynchronised replica (a one-off perturbation, a rank that skipped an update, a
non-deterministic kernel) is invisible to every gradient statistic yet trains a different model on one
rank. Every ``ddp.drift_check_every`` steps each rank computes ``fingerprint`` on its device and the
fingerprints are all-gathered; ``mismatched_ranks`` names the ranks that differ from the majority. On a
healthy CPU run the fingerprints match bit for bit, so the check has no false alarms by construction.

The fingerprint of a tensor reads its bytes as int16 words u_i and keeps two int64 checksums: Σu_i and
Σ u_i·w_i with w_i = (i mod 65521) + 1. Any single changed word (a one-ulp change included) changes the
first sum by a nonzero amount, and two changes that cancel in the first sum change the second unless their
positions agree modulo 65521. It is a checksum against accidents, not a cryptographic hash.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

_MODULUS = 65521  # largest prime below 2**16: weights < 2**16, products of int16 words stay < 2**31


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() == 1:  # bool/int8: widen so the int16 view is defined
        flat = flat.to(torch.int16)
    return flat.view(torch.int16).to(torch.int64)


def tensor_fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """(2,) int64 checksums over the bytes of ``tensors``, in order (each tensor's own weights restart at 1)."""
    total = None
    for t in tensors:
        u = _words(t)
        w = torch.arange(u.numel(), device=u.device, dtype=torch.int64) % _MODULUS + 1
        pair = torch.stack([u.sum(), (u * w).sum()])
        total = pair if total is None else total + pair
    return total if total is not None else torch.zeros(2, dtype=torch.int64)


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """(4,) int64: checksums of the parameters, then of the optimizer state tensors (zeros without one)."""
    params = list(model.parameters())
    out = [tensor_fingerprint(params)]
    if optimizer is not None:
        state = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
        out.append(tensor_fingerprint(state).to(out[0].device))
    else:
        out.append(torch.zeros(2, dtype=torch.int64, device=out[0].device))
    return torch.cat(out)


def mismatched_ranks(fingerprints: torch.Tensor) -> list[int]:
    """Ranks whose fingerprint differs from the most common one ((K, F) int64 in rank order).

    With no strict majority (e.g. two ranks that disagree) every rank outside the largest group is named;
    with a tie for largest, every rank is named: it cannot be said which replica is right.
    """
    rows = [tuple(r) for r in fingerprints.tolist()]
    counts = Counter(rows).most_common()
    if len(counts) == 1:
        return []
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return list(range(len(rows)))
    majority = counts[0][0]
    return [k for k, r in enumerate(rows) if r != majority]
