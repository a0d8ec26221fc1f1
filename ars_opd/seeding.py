"""Seeds: one global seed (``base.seed``), an independent stream per purpose derived from it, and the
per-rank seeds of the data-parallel seed scenarios; and the CPU kernels a run may use (``base.cpu_kernels``),
without which the same seeds give other floats on another CPU."""

from __future__ import annotations

import hashlib
import os
import platform
import random
from typing import MutableMapping

# base.cpu_kernels → the variables that cap torch's own kernels (ATen's dispatch) and MKL's (its BLAS). Each library
# reads its variable once, at its first use, so they are set before the stage imports torch. ATen's cap is the one
# that moved a small Llama's trained weights here (MKL's and oneDNN's alone left them bit-identical); oneDNN is left
# alone: capped at AVX2 its bf16 matmuls ran 100× slower (48 s against 0.5 s), and its cap changed nothing in fp32.
KERNEL_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "native": {},
}
X86 = ("x86_64", "amd64", "x64")


def pin_cpu_kernels(choice: str, environ: MutableMapping[str, str] | None = None, machine: str | None = None) -> dict:
    """Cap the CPU kernels of this process and the workers and servers it starts (they inherit its environment):
    ``avx2`` sets ``KERNEL_ENV["avx2"]`` on an x86-64 machine, overriding what was there (the params describe the
    run), ``native`` leaves the environment alone. On another architecture nothing is set (the caps name x86
    instruction sets). Returns what it set."""
    if choice not in KERNEL_ENV:
        raise ValueError(f"cpu_kernels must be one of {sorted(KERNEL_ENV)}, got {choice!r}")
    environ = os.environ if environ is None else environ
    machine = (machine if machine is not None else platform.machine()).lower()
    if machine not in X86:
        return {}
    environ.update(KERNEL_ENV[choice])
    return dict(KERNEL_ENV[choice])


def cpu_kernels_in_use() -> str | None:
    """The instruction set torch's CPU kernels dispatch to in this process (``AVX2``, ``AVX512``, …), or None when
    torch was never imported here (asking would import it)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old or partial torch: the record goes without it
        return None


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
