"""Small-sample statistics of the studies (seed sweeps): Student's t, t-intervals, Welch's difference, the
smallest detectable difference, and the Jonckheere–Terpstra test of an ordering.

Pure functions of numbers, used by the scenario study (``ars_opd.evaluation.scenarios``), the distillation
study (``ars_opd.evaluation.distillation``) and the first-error tables (``ars_opd.evaluation.first_error``).
Student's t comes from ``ars_opd.student_t`` (the regularized incomplete beta; the rollout-health
detector uses the same code), its quantiles by bisection on it: scipy is not installed.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from ars_opd.evaluation.solve import solve_increasing
from ars_opd.student_t import student_t_cdf


@functools.lru_cache(maxsize=256)
def student_t_quantile(p: float, df: float) -> float:
    """The t with ``student_t_cdf(t, df) == p`` (bisection), for 0.5 <= p < 1."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    return solve_increasing(lambda t: student_t_cdf(t, df), p, iterations=60)


def mean_ci(x: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper) of the t-interval; NaN bounds for fewer than two values."""
    a = np.asarray(x, dtype=float)
    m = float(a.mean()) if len(a) else float("nan")
    if len(a) < 2:
        return m, float("nan"), float("nan")
    half = student_t_quantile(0.5 + level / 2, len(a) - 1) * float(a.std(ddof=1)) / math.sqrt(len(a))
    return m, m - half, m + half


def one_difference(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the paired differences a − b are one number up to float64 rounding, so their t-interval has no width
    and says nothing (exact match moves in steps of one prompt: one prompt fewer in every seed is 36/78 − 37/78 in
    one seed and 37/78 − 38/78 in another, equal in exact arithmetic, apart by 1e-17 in floats). With s the largest
    magnitude among a and b, each difference of two correctly rounded numbers (error at most eps/2 · s each) is
    rounded once more (at most eps/2 · 2s), so it is within 1.5 · eps · s of the exact one, and two renderings of
    one exact difference are within 3 · eps · s of each other; the bound used is 4 · eps · s."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(x) < 2 or len(x) != len(y) or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return False
    d = x - y
    return float(d.max() - d.min()) <= 4 * np.finfo(float).eps * float(np.abs(np.concatenate([x, y])).max())


def welch_diff(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float, float, float, float]:
    """mean(b) − mean(a) with its Welch t-interval: (diff, lower, upper, standard error, degrees of freedom)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    d = float(b.mean() - a.mean())
    if se == 0:
        return d, d, d, 0.0, float("inf")
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = student_t_quantile(0.5 + level / 2, df) * se
    return d, d - half, d + half, se, df


def detectable_difference(se: float, df: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference a two-sided level-``alpha`` t-test finds with probability ``power``."""
    if not math.isfinite(df):
        df = 1e6
    return (student_t_quantile(1 - alpha / 2, df) + student_t_quantile(power, df)) * se


def jonckheere(groups: Sequence[Sequence[float]], permutations: int = 20000, seed: int = 0) -> tuple[float, float]:
    """Jonckheere–Terpstra statistic for the ordered alternative groups[0] < groups[1] < …, and its one-sided
    permutation p-value (the share of label permutations with a statistic at least as large; ties count ½)."""
    sizes = [len(g) for g in groups]
    values = np.concatenate([np.asarray(g, dtype=float) for g in groups])
    bounds = np.cumsum([0] + sizes)

    def statistic(x: np.ndarray) -> np.ndarray:  # x: (P, n)
        total = np.zeros(x.shape[0])
        for i in range(len(groups)):
            for j in range(i + 1, len(groups)):
                a = x[:, bounds[i] : bounds[i + 1]][:, :, None]
                b = x[:, bounds[j] : bounds[j + 1]][:, None, :]
                total += (b > a).sum((1, 2)) + 0.5 * (b == a).sum((1, 2))
        return total

    observed = float(statistic(values[None])[0])
    rng = np.random.default_rng(seed)
    perms = np.stack([rng.permutation(values) for _ in range(permutations)])
    p = (1 + int((statistic(perms) >= observed).sum())) / (permutations + 1)
    return observed, p
