"""The evaluate stage's two per-token losses over the held-out rows, overall and per row.

- ``reverse_kl_on_own_samples``: KL(q ‖ p) per token between the model q and the teacher p, exact over the
  vocabulary, on the model's own samples (temperature 1, seeded by ``evaluate.seed``): what OPD minimises.
  Its kind in the metrics: ``EXACT``.
- ``reverse_kl_cross_tokenizer``: the same samples when the teacher has a tokenizer of its own
  (``opd.cross_tokenizer``), where no sum over one shared vocabulary exists: the sampled sequence-level
  estimate per student token, (Σ log q(the student's tokens) − Σ log p(the teacher's tokens of the same text))
  / the student's tokens, over the spans both tokenisations share (``ars_opd.lm.token_alignment``). Its kind:
  ``SAMPLED_CROSS_TOKENIZER``.
- ``teacher_nll``: the NLL of the teacher's completions under the model, per token of the ids it is given (in
  cross-tokenizer runs each model's own tokenisation of the teacher's text): what SFT minimises.

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
from ars_opd.lm.batching import build_rollout_batch, cut_at_first_eos, pad_right_with_labels, pad_token_id
from ars_opd.lm.cross_entropy import shifted_targets
from ars_opd.lm.divergences import divergence_terms
from ars_opd.lm.generation import eos_token_ids, generate_token_ids
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.opd_objectives import TeacherLogits
from ars_opd.lm.token_alignment import UNALIGNED, CrossTokenizer, teacher_end_id

EXACT = "exact"  # reverse KL summed over the shared vocabulary at every sampled position
SAMPLED_CROSS_TOKENIZER = "sampled_cross_tokenizer"  # the sampled sequence-level estimate across two tokenizers


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
    unaligned: int = 0  # cross-tokenizer estimate: student tokens left out, beyond the last verified shared boundary

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


def own_samples(model, tokenizer, prompts, cfg: EvaluateConfig) -> tuple[list[list[int]], tuple[int, ...]]:
    """The model's own samples behind reverse KL, and the ids that end them: drawn after
    ``torch.manual_seed(evaluate.seed)`` at temperature 1 with no nucleus cut (softmax(z), nothing else), each
    cut after the first of the model's own EOS ids (its tokenizer's and its generation config's)."""
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
    return samples, eos


@torch.no_grad()
def reverse_kl_on_own_samples(
    model, teacher, tokenizer, prompts, cfg: EvaluateConfig, vocab: int, device: torch.device
) -> TokenLosses:
    samples, eos = own_samples(model, tokenizer, prompts, cfg)
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


@torch.no_grad()
def reverse_kl_cross_tokenizer(
    model,
    teacher,
    tokenizer,
    teacher_tokenizer,
    prompts,
    teacher_prompts,
    cfg: EvaluateConfig,
    vocab: int,
    teacher_vocab: int,
    device: torch.device,
) -> TokenLosses:
    """Reverse KL to a teacher with a tokenizer of its own, estimated on the model's own samples.

    The samples are ``reverse_kl_on_own_samples``' (``own_samples``: the same seed, temperature, nucleus and
    ends). Each sampled completion is decoded to its text and tokenised by the teacher
    (``CrossTokenizer.align``: the teacher's tokens of the text, its end-of-turn id where the student ended),
    scored by the teacher after ``teacher_prompts`` (the same held-out messages in the teacher's own chat
    template) and by the model after ``prompts``. A row's value is

        Σ_k log q(y_k) − Σ_u log p(t_u)

    over the student's tokens y_k and the teacher's tokens t_u that lie in a span both tokenisations share
    (span ``UNALIGNED`` excluded on both sides: text that no verified shared boundary follows), and its count the
    number of student tokens kept. Since the spans cover the same text on both sides, a row's value is log q(text) −
    log p(text) of the aligned text, a one-sample estimate of the sequence-level KL(q ‖ p) of that text: unbiased
    for it in expectation over the samples, but a single row's value (and at few rows the mean) can be negative.
    Not the exact per-token KL over a vocabulary (there is no shared one), so never compared with ``EXACT`` values.

    log q is normalised over the model's ids 0..vocab−1 and log p over the teacher's 0..teacher_vocab−1 (embedding
    rows beyond a tokenizer are padding), each from its model's last hidden states through its head in chunks;
    each row's two sums are float64 sums of the fp32 log-probabilities. ``mean``: the rows' values summed over
    their student tokens (token-weighted, as the exact KL's mean is); ``unaligned``: the student tokens left out.
    """
    samples, eos = own_samples(model, tokenizer, prompts, cfg)
    cross = CrossTokenizer(tokenizer, teacher_tokenizer, eos, teacher_end_id(teacher_tokenizer))
    pad, teacher_pad = pad_token_id(tokenizer), pad_token_id(teacher_tokenizer)
    row_sums: list[float] = []
    row_counts: list[int] = []
    unaligned = 0
    head, teacher_head = OutputHead.of(model, vocab), OutputHead.of(teacher, teacher_vocab)
    for i in range(0, len(prompts), cfg.batch_size):
        rows = slice(i, i + cfg.batch_size)
        kept = [cut_at_first_eos(s, eos)[0] for s in samples[rows]]  # what the rollout batch keeps
        b = build_rollout_batch(prompts[rows], kept, pad, eos)
        targets = b["targets"][b["loss_mask"]]
        if targets.numel() and int(targets.max()) >= vocab:
            raise ValueError(
                f"the model sampled id {int(targets.max())}, beyond its tokenizer's {vocab} ids (an embedding row "
                "that is padding): it has no text for the teacher to score"
            )
        lq = torch.zeros(0, dtype=torch.float32)
        if targets.numel():
            (lq,) = target_logprobs(
                _hidden_rows(model, b, b["loss_mask"], device), head, targets.to(device), chunk_size=cfg.chunk_size
            )
        aligned = [cross.align(c) for c in kept]
        tb = pad_right_with_labels(teacher_prompts[rows], [list(a.teacher_ids) for a in aligned], teacher_pad)
        mask, teacher_targets = shifted_targets(tb["labels"])
        lp = torch.zeros(0, dtype=torch.float32)
        if teacher_targets.numel():
            (lp,) = target_logprobs(
                _hidden_rows(teacher, tb, mask, device),
                teacher_head,
                teacher_targets.to(device),
                chunk_size=cfg.chunk_size,
            )
        lq_rows = lq.double().cpu().split(b["loss_mask"].sum(1).tolist())
        lp_rows = lp.double().cpu().split(mask.sum(1).tolist())
        for a, q_row, p_row in zip(aligned, lq_rows, lp_rows):
            keep_q = torch.tensor([s != UNALIGNED for s in a.alignment.student_span], dtype=torch.bool)
            keep_p = torch.tensor([s != UNALIGNED for s in a.alignment.teacher_span], dtype=torch.bool)
            row_sums.append(float(q_row[keep_q].sum()) - float(p_row[keep_p].sum()))
            row_counts.append(int(keep_q.sum()))
            unaligned += a.alignment.unaligned_student
    n = sum(row_counts)
    return TokenLosses(sum(row_sums) / n if n else float("nan"), row_sums, row_counts, unaligned)
