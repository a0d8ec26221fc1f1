"""Worker-consistency statistics of data-parallel training, taken before the all-reduce (definitions in
docs/design.md, "Worker consistency").

At step t with K workers, L_k is worker k's loss on its share (its token mean), g_k its local gradient
(summed over its accumulation micro-batches, in the scale of the reduced gradient: the engine scales each
worker's loss by K / N_global, so g_k is worker k's estimate of the full gradient and the reduced gradient is
ḡ = mean_k g_k). Per step we report:

- loss dispersion LD = std_k L_k (population std) and the range max_k L_k − min_k L_k;
- gradient-norm dispersion GND = std_k ‖g_k‖₂ (population std), and every ‖g_k‖;
- gradient-direction consistency GDC = mean over pairs i<j of cos(g_i, g_j);
- cos(g_k, ḡ) per worker, and gradient diversity Σ_k ‖g_k‖² / ‖Σ_k g_k‖².

How: ``ConsistencyHook`` is a DDP communication hook. For each bucket it accumulates ‖local‖² on the
device (fp32, before the all-reduce touches the buffer), then runs exactly DDP's default all-reduce
(divide by K, sum). ‖ḡ‖² is the squared norm of the reduced gradient, which the engine computes anyway
(the pre-clip norm). Statistics are keyed by ``bucket.index()`` (callbacks complete out of order; DDP
rebuilds its buckets after the first step) and summed in index order at the end of the step: no host
sync per bucket, one small all-gather per step (merged into the engine's). Reduced gradients are
bit-identical to DDP without the hook (tested).

From those scalars, Σ_{i<j}⟨g_i, g_j⟩ = (K²‖ḡ‖² − Σ_k‖g_k‖²) / 2 exactly. For K = 2 that is the one pair,
so GDC and cos(g_k, ḡ) = (‖g_k‖² + ⟨g_1, g_2⟩) / (2‖g_k‖‖ḡ‖) are exact every step with no copy of any
gradient. For K > 2 the hook also clones each bucket's local gradient to accumulate ⟨g_k, ḡ⟩ after the
all-reduce (cos to the mean per worker), and the pairwise inner products need the Gram matrix: every
``gram_every`` steps the hook keeps the local clones and all-gathers them bucket by bucket (exact GDC).
On the other steps GDC is the norm-weighted mean of the pairwise cosines,
Σ_{i<j}⟨g_i,g_j⟩ / Σ_{i<j}‖g_i‖‖g_j‖ (the numerator is exact: (K²‖ḡ‖² − Σ‖g_k‖²)/2), reported with the
bound Σ_{i<j}|w_ij − 1/P| (w_ij = ‖g_i‖‖g_j‖ / Σ‖g_a‖‖g_b‖, P pairs) on its distance to the unweighted
mean, since every cosine lies in [−1, 1]. Equal norms make it exact (bound 0).

Under ``ddp.strategy: fsdp`` the same statistics come from FSDP2's reduce-scatter inputs
(``ars_opd.training.sharding.ShardedConsistencyHook``); ``consistency_metrics`` and ``noise_scale_terms``
below serve both. What this module leaves out: per-parameter-group statistics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class ConsistencyHook:
    """DDP communication hook collecting per-worker gradient statistics of each step."""

    world_size: int
    gram_every: int = 0  # K > 2: exact Gram matrix every this many steps (0: never)
    process_group: dist.ProcessGroup | None = None
    _sq: dict[int, torch.Tensor] = field(default_factory=dict)
    _dot: dict[int, torch.Tensor] = field(default_factory=dict)
    _keep: dict[int, torch.Tensor] = field(default_factory=dict)
    _host: list[float] = field(default_factory=list)  # seconds per piece of statistic work (list.append is atomic)
    _gram_step: bool = False

    def attach(self, ddp_model: torch.nn.Module) -> None:
        if not isinstance(ddp_model, DDP):
            raise TypeError(
                "the consistency hook works with DistributedDataParallel only (FSDP: ShardedConsistencyHook)"
            )
        ddp_model.register_comm_hook(self, _hook)

    def begin_step(self, step: int) -> None:
        self._sq.clear()
        self._dot.clear()
        self._keep.clear()
        self._host.clear()
        self._gram_step = self.world_size > 2 and self.gram_every > 0 and step % self.gram_every == 0

    @property
    def tracks_dot(self) -> bool:
        """⟨g_k, ḡ⟩ needs a copy of the local gradient; only K > 2 needs it (K = 2 derives it exactly)."""
        return self.world_size > 2

    @property
    def reductions(self) -> int:
        """The gradient reductions this step's statistics summed over: DDP buckets here, FSDP groups under fsdp."""
        return len(self._sq)

    def host_seconds(self) -> float:
        """Host time this step spent on the hook's own statistics (norms, clones, cross terms), not on the
        all-reduce that DDP does anyway; on an accelerator it is launch time unless the caller synchronises."""
        return sum(self._host)

    def local_stats(self, device: torch.device) -> torch.Tensor:
        """[‖g_k‖², ⟨g_k, ḡ⟩ or NaN] of this worker's step, fp64 on ``device`` (summed in bucket order)."""
        if not self._sq:
            return torch.full((2,), float("nan"), dtype=torch.float64, device=device)
        keys = sorted(self._sq)
        sq = torch.stack([self._sq[k] for k in keys]).sum().to(torch.float64)
        if self._dot:
            dot = torch.stack([self._dot[k] for k in sorted(self._dot)]).sum().to(torch.float64)
        else:
            dot = torch.tensor(float("nan"), dtype=torch.float64, device=sq.device)
        return torch.stack([sq, dot]).to(device)

    def gram(self) -> torch.Tensor | None:
        """On a Gram step, the exact (K, K) Gram matrix of local gradients (a collective: all ranks call)."""
        if not self._gram_step:
            return None
        total = None
        for k in sorted(self._keep):
            local = self._keep[k]
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local, group=self.process_group)
            stacked = torch.stack(parts).double()  # (K, n)
            g = stacked @ stacked.T
            total = g if total is None else total + g
        self._keep.clear()
        return total


