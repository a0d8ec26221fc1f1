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

With several teachers (``teachers.named``) the teacher is a ``RowTeachers`` and each row is measured against its
own (``ars_opd.evaluation.row_teachers``: ``teacher_logits``, ``text_rows``, ``text_logits`` are where these losses
ask a teacher for anything; with one model they do exactly what they did).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ars_opd.config import EvaluateConfig
from ars_opd.data.natural_check import SENTENCE_END
from ars_opd.evaluation.row_teachers import teacher_logits, text_logits, text_rows
from ars_opd.lm.batching import build_rollout_batch, cut_at_first_eos, pad_right_with_labels, pad_token_id
from ars_opd.lm.cross_entropy import shifted_targets
from ars_opd.lm.divergences import divergence_terms
from ars_opd.lm.generation import eos_token_ids, generate_token_ids
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows, target_logprobs
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

    @property
    def per_sequence(self) -> float:
        """The mean over rows of each row's sum (rows with no token left out): a per-sequence figure, in which a
        long row weighs what a short one does and a longer answer cannot lower its mean with extra easy tokens."""
        sums = [s for s, n in zip(self.row_sums, self.row_counts) if n]
        return sum(sums) / len(sums) if sums else float("nan")

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


def own_samples(
    model, tokenizer, prompts, cfg: EvaluateConfig, draw: int = 0
) -> tuple[list[list[int]], tuple[int, ...]]:
    """The model's own samples behind reverse KL, and the ids that end them: drawn after
    ``torch.manual_seed(evaluate.seed)`` at temperature 1 with no nucleus cut (softmax(z), nothing else), each
    cut after the first of the model's own EOS ids (its tokenizer's and its generation config's). ``draw`` k > 0
    gives the k-th further set of samples (seed ``evaluate.seed + k``), for sampled exact match over k draws."""
    torch.manual_seed(cfg.seed + draw)
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
    model,
    teacher,
    tokenizer,
    prompts,
    cfg: EvaluateConfig,
    vocab: int,
    device: torch.device,
    drawn: tuple[list[list[int]], tuple[int, ...]] | None = None,
) -> TokenLosses:
    """``drawn``: the model's own samples and their ends (``own_samples``), when the caller drew them already."""
    samples, eos = drawn if drawn is not None else own_samples(model, tokenizer, prompts, cfg)
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
        teacher_rows = teacher_logits(teacher, b, b["loss_mask"], device, vocab, i)  # each row's own teacher's
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
    return teacher_text_scores(model, tokenizer, prompts, completions, cfg, vocab, device).nll


@dataclass
class TeacherTextScores:
    """What one pass of a model over the teacher's completions gives: the NLL of the teacher's tokens and, when the
    teacher's hidden rows at the same positions are given (``TeacherTextRows``), the exact reverse KL(q ‖ p) per
    token at those fixed prefixes, over the whole completion and over its first sentence alone."""

    nll: TokenLosses
    reverse_kl: TokenLosses | None = None
    reverse_kl_first_sentence: TokenLosses | None = None


class TeacherTextRows:
    """The teacher's last hidden states at every scored position of the teacher's completions (the positions
    ``teacher_nll`` scores), computed once and handed to every model's pass: a student's fixed-prefix reverse KL
    then costs its own forward (shared with its NLL) and one more head product per chunk, not a teacher forward.

    ``rows[i]``: (n_i, H_T) for held-out row i, on the device they were computed on; ``first_sentence[i]``: how many
    of row i's n_i positions predict a token of the completion's first sentence (``first_sentence_tokens``)."""

    def __init__(self, rows: list[torch.Tensor], first_sentence: list[int]):
        self.rows, self.first_sentence = rows, first_sentence

    def head(self, n: int) -> "TeacherTextRows":
        return TeacherTextRows(self.rows[:n], self.first_sentence[:n])

    @classmethod
    @torch.no_grad()
    def compute(
        cls, teacher, tokenizer, prompts, completions, cfg: EvaluateConfig, device: torch.device
    ) -> "TeacherTextRows":
        pad = pad_token_id(tokenizer)
        rows: list[torch.Tensor] = []
        for i in range(0, len(prompts), cfg.batch_size):
            b = pad_right_with_labels(prompts[i : i + cfg.batch_size], completions[i : i + cfg.batch_size], pad)
            mask, _ = shifted_targets(b["labels"])
            rows += text_rows(teacher, b, mask, device, i)  # each row's own teacher's
        return cls(rows, [first_sentence_tokens(tokenizer, c) for c in completions])


