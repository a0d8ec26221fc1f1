"""Seeds: one global seed (``base.seed``), an independent stream per purpose derived from it."""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, purpose: str) -> int:
    """Stable 31-bit seed for one purpose (e.g. 'teacher-init', 'subset') from the global seed.

    Hash-based, so it does not depend on Python's hash randomisation or on the order of calls.
    """
    digest = hashlib.sha256(f"{seed}:{purpose}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
