"""Replica drift: are the data-parallel replicas still the same model?

DDP all-reduces gradients and never touches weights after the initial broadcast; every rank applies the
same reduced update, so on a healthy run every rank's parameters and optimizer state are bit-identical at
every step. A desynchronised replica (a one-off perturbation, a rank that skipped an update, a
non-deterministic kernel) is invisible to every gradient statistic yet trains a different model on one
rank. Every ``ddp.drift_check_every`` steps each rank computes ``fingerprint`` on its device and the
fingerprints are all-gathered; ``mismatched_ranks`` names the ranks that differ from the majority
(``check_drift`` does both; the engine's step calls it before its forward). On a healthy CPU run the
fingerprints match bit for bit, so the check has no false alarms by construction.

The fingerprint of a tensor reads its bytes as int16 words u_i and keeps three int64 checksums: Σu_i,
Σu_i·a_i and Σu_i·b_i with a_i = (i mod 65521) + 1 and b_i = (i² mod 65521) + 1. A one-ulp change of an
element moves its bits by one, which changes the plain sum of its words by a nonzero amount even when it
carries into the next word. A swap of two words keeps the plain sum and changes the linear one unless
their positions agree modulo 65521 (a prime, so no power-of-two row length or stride is a multiple of
it). A swap of two multi-word elements moves their low and high words by the same distance, so the linear
sum misses it when the words' changes cancel (e.g. 0x3F80_0010 and 0x3F81_000F); the quadratic weights
move the two words by different amounts and see it. It is a checksum against accidents, not a
cryptographic hash.

How, cheaply (the check reads every parameter and optimizer-state byte, ~3x the model's size, so its cost
is one pass over memory): the words are laid out as rows of 65521, and integer sums down the rows give the
column sums c_j (int32 accumulators over blocks of 2^15 rows: |c_j| < 2^30, exact), to which the last
n mod 65521 words (the tail) are added; every weight depends on the column only, so the checksums are
Σc_j, Σc_j·a_j and Σc_j·b_j. No per-element index, weight or product tensor. Integer sums are exact, so the
result does not depend on the order a kernel adds in: equal bytes give equal fingerprints on any device or
thread count.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterable

import torch
import torch.distributed as dist

from ars_opd.training.distributed import WorkerContext

# largest prime below 2**16: weights <= 2**16, so Σc_j·w_j fits int64 for up to 2**32 words; past that the
# sums wrap (two's complement), which still gives equal bytes equal sums and a single change a nonzero one
_MODULUS = 65521
BLOCK_ROWS = 1 << 15  # rows per int32 column sum: |sum| <= 2**15 * 2**15 = 2**30, no overflow
_weights: dict[torch.device, torch.Tensor] = {}


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int16 view (no copy for contiguous tensors of 2, 4 or 8 bytes)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() == 1:  # bool/int8: widen so the int16 view is defined
        flat = flat.to(torch.int16)
    return flat.view(torch.int16)


def _column_weights(device: torch.device) -> torch.Tensor:
    """(3, 65521) int64 on ``device``: the weights 1, a_j = j + 1 and b_j = (j² mod 65521) + 1 of column j
    (built once per device)."""
    w = _weights.get(device)
    if w is None:
        j = torch.arange(_MODULUS, dtype=torch.int64)
        w = _weights[device] = torch.stack([torch.ones_like(j), j + 1, j * j % _MODULUS + 1]).to(device)
    return w


def column_sums(grid: torch.Tensor) -> torch.Tensor:
    """int32 sums down the rows of an int16 (rows, 65521) grid, rows <= 2**15.

    On a CPU, one in-place add per row into an int32 accumulator: contiguous passes at the speed of
    reading the memory, where torch's strided reduction over dim 0 with a dtype cast measured ~5x slower.
    On an accelerator, that one reduction: a kernel launch per row would cost more than the pass itself.
    """
    if grid.device.type != "cpu":
        return grid.sum(0, dtype=torch.int32)
    acc = torch.zeros(grid.shape[1], dtype=torch.int32)
    for row in grid:
        acc += row
    return acc


def tensor_fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """(3,) int64 checksums over the bytes of ``tensors``; each tensor's own word index i restarts at 0, so all
    tensors share one set of column sums. They are summed on the accelerator if any tensor is on one: a tensor
    elsewhere (AdamW keeps its step counts on the CPU beside moments on the GPU) is copied there, the small one
    to the large ones."""
    tensors = list(tensors)
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    cols = None
    for t in tensors:
        u = _words(t)
        if device is not None and u.device != device:
            u = u.to(device)
        if cols is None:
            cols = torch.zeros(_MODULUS, dtype=torch.int64, device=u.device)
        rows = u.numel() // _MODULUS
        if rows:
            grid = u[: rows * _MODULUS].view(rows, _MODULUS)
            for r in range(0, rows, BLOCK_ROWS):
                cols += column_sums(grid[r : r + BLOCK_ROWS])
        tail = u[rows * _MODULUS :]
        cols[: tail.numel()] += tail
    if cols is None:
        return torch.zeros(3, dtype=torch.int64)
    return (_column_weights(cols.device) * cols).sum(1)


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """(6,) int64: checksums of the parameters, then of the optimizer state tensors (zeros without one)."""
    params = list(model.parameters())
    out = [tensor_fingerprint(params)]
    if optimizer is not None:
        state = [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
        out.append(tensor_fingerprint(state).to(out[0].device))
    else:
        out.append(torch.zeros(3, dtype=torch.int64, device=out[0].device))
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


def check_drift(model: torch.nn.Module, opt, ctx: WorkerContext, seconds: dict | None = None) -> list[int]:
    """All ranks call: all-gather every rank's fingerprint; the ranks that differ from the majority.

    ``seconds`` (optional) gets the time of this rank's fingerprint (``drift``) and of the all-gather and
    comparison (``drift_gather``), apart: the gather also waits for the slowest rank, a wait that the step's
    next collective would otherwise take.
    """
    t0 = time.perf_counter()
    local = fingerprint(model, opt).to(ctx.device)
    if seconds is not None and local.is_cuda:
        torch.cuda.synchronize(local.device)  # the fingerprint's time, not its launch (.cpu() waits below anyway)
    t1 = time.perf_counter()
    parts = [torch.empty_like(local) for _ in range(ctx.world_size)]
    dist.all_gather(parts, local)
    found = mismatched_ranks(torch.stack(parts).cpu())
    if seconds is not None:
        seconds.update(drift=t1 - t0, drift_gather=time.perf_counter() - t1)
    return found