def _hook(state, bucket):  # (ConsistencyHook, dist.GradBucket) -> Future[Tensor]; DDP checks real
    # annotation objects, which ``from __future__ import annotations`` would turn into strings
    t0 = time.perf_counter()
    buffer = bucket.buffer()
    index = bucket.index()
    # fp32 accumulation (fp64 is ~15x slower on CPU); the cross term is a difference of squared norms, so
    # cosines carry an absolute error of ~1e-5 near 1 (measured), clamped to [-1, 1]
    state._sq[index] = torch.linalg.vector_norm(buffer, dtype=torch.float32).square()  # before the in-place reduce
    local = None
    if state.tracks_dot or state._gram_step:
        local = buffer.detach().float().clone()  # the all-reduce below works in place on ``buffer``
        if state._gram_step:
            state._keep[index] = local
    state._host.append(time.perf_counter() - t0)
    # exactly DDP's default all-reduce: divide by the world size, then sum
    buffer.div_(state.world_size)
    fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
    if not state.tracks_dot:
        return fut.then(lambda f: f.value()[0])

    def after(f: torch.futures.Future) -> torch.Tensor:
        t1 = time.perf_counter()
        reduced = f.value()[0]
        state._dot[index] = (local * reduced.float()).sum()
        state._host.append(time.perf_counter() - t1)
        return reduced

    return fut.then(after)


def _clamp(cos: float) -> float:
    return max(-1.0, min(1.0, cos))


