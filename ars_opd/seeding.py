"""Seeds: one global seed (``base.seed``), an independent stream per purpose derived from it, and the
per-rank seeds of the data-parallel seed scenarios."""

from __future__ import annotations

import hashlib
import random

SCENARIOS = ("S1-1", "S1-2", "S1-3")


def derive_seed(seed: int, purpose: str) -> int:
    """Stable 31-bit seed for one purpose (e.g. 'teacher-init', 'subset') from the global seed.

    Hash-based, so it does not depend on Python's hash randomisation or on the order of calls.
    """
    digest = hashlib.sha256(f"{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def scenario_seeds(scenario: str, seed: int, rank: int) -> tuple[int, int]:
    """(sampler seed, RNG seed) of a worker under a seed scenario (docs/design.md, "Seed scenarios").

    S1-1 strict: one seed everywhere (disjoint, identically shuffled shards; identical RNG streams).
    S1-2 mild: rank 0 uses another seed for both; the other ranks the baseline.
    S1-3 significant: every rank's seeds depend on its rank.
    """
    if scenario == "S1-1":
        return seed, seed
    if scenario == "S1-2":
        return (derive_seed(seed, "rank0-differs"),) * 2 if rank == 0 else (seed, seed)
    if scenario == "S1-3":
        s = derive_seed(seed, f"rank-{rank}")
        return s, s
    raise ValueError(f"unknown scenario {scenario!r}; allowed: {', '.join(SCENARIOS)}")


def set_seeds(rng_seed: int) -> None:
    """Seed Python's and torch's global generators (every device)."""
    import torch

    random.seed(rng_seed)
    torch.manual_seed(rng_seed)
