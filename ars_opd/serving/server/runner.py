"""What one batch computes, on the bundled server's generation thread: the engine's model side.

The engine (``ars_opd.serving.server.engine``) gathers a batch on the event loop and hands it to its single
worker thread; ``BatchRunner`` is that thread's half of the engine, kept apart so that the queue, admission
and weight loads read on their own. A batch's scoring rows run as one right-padded forward
(``ars_opd.serving.server.scoring``); its generating rows (chat and token-id rows) are left-padded through one
``model.generate`` call, rows differing in temperature, top_p, max_tokens, seed and stop strings:

* sampling is a logits processor, ``ars_opd.serving.server.sampling.RowSampler``: per-row temperature,
  top_p and seeded Gumbel noise, so a seeded request gives the same text alone or batched.
* a stopping criterion called after every decoding step records each row's new token, ends the row at
  EOS, at its request's ``stop_token_ids``, at a stop string or at its ``max_tokens``, and pushes the row's
  progress to its request, which is how streaming sends tokens while they are generated. Token-id rows
  keep each sampled token's raw log-probability (``RowSampler.raw_logprob``).

A fault in a batch answers each of its unfinished rows with 500; the server keeps running.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from transformers import LogitsProcessorList, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from ars_opd.lm.batching import pad_left
from ars_opd.serving.server.admission import Throughput, budget
from ars_opd.serving.server.jobs import Job, Progress, ScoreJob
from ars_opd.serving.server.sampling import RowSampler
from ars_opd.serving.server.scoring import score_rows
from ars_opd.serving.server.stats import ServerStats

log = logging.getLogger(__name__)


class _RowProgress(StoppingCriteria):
    """Called by ``generate`` after every decoding step: advances each row and returns which rows are done."""

    def __init__(self, jobs: Sequence[Job], engine: "BatchRunner", sampler: RowSampler):
        self.jobs, self.engine, self.sampler = jobs, engine, sampler

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()
        self.engine.throughput.step()
        for row, (job, token) in enumerate(zip(self.jobs, last)):
            if job.done:  # generate pads finished rows; nothing to record
                continue
            if self.engine.stopping:
                job.fail(503, "the server is shutting down")
            elif job.cancelled:  # its client has gone: no more steps for nobody
                job.done = True
                self.engine.stats.rows_stopped += 1
            else:
                self.engine.advance(job, token, self.sampler.raw_logprob(row, token))
        return torch.tensor([j.done for j in self.jobs], dtype=torch.bool, device=input_ids.device)


class BatchRunner:
    """The generation thread's half of ``TeacherEngine``: runs a batch's rows on the model and decides each
    row's end. The engine sets the attributes below (the loaded model and tokenizer, its counters, its
    shutdown flag) and calls ``_score_batch`` and ``_generate_batch`` on its worker thread."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    vocab: int
    pad_id: int
    eos_ids: frozenset[int]
    stats: ServerStats
    throughput: Throughput
    stopping: bool
    _token_text: dict[int, str]

    def _generate_batch(self, jobs: list[Job]) -> None:
        stats = self.stats
        stats.generate_calls += 1
        stats.rows_generated += len(jobs)
        stats.largest_batch = max(stats.largest_batch, len(jobs))
        stats.largest_batch_tokens = max(stats.largest_batch_tokens, budget(jobs))
        stats.generating = True
        ids, mask = pad_left([j.prompt_ids for j in jobs], self.pad_id)  # (B, T) each
        sampler = RowSampler(jobs, self.device, self.vocab)
        try:
            with torch.inference_mode():
                # position ids come from the attention mask inside generate, so left padding is invisible
                self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    do_sample=False,
                    max_new_tokens=max(j.max_tokens for j in jobs),
                    logits_processor=LogitsProcessorList([sampler]),
                    stopping_criteria=StoppingCriteriaList([_RowProgress(jobs, self, sampler)]),
                )
        except Exception as e:  # a server fault: every waiting request learns it, the server keeps running
            log.exception("generate failed for a batch of %d", len(jobs))
            for job in jobs:
                if not job.done:
                    job.fail(500, f"generation failed: {type(e).__name__}: {e}")
        finally:
            stats.generating = False
        for job in jobs:
            if not job.done:  # cannot happen unless generate stops early on its own
                job.fail(500, "generation ended before this request's completion was finished")

    def _score_batch(self, jobs: list[ScoreJob]) -> None:
        stats = self.stats
        stats.score_calls += 1
        stats.tokens_scored += sum(len(j.prompt_ids) for j in jobs)
        stats.largest_batch = max(stats.largest_batch, len(jobs))
        try:
            k = max(j.top_k for j in jobs)  # one top-k for the batch; each row keeps its own first k
            with torch.inference_mode():
                rows = score_rows(self.model, [j.prompt_ids for j in jobs], k, self.vocab, self.pad_id)
        except Exception as e:  # a server fault: every waiting request learns it, the server keeps running
            log.exception("scoring failed for a batch of %d", len(jobs))
            for job in jobs:
                job.fail(500, f"scoring failed: {type(e).__name__}: {e}")
            return
        for job, row in zip(jobs, rows):
            row.top_ids, row.top_logprobs = row.top_ids[:, : job.top_k], row.top_logprobs[:, : job.top_k]
            job.done = True
            job.post(row)

    def decode_token(self, token: int) -> str:
        """One token's text (``decoded_token`` of a scoring answer), memoised: the same ids recur constantly."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=True)

    def advance(self, job: Job, token: int, logprob: float | None = None) -> None:
        """Record ``token`` (and its raw ``logprob`` when the job keeps them) for ``job``, decide whether the
        row is finished, and post its progress."""
        job.completion_ids.append(token)
        self.stats.tokens_generated += 1
        if job.logprobs is not None:
            job.logprobs.append(logprob)
        n = len(job.completion_ids)
        stops = token in self.eos_ids or token in job.stop_ids
        finish = "stop" if stops else "length" if n >= job.max_tokens else None
        # decoding every step costs a little; only streams and stop strings need the text before the end
        if finish or job.stream or job.stop:
            text = self.decode(job.completion_ids)
            cut = _first_stop(text, job.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
            if finish or job.stream:
                job.post(Progress(text, n, finish))
        job.done = finish is not None


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None
