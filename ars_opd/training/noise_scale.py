"""The gradient noise scale of a run, smoothed over steps (the ``gns/b_simple`` column of the step log).

Each step's terms, |G|² and tr Σ, are estimated from the worker gradients
(``ars_opd.training.consistency.noise_scale_terms``) and logged (``gns/g2``, ``gns/trace``); this module
only smooths them. The estimate is a pure function of those logged terms, so a resumed run rebuilds it from
the checkpoint's log and logs the same numbers an uninterrupted run does.
"""

from __future__ import annotations

import math


class NoiseScale:
    """B_simple = tr Σ / |G|² with numerator and denominator smoothed separately (EMA) before dividing."""

    def __init__(self, ema: float):
        self.ema, self.g2, self.trace = ema, None, None

    @classmethod
    def from_log(cls, ema: float, rows: list[dict]) -> NoiseScale:
        """The estimator as it stands after the logged steps ``rows`` (a resumed run's history)."""
        noise_scale = cls(ema)
        for row in rows:
            noise_scale.update(row.get("gns/g2", float("nan")), row.get("gns/trace", float("nan")))
        return noise_scale

    def update(self, g2: float, trace: float) -> float:
        if math.isfinite(g2) and math.isfinite(trace):
            a = self.ema
            self.g2 = g2 if self.g2 is None else a * self.g2 + (1 - a) * g2
            self.trace = trace if self.trace is None else a * self.trace + (1 - a) * trace
        return self.trace / self.g2 if self.g2 else float("nan")
