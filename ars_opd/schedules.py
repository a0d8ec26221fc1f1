"""Learning-rate schedules (pure functions of the step)."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
