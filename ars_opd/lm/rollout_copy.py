"""Rollouts from a bf16 copy of the student (``opd.rollout_dtype: bf16``), refreshed from the trained weights.

On a CPU with bf16 matrix units (Intel AMX, ``amx_bf16`` in /proc/cpuinfo) sampling in bf16 is about three
times as fast as in fp32 (``reports/rollouts_real_sizes.jsonl``: 341 against 120 tokens/s at B = 32 for the
pruned SmolLM2). Sampling is the largest part of an OPD step on such a machine, and the samples need not be in
the training precision: an inference engine serving the student in bf16 (vLLM's default for fp32 weights) makes
the same trade. ``CastCopy`` keeps one copy of the student in the rollout dtype and, before each use, copies the
trained weights into it (one cast per parameter, no allocation after the first call), so the samples come from the
weights of this step, rounded to bf16. The loss is computed in the training precision as before; only which
tokens are sampled changes. Hence ``check_objective`` refuses it for the losses whose gradient needs samples of
exactly the trained policy (``sampled_token``), and ``check_params`` for a sharded student (FSDP), whose whole
weights no worker holds.
"""

from __future__ import annotations

import copy

import torch

from ars_opd.lm.head import unwrap


class CastCopy:
    """A copy of a model in ``dtype``, made on first use and refreshed from the model at every ``of(model)``."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype
        self.copy: torch.nn.Module | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def of(self, model: torch.nn.Module) -> torch.nn.Module:
        """The copy, holding ``model``'s present weights cast to ``dtype`` (``model`` may be DDP-wrapped)."""
        inner = unwrap(model)
        if self.copy is None:
            self.copy = copy.deepcopy(inner).to(self.dtype).eval().requires_grad_(False)
            # parameters and floating buffers, in the same order in both (deepcopy keeps the structure and the ties)
            src = [*inner.parameters(), *(b for b in inner.buffers() if b.is_floating_point())]
            dst = [*self.copy.parameters(), *(b for b in self.copy.buffers() if b.is_floating_point())]
            if [t.shape for t in src] != [t.shape for t in dst]:
                raise RuntimeError("the rollout copy does not mirror the student's tensors")
            self._pairs = list(zip(dst, src))
            return self.copy
        for dst, src in self._pairs:
            dst.copy_(src)
        return self.copy