def first_sentence_tokens(tokenizer, completion: list[int]) -> int:
    """How many leading tokens of ``completion`` it takes to write its first sentence, its end mark included (the
    rule of ``ars_opd.data.natural_check.first_sentence``: up to the first line break, or the first ``.``, ``!`` or
    ``?`` followed by white space or the end); the whole completion (its EOS too) when the text has no sentence
    end before its last character. The fewest tokens whose decoded text reaches that character (binary search
    over prefixes: decoding is monotone in length for the tokenizers here)."""
    text = tokenizer.decode(completion, skip_special_tokens=True)
    lead = len(text) - len(text.lstrip())
    m = SENTENCE_END.search(text.strip())
    if m is None or lead + m.start() + 1 >= len(text.rstrip()):
        return len(completion)
    need = lead + m.start() + 1  # characters through the end mark
    lo, hi = 1, len(completion)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(completion[:mid], skip_special_tokens=True)) >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _nll_and_reverse_kl(targets: torch.Tensor, teacher_rows, nll_out: torch.Tensor, rkl_out: torch.Tensor):
    """``RowTerms`` (no gradient) that write each row's −log q(target) into ``nll_out`` and KL(q ‖ p) into
    ``rkl_out`` from one head product of the student; ``teacher_rows(start, end)``: the teacher's fp32 logits."""
    rkl = divergence_terms(teacher_rows, beta=1.0)

    def terms(z: torch.Tensor, start: int, end: int, need_grad: bool):
        nll_out[start:end] = torch.logsumexp(z, -1) - z.gather(-1, targets[start:end, None]).squeeze(-1)
        value, _ = rkl(z, start, end, False)  # overwrites z
        rkl_out[start:end] = value
        return value, None

    return terms


@torch.no_grad()
def teacher_text_scores(
    model,
    tokenizer,
    prompts,
    completions,
    cfg: EvaluateConfig,
    vocab: int,
    device: torch.device,
    teacher: tuple[torch.nn.Module, TeacherTextRows] | None = None,
) -> TeacherTextScores:
    """The model's NLL of the teacher's completions and, with ``teacher`` (the teacher model and its hidden rows on
    the same text), the reverse KL to the teacher at those fixed prefixes, from one forward of the model.

    The fixed-prefix reverse KL is what on-policy distillation minimises, measured on text no model under test
    chose: unlike the reverse KL on a model's own samples, it cannot fall because a model writes long, easy tails
    (a never-ending sample adds cheap low-divergence tokens to its own per-token mean). Per token, over all the
    completion's positions and over its first sentence's (``TeacherTextRows.first_sentence``), where the
    natural prompts' answers are checked."""
    nll_total, rkl_total, n = 0.0, 0.0, 0
    nll_sums: list[float] = []
    counts: list[int] = []
    rkl_sums: list[float] = []
    first_sums: list[float] = []
    first_counts: list[int] = []
    pad = pad_token_id(tokenizer)
    for i in range(0, len(prompts), cfg.batch_size):
        b = pad_right_with_labels(prompts[i : i + cfg.batch_size], completions[i : i + cfg.batch_size], pad)
        mask, targets = shifted_targets(b["labels"])
        hidden = _hidden_rows(model, b, mask, device)
        head = OutputHead.of(model, vocab)
        head = OutputHead(head.weight.detach(), None if head.bias is None else head.bias.detach())  # a measurement
        if teacher is None:
            (logprobs,) = target_logprobs(hidden, head, targets.to(device), chunk_size=cfg.chunk_size)
            nll = -logprobs
        else:
            t_model, t_rows = teacher
            nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=device)
            rkl = torch.empty_like(nll)
            logits = text_logits(t_model, t_rows.rows[i : i + cfg.batch_size], i, device, vocab)
            s = chunked_head_loss(
                hidden, head, _nll_and_reverse_kl(targets.to(device), logits.rows, nll, rkl), cfg.chunk_size
            )
            rkl_total += float(s)
            sums, _ = _row_sums(rkl, mask)
            rkl_sums += sums
            for row, k in zip(
                rkl.double().cpu().split(mask.sum(1).tolist()), t_rows.first_sentence[i : i + cfg.batch_size]
            ):
                k = min(k, row.numel())
                first_sums.append(float(row[:k].sum()))
                first_counts.append(k)
        nll_total += float(nll.sum())
        n += int(targets.numel())
        sums, cnt = _row_sums(nll, mask)
        nll_sums += sums
        counts += cnt
    out = TeacherTextScores(TokenLosses(nll_total / n if n else float("nan"), nll_sums, counts))
    if teacher is not None:
        out.reverse_kl = TokenLosses(rkl_total / n if n else float("nan"), rkl_sums, counts)
        m = sum(first_counts)
        out.reverse_kl_first_sentence = TokenLosses(
            sum(first_sums) / m if m else float("nan"), first_sums, first_counts
        )
    return out


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
    drawn: tuple[list[list[int]], tuple[int, ...]] | None = None,
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
    samples, eos = drawn if drawn is not None else own_samples(model, tokenizer, prompts, cfg)
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
