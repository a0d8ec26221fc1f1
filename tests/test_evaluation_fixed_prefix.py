"""The evaluation's length-proof figures: reverse KL at fixed prefixes (the teacher's completions, and their first
sentence), reverse KL per sequence, sampled exact match, and where the own samples end.

Each is checked against an independent computation: full logits of both models on the same batches and the
float64 KL oracle (``oracles.divergence_sum``), a brute-force scan of decoded prefixes for the first sentence, a
recount of per-row sums, and a decode-and-check of the samples drawn under the same seed.
"""

from __future__ import annotations

import random

import pytest
import torch

from ars_opd.config import EvaluateConfig
from ars_opd.data import natural_check
from ars_opd.evaluation.evaluate import HeldOut, sample_ends, sampled_exact_match
from ars_opd.evaluation.token_losses import (
    TeacherTextRows,
    TokenLosses,
    first_sentence_tokens,
    own_samples,
    teacher_text_scores,
)
from ars_opd.lm.batching import pad_right_with_labels
from ars_opd.lm.cross_entropy import shifted_targets
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ddp_probe import tiny_model
from oracles import divergence
from tolerances import linear_bound, loss_bound, two_computations

CPU = torch.device("cpu")


def _first_sentence_by_scan(tokenizer, completion: list[int]) -> int:
    """The oracle: the shortest prefix whose decoded text, stripped, starts with the first sentence followed by its
    end mark (or the whole completion when the text has no end mark before its last character)."""
    text = tokenizer.decode(completion, skip_special_tokens=True)
    sentence = natural_check.first_sentence(text)
    rest = text.strip()[len(sentence) :]
    if not rest or len(rest) == 1:  # no end mark, or the end mark is the text's last character
        return len(completion)
    target = sentence + rest[0]
    for k in range(1, len(completion) + 1):
        if tokenizer.decode(completion[:k], skip_special_tokens=True).lstrip().startswith(target):
            return k
    return len(completion)


@pytest.mark.parametrize(
    "text",
    ["Paris. It is big.", "12.5 is the answer! yes", "one line only", "ends here.", "a\nb", "  lead? then", "x. "],
)
def test_first_sentence_tokens_against_a_prefix_scan(char_tokenizer, text):
    ids = char_tokenizer(text, add_special_tokens=False)["input_ids"] + [char_tokenizer.eos_token_id]
    assert first_sentence_tokens(char_tokenizer, ids) == _first_sentence_by_scan(char_tokenizer, ids)


def test_first_sentence_of_a_one_sentence_answer_is_all_of_it(char_tokenizer):
    """With no sentence end before the last character, every position counts, the EOS's too."""
    ids = char_tokenizer("dcba", add_special_tokens=False)["input_ids"] + [char_tokenizer.eos_token_id]
    assert first_sentence_tokens(char_tokenizer, ids) == len(ids)
    ids = char_tokenizer("It is 7. Then more.", add_special_tokens=False)["input_ids"]
    assert first_sentence_tokens(char_tokenizer, ids) == len("It is 7.")  # one token a character here


