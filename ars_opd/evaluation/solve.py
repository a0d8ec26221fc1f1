"""Inverting a monotone function numerically: the detector's CUSUM threshold (run length -> h) and the
scenario study's t quantiles (probability -> t) are both "the x where an increasing f(x) reaches y"."""

from __future__ import annotations

from typing import Callable


def solve_increasing(f: Callable[[float], float], y: float, iterations: int = 100) -> float:
    """The x >= 0 with f(x) == y for an increasing f with f(0) <= y: double an upper bound until it is
    past y, then bisect ``iterations`` times."""
    lo, hi = 0.0, 1.0
    while f(hi) < y:
        hi *= 2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < y else (lo, mid)
    return (lo + hi) / 2
