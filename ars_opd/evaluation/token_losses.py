"""The evaluate stage's two per-token losses over the held-out rows, overall and per row.

- ``reverse_kl_on_own_samples``: KL(q ‖ p) per token between the model q and the teacher p, exact over the
  vocabulary, on the model's own samples (temperature 1, seeded by ``evaluate.seed``): what OPD minimises.
- ``teacher_nll``: the NLL of the teacher's completions under the model: what SFT minimises.

Both come from the models' last hidden states through their output heads one chunk of positions at a time
(``ars_opd.lm.head``). Each returns ``TokenLosses``: the overall per-token mean, computed as the stage always
has (fp32 sums per batch, added in order), and each row's sum and token count, recorded from the same fp32
per-token values as the chunks pass (a ``RowTerms`` wrapper; nothing is computed twice), so that the stage can
report token-weighted means per kind of prompt without changing the overall numbers by a bit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ars_opd.config import EvaluateConfig
from ars_opd.lm.batching import build_rollout_batch, pad_right_with_labels, pad_token_id
from ars_opd.lm.cross_entropy import shifted_targets
from ars_opd.lm.divergences import divergence_terms
from ars_opd.lm.generation import eos_token_ids, generate_token_ids
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.opd_objectives import TeacherLogits


def _hidden_rows(model, batch: dict, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The model's last hidden states at the True positions of ``mask``: (M, H)."""
    hidden = last_hidden_states(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))
    return select_rows(hidden, mask.to(device))


@dataclass
class TokenLosses:
    """A per-token loss over the held-out rows: the overall mean (fp32 batch sums added in order, as the stage has
    always computed it) and each row's sum (float64, of the same fp32 per-token values) and token count, from which
    ``per_task`` takes token-weighted means per kind."""

    mean: float
    row_sums: list[float]
    row_counts: list[int]

    def per_task(self, tasks: list[str | None]) -> dict[str, float | None]:
        """Token-weighted mean per task label (rows without one left out); None for a task with no token."""
        sums: dict[str, list] = defaultdict(lambda: [0.0, 0])
        for t, s, n in zip(tasks, self.row_sums, self.row_counts):
            if t is not None:
                sums[t][0] += s
                sums[t][1] += n
        return {t: (s / n if n else None) for t, (s, n) in sorted(sums.items())}


def _row_sums(values: torch.Tensor, mask: torch.Tensor) -> tuple[list[float], list[int]]:
    """Per batch row: the float64 sum of ``values`` (M,), the entries at ``mask``'s (B, T) True positions in
    row-major order (``select_rows``' order), and how many there are."""
    rows = mask.nonzero()[:, 0].to(values.device)
    sums = torch.zeros(mask.shape[0], dtype=torch.float64, device=values.device)
    sums.index_add_(0, rows, values.double())
    return sums.tolist(), mask.sum(1).tolist()


def _recording(terms, out: torch.Tensor):
    """``terms`` (a ``RowTerms``) that also writes each row's value into ``out`` (M,)."""

    def recorded(z, start, end, need_grad):
        value, dz = terms(z, start, end, need_grad)
        out[start:end] = value
        return value, dz

    return recorded


@torch.no_grad()
def reverse_kl_on_own_samples(
    model, teacher, tokenizer, prompts, cfg: EvaluateConfig, vocab: int, device: torch.device
) -> TokenLosses:
    torch.manual_seed(cfg.seed)
    eos = eos_token_ids(model, tokenizer)  # the model's own ends, in its samples and in the mask alike
    samples = generate_token_ids(
        model,
        tokenizer,
        prompts,
        cfg.max_new_tokens,
        batch_size=cfg.batch_size,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        eos_ids=eos,
    )
    total, n = 0.0, 0
    row_sums: list[float] = []
    row_counts: list[int] = []
    pad = pad_token_id(tokenizer)
    for i in range(0, len(prompts), cfg.batch_size):
        b = build_rollout_batch(prompts[i : i + cfg.batch_size], samples[i : i + cfg.batch_size], pad, eos)
        if not bool(b["loss_mask"].any()):
            row_sums += [0.0] * len(b["lengths"])
            row_counts += [0] * len(b["lengths"])
            continue
        teacher_rows = TeacherLogits(_hidden_rows(teacher, b, b["loss_mask"], device), OutputHead.of(teacher, vocab))
        hidden = _hidden_rows(model, b, b["loss_mask"], device)
        values = torch.empty(hidden.shape[0], dtype=torch.float32, device=device)
        s = chunked_head_loss(
            hidden,
            OutputHead.of(model, vocab),
            _recording(divergence_terms(teacher_rows.rows, beta=1.0), values),
            cfg.chunk_size,
        )
        total += float(s)
        n += int(b["loss_mask"].sum())
        sums, counts = _row_sums(values, b["loss_mask"])
        row_sums += sums
        row_counts += counts
    return TokenLosses(total / n if n else float("nan"), row_sums, row_counts)


@torch.no_grad()
def teacher_nll(
    model, tokenizer, prompts, completions, cfg: EvaluateConfig, vocab: int, device: torch.device
) -> TokenLosses:
    total, n = 0.0, 0
    row_sums: list[float] = []
    row_counts: list[int] = []
    pad = pad_token_id(tokenizer)
    for i in range(0, len(prompts), cfg.batch_size):
        b = pad_right_with_labels(prompts[i : i + cfg.batch_size], completions[i : i + cfg.batch_size], pad)
        mask, targets = shifted_targets(b["labels"])
        (logprobs,) = target_logprobs(
            _hidden_rows(model, b, mask, device),
            OutputHead.of(model, vocab),
            targets.to(device),
            chunk_size=cfg.chunk_size,
        )
        total -= float(logprobs.sum())
        n += int(targets.numel())
        sums, counts = _row_sums(-logprobs, mask)
        row_sums += sums
        row_counts += counts
    return TokenLosses(total / n if n else float("nan"), row_sums, row_counts)
