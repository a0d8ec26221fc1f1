"""Student's t distribution in plain Python (``math``): the tail through the regularized incomplete beta function,
accurate far into the tail, and the distribution function. One implementation for the two users: the rollout-health
detector's Welch tests (``ars_opd.training.opd.rollout_health``, which ``ars-opd check`` loads without numpy) and the
studies' t-intervals (``ars_opd.evaluation.stats``). scipy is not installed, so it is computed here.
"""

from __future__ import annotations

import math


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def _continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz), which converges fast for
    x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 2.0**-52
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence at a={a}, b={b}, x={x}")


def regularized_beta(x: float, y: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, with ``y`` = 1 − x given separately (so a tail near
    x = 1 keeps its digits): the continued fraction on whichever side converges."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    log_x = math.log(x) if x < 0.5 else math.log1p(-y)
    log_y = math.log(y) if y < 0.5 else math.log1p(-x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * log_x + b * log_y
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _continued_fraction(b, a, y) / b


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom:
    ½ I_{df/(df+t²)}(df/2, ½) for t > 0, accurate far into the tail (p = 1e-12 keeps its leading digits)."""
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    if math.isnan(t):
        raise ValueError("t is NaN")
    if df > 1e7:  # lgamma's differences lose digits here; t is within 1e-7 relative of the normal anyway
        return _normal_sf(t)
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * regularized_beta(df / (df + t * t), t * t / (df + t * t), df / 2.0, 0.5)
    return tail if t > 0 else 1.0 - tail


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0) degrees of freedom."""
    return student_t_sf(-t, df)