def _population_std(values: Sequence[float]) -> float:
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def consistency_metrics(
    worker_loss: Sequence[float],
    sq: Sequence[float],
    dot: Sequence[float] | None,
    mean_sq: float,
    gram: torch.Tensor | None = None,
) -> dict:
    """The step's statistics from per-worker scalars (pure function; see the module docstring).

    worker_loss, sq (‖g_k‖²): length K; dot (⟨g_k, ḡ⟩, length K) may be None or NaN for K <= 2, where it
    follows exactly from the norms; mean_sq: ‖ḡ‖²; gram: optional exact (K, K) Gram matrix.
    """
    K = len(worker_loss)
    if len(sq) != K or K == 0 or (dot is not None and len(dot) != K):
        raise ValueError(
            f"need K >= 1 values per worker, got {len(worker_loss)}, {len(sq)}, {None if dot is None else len(dot)}"
        )
    norms = [math.sqrt(max(s, 0.0)) for s in sq]
    mean_norm = math.sqrt(max(mean_sq, 0.0))
    inner_sum = (K * K * mean_sq - sum(sq)) / 2  # Σ_{i<j} ⟨g_i, g_j⟩, exact for every K
    if K == 1:
        dot = [mean_sq]
    elif K == 2:
        dot = [(s + inner_sum) / 2 for s in sq]  # ⟨g_k, ḡ⟩ = (‖g_k‖² + ⟨g_1, g_2⟩) / 2
    elif dot is None or any(math.isnan(d) for d in dot):
        dot = [float("nan")] * K
    out = {
        "loss_dispersion": _population_std(worker_loss),
        "loss_range": max(worker_loss) - min(worker_loss),
        "grad_norm_dispersion": _population_std(norms),
        "worker_grad_norm": norms,
        "worker_cos_to_mean": [
            _clamp(d / (n * mean_norm)) if n > 0 and mean_norm > 0 else float("nan") for d, n in zip(dot, norms)
        ],
        "gradient_diversity": sum(sq) / (K * K * mean_sq) if mean_sq > 0 else float("nan"),
    }
    if K == 1:
        out.update(grad_direction_consistency=float("nan"), gdc_exact=True, gdc_error_bound=0.0)
        return out
    pairs = [(i, j) for i in range(K) for j in range(i + 1, K)]
    if gram is not None:
        g = gram.double()
        cos = [float(g[i, j] / math.sqrt(float(g[i, i]) * float(g[j, j]))) for i, j in pairs]
        out.update(grad_direction_consistency=sum(cos) / len(cos), gdc_exact=True, gdc_error_bound=0.0)
    elif K == 2:
        denom = norms[0] * norms[1]
        out.update(
            grad_direction_consistency=_clamp(inner_sum / denom) if denom > 0 else float("nan"),
            gdc_exact=True,
            gdc_error_bound=0.0,
        )
    else:
        products = [norms[i] * norms[j] for i, j in pairs]
        total = sum(products)
        weights = [p / total for p in products] if total > 0 else [1 / len(pairs)] * len(pairs)
        out.update(
            grad_direction_consistency=inner_sum / total if total > 0 else float("nan"),
            gdc_exact=False,
            gdc_error_bound=sum(abs(w - 1 / len(pairs)) for w in weights),
        )
    return out


def noise_scale_terms(sq: Sequence[float], tokens: Sequence[int], mean_sq: float) -> tuple[float, float]:
    """One step's unbiased estimates of (|G|², tr Σ) from the workers' local gradients (McCandlish et al.
    2018, "An Empirical Model of Large-Batch Training", App. A.1), batch sizes in loss tokens.

    sq: ‖g_k‖² per worker in the engine's scale (g_k = K/N · the sum of worker k's token gradients, N the
    step's global tokens); tokens: n_k per worker; mean_sq: ‖ḡ‖² of the reduced (pre-clip) gradient. Worker
    k's own token-mean gradient is G_k = g_k·N/(K·n_k), with E‖G_k‖² = |G|² + tr Σ/n_k when its n_k token
    gradients are independent draws of covariance Σ, and E‖ḡ‖² = |G|² + tr Σ/N (B_big = N).

    The workers' token counts differ (OPD's completions, SFT's ragged rows), so the plain mean over workers
    of ‖G_k‖² has expectation |G|² + tr Σ·mean_k(1/n_k), and pairing it with B_small = N/K, as App. A.1 does for
    equal batches, overstates tr Σ by the factor (N·mean_k(1/n_k) − 1)/(K − 1) ≥ 1 (Jensen; 1 when the n_k
    are equal) and understates |G|² to match. Weighted by each worker's tokens instead,
    |G_small|² = Σ_k (n_k/N)·‖G_k‖² has expectation |G|² + tr Σ·K/N exactly, so B_small = N/K is its batch
    size whatever the split (``tests/test_noise_scale_weights.py`` measures both). Then
    |G|² ≈ (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small) and
    tr Σ ≈ (|G_small|² − |G_big|²)/(1/B_small − 1/B_big). Each is noisy on one step: average numerator
    and denominator over steps before taking the ratio B_simple = tr Σ / |G|². NaN for one worker.
    """
    K = len(sq)
    if K < 2 or len(tokens) != K:
        return float("nan"), float("nan")
    N = float(sum(tokens))
    if N <= 0 or any(n <= 0 for n in tokens):
        return float("nan"), float("nan")
    # Σ_k (n_k/N)·‖g_k‖²·(N/(K·n_k))² = Σ_k ‖g_k‖²·N/(K²·n_k)
    small = sum(s * N / (K * K * n) for s, n in zip(sq, tokens))
    b_small, b_big = N / K, N
    g2 = (b_big * mean_sq - b_small * small) / (b_big - b_small)
    trace = (small - mean_sq) / (1 / b_small - 1 / b_big)
    return g2, trace
