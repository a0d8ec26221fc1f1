"""The several-teachers study's page (ars_opd.evaluation.multi_teacher) from evaluations with known numbers.

The page's intervals and paired differences are checked against an independent computation: per-seed differences
taken by hand, their mean and a t-interval from the closed form of Student's t at 2 degrees of freedom (not the
module's own mean_ci, whose quantile comes from Simpson's rule), compared as the page prints them (one decimal of
a point); means within a few float64 roundings; the equal-FLOPs view against a by-hand linear interpolation of the
curves.
"""

from __future__ import annotations

import math
import re

import pytest

from ars_opd.evaluation import multi_teacher
from tolerances import U64, gamma

SEEDS = (1, 2, 3)
# exact match per arm, seed and half (arith, words): the routed student keeps both; each specialist alone loses the
# other half; the single teacher's student is a little behind the routed one
EM = {
    "routed": {1: (0.80, 0.70), 2: (0.82, 0.72), 3: (0.78, 0.69)},
    "arith_only": {1: (0.83, 0.20), 2: (0.84, 0.25), 3: (0.80, 0.22)},
    "words_only": {1: (0.30, 0.74), 2: (0.28, 0.73), 3: (0.33, 0.71)},
    "general": {1: (0.79, 0.66), 2: (0.80, 0.68), 3: (0.77, 0.65)},
}
FLOPS = {"routed": 100.0, "arith_only": 90.0, "words_only": 110.0, "general": 95.0}


def _halves(em: tuple[float, float]) -> dict:
    return {
        "arith": {"exact_match": em[0], "reverse_kl": 1 - em[0], "reverse_kl_fixed_prefix": 2 - em[0]},
        "words": {"exact_match": em[1], "reverse_kl": 1 - em[1], "reverse_kl_fixed_prefix": 2 - em[1]},
    }


def _evaluation(arm: str, seed: int) -> dict:
    """An evaluate stage's metrics of one arm's student (opd) and the start (sft), with per-teacher figures and a
    learning curve from the start's FLOPs to the arm's final."""
    em = EM[arm][seed]
    final = _halves(em)
    start = _halves((0.5, 0.4))

    def point(flops, halves):
        return {
            "flops": flops,
            "exact_match": (halves["arith"]["exact_match"] * 3 + halves["words"]["exact_match"] * 2) / 5,
            "reverse_kl": 0.5,
            "reverse_kl_fixed_prefix": 1.5,
            "per_teacher": halves,
        }

    return {
        "opd": {**point(FLOPS[arm], final), "per_teacher": final},
        "sft": {**point(0.0, start), "per_teacher": start},
        "curves": {"opd": [point(0.0, start), point(FLOPS[arm], final)]},
    }


def _t_interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of three values: Student's t at 2 degrees of freedom has the closed-form CDF
    1/2 + t / (2 sqrt(2 + t^2)), so its 0.975 quantile is a sqrt(2 / (1 - a^2)) with a = 0.95."""
    m = sum(xs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / 2)
    half = 0.95 * math.sqrt(2 / (1 - 0.95**2)) * sd / math.sqrt(3)
    return m, m - half, m + half


@pytest.fixture(scope="module")
def study():
    by_seed = {s: {arm: _evaluation(arm, s) for arm in EM} for s in SEEDS}
    start = {s: multi_teacher.final_values(by_seed[s]["routed"], "sft") for s in SEEDS}
    return multi_teacher.summary(by_seed, start)


def _printed(cell: str) -> tuple[float, float, float]:
    """The three numbers of a page cell "+m [+lo, +hi] pt"."""
    return tuple(float(x) for x in re.findall(r"[+-]\d+\.\d", cell))


# a handful of float64 roundings of values of size <= 1 (sums of three, a division, a difference)
FLOAT64 = gamma(8, U64)
# the page prints points to one decimal: a printed figure is within half its last digit of the number
PRINTED = 0.05


def test_equal_steps_differences_are_paired_by_seed(study):
    t = study["views"]["equal_steps"]
    page = multi_teacher.render(study, {})
    rows: dict[str, list[str]] = {}  # each arm's first row: the first table is exact match at equal steps
    for line in page.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0].lstrip("| "), line.split(" | "))
    for arm, half, k in (("arith_only", "words", 1), ("words_only", "arith", 0), ("general", "words", 1)):
        diffs = [EM[arm][s][k] - EM["routed"][s][k] for s in SEEDS]
        want = _t_interval(diffs)
        assert abs(t[arm][half]["exact_match"]["minus_routed"]["mean_ci"][0] - want[0]) <= FLOAT64
        # its "− routed" column for this half
        cells = rows[multi_teacher.ARMS[arm][0]]
        got = _printed(cells[2 if half == "arith" else 4])
        assert all(abs(g - 100 * w) <= PRINTED + 100 * FLOAT64 for g, w in zip(got, want)), (arm, half, got, want)
    assert t["arith_only"]["words"]["exact_match"]["minus_routed"]["resolved"]
    assert abs(t["routed"]["arith"]["exact_match"]["mean_ci"][0] - 0.80) <= FLOAT64


def test_equal_flops_reads_every_arm_at_the_cheapest_arms_final_flops(study):
    x = min(FLOPS.values())
    assert study["equal_flops_at"] == {s: x for s in SEEDS}
    t = study["views"]["equal_flops"]
    for arm in EM:
        # the curve is a line from (0, start) to (FLOPS[arm], final): read off at x by hand
        w = x / FLOPS[arm]
        want = [0.5 + w * (EM[arm][s][0] - 0.5) for s in SEEDS]
        got = t[arm]["arith"]["exact_match"]["values"]
        assert all(abs(g - w) <= FLOAT64 for g, w in zip(got, want)), (arm, got, want)


def test_the_positive_control_and_the_page(study):
    pc = study["positive_control"]["arith_only on the letters half"]
    assert pc["resolved"] and pc["mean_ci"][0] == pytest.approx(
        sum(EM["arith_only"][s][1] - EM["routed"][s][1] for s in SEEDS) / 3
    )
    page = multi_teacher.render(study, {"command": "python studies/multi_teacher.py", "wall": "1 minute"})
    m, lo, hi = _t_interval([EM["arith_only"][s][1] - EM["routed"][s][1] for s in SEEDS])
    assert f"{100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] pt" in page  # the control's interval, as printed
    assert "## Verdict" in page and "At equal steps:" in page and "At equal FLOPs:" in page
    # the routed student beat the arithmetic specialist's own student on the letters half by far: the verdict's
    # clause on the arithmetic half compares like with like (routed − arith alone on the arithmetic half)
    d = [EM["routed"][s][0] - EM["arith_only"][s][0] for s in SEEDS]
    m, lo, hi = _t_interval(d)
    assert f"routed − arithmetic specialist alone {100 * m:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] points" in page
