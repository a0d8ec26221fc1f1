"""Student's t (``ars_opd.student_t``), the one implementation behind the rollout-health detector's Welch
tests and the studies' t-intervals (``ars_opd.evaluation.stats``).

Oracles: mpmath's regularized incomplete beta at 50 digits (the tail and, through ``findroot``, the quantiles);
the closed forms at 1 and 2 degrees of freedom. Bounds are derived from float64's eps, not tuned.
"""

from __future__ import annotations

import math

import pytest

from ars_opd.evaluation import stats
from ars_opd.student_t import student_t_cdf, student_t_sf


def _t_tail_bound(t: float, df: float) -> float:
    """A relative error bound for ``student_t_sf`` in float64: its log prefactor sums five terms (three lgammas and
    two a·log x), each within a few ulps of its magnitude S_i, so the exponent's absolute error, which is the
    tail's relative error, is below 8·eps·ΣS_i; the continued fraction's modified Lentz steps add at most a few eps
    each, 4·eps over its cap of 1,000 iterations, and its stopping rule one eps more."""
    eps = 2.0**-52
    a, b = df / 2, 0.5
    x, y = df / (df + t * t), t * t / (df + t * t)
    terms = [
        math.lgamma(a + b),
        math.lgamma(a),
        math.lgamma(b),
        a * math.log(x) if x else 0.0,
        b * math.log(y) if y else 0.0,
    ]
    return eps * (8 * sum(abs(v) for v in terms) + 4 * 1000 + 1)


@pytest.mark.parametrize("df", [0.5, 1.0, 2.0, 2.5, 7.0, 30.0, 1000.0, 1e4])
def test_student_t_tail_against_mpmath_and_closed_forms(df):
    import mpmath  # torch's own dependency (through sympy), so always there with torch

    with mpmath.workdps(50):
        for t in (0.0, 1e-3, 0.1, 1.0, 2.5, 3.72, 6.6, 20.0, 300.0, -0.5, -3.0, -30.0):
            x = mpmath.mpf(df) / (df + mpmath.mpf(t) ** 2)
            tail = 0.5 * mpmath.betainc(mpmath.mpf(df) / 2, 0.5, 0, x, regularized=True) if t else mpmath.mpf(0.5)
            want = float(tail if t >= 0 else 1 - tail)
            if want < 1e-300:  # below float64's normal range: nothing to compare
                continue
            got = student_t_sf(t, df)
            assert abs(got - want) <= _t_tail_bound(t, df) * want, (t, df, got, want)
    for t in (0.1, 1.0, 6.6, 1e3):  # P(T > t) = atan(1/t)/π at df = 1 (Cauchy); ½(1 − t/√(2 + t²)) at df = 2
        assert student_t_sf(t, 1.0) == pytest.approx(math.atan(1 / t) / math.pi, rel=_t_tail_bound(t, 1.0) + 8 * 2**-52)
        two = 1 / (math.sqrt(2 + t * t) * (math.sqrt(2 + t * t) + t))  # ½(1 − t/√(2+t²)) without the cancellation
        assert student_t_sf(t, 2.0) == pytest.approx(two, rel=_t_tail_bound(t, 2.0) + 8 * 2**-52)


def test_student_t_tail_at_the_edges():
    """Beyond df 1e7 the normal's tail (t is within 1e-7 relative of it there; lgamma's differences would lose more);
    an infinite t is 0 or 1; a NaN t or a df that is not positive is an error, not a silent p-value."""
    z = 1.3
    assert student_t_sf(z, math.inf) == 0.5 * math.erfc(z / math.sqrt(2))
    assert student_t_sf(z, 1e9) == 0.5 * math.erfc(z / math.sqrt(2))
    assert student_t_sf(math.inf, 3.0) == 0.0 and student_t_sf(-math.inf, 3.0) == 1.0
    for bad_t, bad_df in ((math.nan, 3.0), (1.0, 0.0), (1.0, math.nan), (1.0, -2.0)):
        with pytest.raises(ValueError):
            student_t_sf(bad_t, bad_df)


@pytest.mark.parametrize("df", [1.0, 2.0, 2.5, 4.0, 7.3, 30.0, 1000.0])
def test_quantiles_against_mpmath(df):
    """``stats.student_t_quantile`` (bisection on ``student_t_cdf``, 60 halvings of [0, hi], hi a power of two at
    or above the root) against mpmath's root of its incomplete-beta tail. A comparison ``cdf(t) < p`` can go the
    wrong way only where the computed cdf is within its error of p: the tail's relative bound times 1 − p, plus an
    eps for 1 − tail and one for p; over the density there that is a distance in t, doubled for the density's
    change across it. Add the last bracket's half width."""
    import mpmath

    with mpmath.workdps(50):
        for p in (0.6, 0.8, 0.9, 0.975, 0.995, 0.9995):

            def upper_tail(t, p=p):
                x = mpmath.mpf(df) / (df + t * t)
                return 0.5 * mpmath.betainc(mpmath.mpf(df) / 2, 0.5, 0, x, regularized=True) - (1 - mpmath.mpf(p))

            got = stats.student_t_quantile(p, df)
            want = mpmath.findroot(upper_tail, got)
            density = mpmath.gamma((df + 1) / 2) / (mpmath.sqrt(df * mpmath.pi) * mpmath.gamma(mpmath.mpf(df) / 2))
            density *= (1 + want**2 / df) ** (-(df + 1) / 2)
            err_cdf = _t_tail_bound(float(want), df) * (1 - p) + 2 * 2.0**-52
            hi = 2.0 ** max(0, math.ceil(math.log2(float(want))))
            bound = 2 * err_cdf / float(density) + hi * 2.0**-61
            assert abs(got - float(want)) <= bound, (p, df, got, float(want), bound)


def test_cdf_is_the_tail_mirrored_and_stats_has_no_twin():
    """P(T <= t) + P(T > t) = 1 to rounding, and the intervals use this module's distribution function, not a
    second implementation of their own."""
    for df in (1.0, 3.0, 12.5):
        for t in (-4.0, -0.3, 0.0, 0.7, 5.0):
            assert abs(student_t_cdf(t, df) + student_t_sf(t, df) - 1.0) <= 4 * 2.0**-52
    assert stats.student_t_cdf is student_t_cdf
