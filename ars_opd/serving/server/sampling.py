"""Sampling the rows of one generation batch, each by its own request's parameters.

``RowSampler`` is a logits processor: per-row temperature and nucleus (top_p) filtering plus Gumbel noise
from a per-row ``torch.Generator`` seeded with the request's ``seed`` (random when absent), with
``generate(do_sample=False)`` taking the argmax. argmax(logits / T + Gumbel) is a sample from
softmax(logits / T), and the noise a row sees depends only on its own seed, so a seeded request gives the
same text alone or batched (up to float rounding of the logits). Rows with temperature 0 (or below
``GREEDY_BELOW``) get no noise: greedy.

With ``vocab`` (the tokenizer's size), logits of the embedding rows beyond it (padding) are set to -inf
first, so they are never sampled. Rows whose job keeps ``logprobs`` get the raw log-softmax of those
logits (temperature 1, before top-p, fp32) kept in ``raw_logprobs`` after each call, for the stopping
criterion to read the sampled token's value (``raw_logprob``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from transformers import LogitsProcessor

from ars_opd.serving.server.jobs import Job

GREEDY_BELOW = 1e-5  # temperatures this small are greedy: dividing logits by them overflows (as in vLLM)


class RowSampler(LogitsProcessor):
    """Per-row temperature, top_p and seeded Gumbel noise; ``generate(do_sample=False)`` then takes the argmax."""

    def __init__(self, jobs: Sequence[Job], device: torch.device, vocab: int | None = None):
        self.vocab = vocab
        self.logprob_rows = {
            i: k for k, i in enumerate(i for i, j in enumerate(jobs) if getattr(j, "logprobs", None) is not None)
        }
        self._logprob_index = torch.tensor(list(self.logprob_rows), dtype=torch.long, device=device)
        self.raw_logprobs: torch.Tensor | None = None  # (len(logprob_rows), V) of the last step
        sampled = [i for i, j in enumerate(jobs) if j.temperature >= GREEDY_BELOW]
        self.rows = torch.tensor(sampled, dtype=torch.long, device=device)
        self.temperature = torch.tensor([[jobs[i].temperature] for i in sampled], device=device)  # (R, 1)
        self.top_p = torch.tensor([[jobs[i].top_p] for i in sampled], device=device)  # (R, 1)
        self.use_top_p = any(jobs[i].top_p < 1.0 for i in sampled)
        self.generators = [torch.Generator(device=device).manual_seed(jobs[i].seed) for i in sampled]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.vocab is not None and scores.shape[-1] > self.vocab:
            scores = scores.clone()
            scores[:, self.vocab :] = -math.inf
        if self.logprob_rows:
            self.raw_logprobs = torch.log_softmax(scores[self._logprob_index].float(), dim=-1)
        if not self.generators:
            return scores
        logits = scores[self.rows].float() / self.temperature  # (R, V)
        if self.use_top_p:
            logits = _nucleus(logits, self.top_p)
        # every row draws V uniforms per step from its own generator, whatever its batch-mates do
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=scores.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))  # (R, V)
        out = scores.clone()
        out[self.rows] = (logits + gumbel).to(out.dtype)
        return out

    def raw_logprob(self, row: int, token: int) -> float | None:
        """The last step's raw log-probability of ``token`` in batch row ``row`` (None: not kept for it)."""
        k = self.logprob_rows.get(row)
        return None if k is None or self.raw_logprobs is None else float(self.raw_logprobs[k, token])


def _nucleus(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's smallest set whose probability reaches top_p. (R, V), (R, 1)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p  # mass before a token; the top token always stays
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)