def test_fixed_prefix_reverse_kl_against_full_logits(char_tokenizer):
    """The fixed-prefix reverse KL (whole completion and first sentence) and the NLL from one chunked pass, against
    full fp32 logits of both models and the float64 KL oracle, per position; the NLL equals the plain pass's."""
    model, teacher = tiny_model(char_tokenizer, seed=0).eval(), tiny_model(char_tokenizer, seed=1).eval()
    rng = random.Random(3)
    vocab, pad = len(char_tokenizer), char_tokenizer.pad_token_id
    words = ["ab", "cd. ", "e", "f! ", "gh", "\n", "i"]
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 8))] for _ in range(7)]
    completions = [
        char_tokenizer("".join(rng.choice(words) for _ in range(rng.randint(1, 5))), add_special_tokens=False)[
            "input_ids"
        ]
        + [char_tokenizer.eos_token_id]
        for _ in range(7)
    ]
    cfg = EvaluateConfig(batch_size=3, chunk_size=5)
    rows = TeacherTextRows.compute(teacher, char_tokenizer, prompts, completions, cfg, CPU)
    assert rows.first_sentence == [_first_sentence_by_scan(char_tokenizer, c) for c in completions]
    with torch.no_grad():
        got = teacher_text_scores(model, char_tokenizer, prompts, completions, cfg, vocab, CPU, (teacher, rows))
        plain = teacher_text_scores(model, char_tokenizer, prompts, completions, cfg, vocab, CPU)
        per_row: list[torch.Tensor] = []
        bounds: list[torch.Tensor] = []
        for i in range(0, 7, 3):  # the same batches as the stage: the decoders run the same shapes
            b = pad_right_with_labels(prompts[i : i + 3], completions[i : i + 3], pad)
            mask, _ = shifted_targets(b["labels"])
            kw = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
            z, zb = [], []
            for net in (model, teacher):
                h, head = select_rows(last_hidden_states(net, **kw), mask), OutputHead.of(net, vocab)
                z.append(torch.nn.functional.linear(h.double(), head.weight.double()))
                zb.append(linear_bound(h, head.weight))
            values, row_bounds = loss_bound("divergence", z[0], zb[0], z[1], zb[1], beta=1.0, rows=True)
            # the oracle itself, on the float64 logits: torch.distributions' KL of the two categoricals
            exact = divergence(z[0], z[1], 1.0)
            assert torch.allclose(values, exact, rtol=1e-12, atol=1e-12)
            per_row += list(values.split(mask.sum(1).tolist()))
            bounds += list(row_bounds.split(mask.sum(1).tolist()))
    n = sum(v.numel() for v in per_row)
    total = sum(float(v.sum()) for v in per_row)
    bound = sum(float(b.sum()) for b in bounds)
    assert got.reverse_kl.mean == pytest.approx(total / n, abs=two_computations(bound) / n)
    assert got.reverse_kl.mean > 0
    k = rows.first_sentence
    first = sum(float(v[: k[j]].sum()) for j, v in enumerate(per_row))
    first_n = sum(min(k[j], v.numel()) for j, v in enumerate(per_row))
    first_bound = sum(float(b[: k[j]].sum()) for j, b in enumerate(bounds))
    assert first_n < n  # some rows have a sentence end before their last token: the two figures differ
    assert got.reverse_kl_first_sentence.mean == pytest.approx(
        first / first_n, abs=two_computations(first_bound) / first_n
    )
    # the NLL is the pass's own: one forward serves both, and adding the teacher changes no bit of it
    assert got.nll.mean == plain.nll.mean and got.nll.row_sums == plain.nll.row_sums


def test_teacher_text_rows_of_a_prefix_are_the_prefix_of_the_rows(char_tokenizer):
    """The curve points score the first rows of the held-out set: their teacher rows are those rows' (computed
    once), not recomputed at another batch shape."""
    teacher = tiny_model(char_tokenizer, seed=1).eval()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    completions = [[20, 21, 2], [22, 2], [23, 24, 25, 2], [26, 2]]
    rows = TeacherTextRows.compute(teacher, char_tokenizer, prompts, completions, EvaluateConfig(batch_size=2), CPU)
    head = rows.head(3)
    assert len(head.rows) == 3 and all(a is b for a, b in zip(head.rows, rows.rows[:3]))
    assert [r.shape[0] for r in rows.rows] == [len(c) for c in completions]


def test_per_sequence_mean_weighs_rows_alike():
    """Σ per row / rows (rows without tokens left out), against the per-token mean that long rows dominate."""
    t = TokenLosses(mean=(1.0 + 9.0) / 10, row_sums=[1.0, 9.0, 0.0], row_counts=[1, 9, 0])
    assert t.per_sequence == 5.0
    assert TokenLosses(float("nan"), [0.0], [0]).per_sequence != TokenLosses(float("nan"), [0.0], [0]).per_sequence


def test_sample_ends_counts_eos_and_lengths():
    samples = [[5, 6, 2, 9], [5, 6, 7], [2], [5, 3]]  # 2 and 3 end a sample
    ends = sample_ends(samples, (2, 3), max_new_tokens=3)
    assert ends == {"own_eos_rate": 0.75, "own_length": (3 + 3 + 1 + 2) / 4}


def test_sampled_exact_match_is_the_share_of_right_samples_over_draws(char_tokenizer):
    """Decoded samples checked as greedy answers are, averaged over the draws; the draws are the seeded samples
    (the first is the reverse-KL sample, the k-th seeded evaluate.seed + k)."""
    rows = [
        {"task": "reverse", "reference": "cba", "messages": []},
        {"task": "reverse", "reference": "fed", "messages": []},
        {"task": None, "reference": None, "messages": []},  # open-ended: not counted
    ]
    data = HeldOut(rows, [[1], [1], [1]], [[1], [1], [1]], [True, True, False])
    assert sampled_exact_match(data, [["cba", "x", "cba"], ["cba", "fed", "y"]]) == 3 / 4
    model = tiny_model(char_tokenizer, seed=2).eval()
    cfg = EvaluateConfig(max_new_tokens=4, batch_size=2, seed=5)
    prompts = [[5, 6], [7, 8, 9]]
    a, _ = own_samples(model, char_tokenizer, prompts, cfg)
    again, _ = own_samples(model, char_tokenizer, prompts, cfg)
    other, _ = own_samples(model, char_tokenizer, prompts, cfg, 1)
    assert a == again and other != a
