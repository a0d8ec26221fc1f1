"""The evaluate stage per kind of prompt: reverse KL and teacher NLL per row and per kind against a float64
oracle computed one row at a time, the overall means exactly as before, natural kinds checked by their rule,
open kinds never scored right or wrong, and the per-kind table."""

from __future__ import annotations

import random

import pytest
import torch

from ars_opd.config import ConfigError, EvaluateConfig
from ars_opd.data.prompts import alpaca_messages, encode_completions, encode_prompts, encode_teacher_completions
from ars_opd.evaluation import evaluate as ev
from ars_opd.evaluation import scoring
from ars_opd.evaluation.tables import OPEN, render_table
from ars_opd.evaluation.token_losses import TokenLosses, reverse_kl_on_own_samples, teacher_nll
from ars_opd.lm.batching import build_rollout_batch, pad_right_with_labels
from ars_opd.lm.cross_entropy import shifted_targets
from ars_opd.lm.divergences import divergence_terms
from ars_opd.lm.generation import eos_token_ids, generate_token_ids
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.opd_objectives import TeacherLogits
from ddp_probe import tiny_model

CPU = torch.device("cpu")
TASKS = ["a", "b", "a", None, "b", "c", "a"]


def _log_softmax64(model, ids: list[int]) -> torch.Tensor:
    """Full-vocabulary log-probabilities of one unpadded row, in float64: (T, V)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def _oracle_means(sums: list[float], counts: list[int]) -> dict:
    out = {}
    for t in sorted({t for t in TASKS if t is not None}):
        rows = [i for i, x in enumerate(TASKS) if x == t]
        out[t] = sum(sums[i] for i in rows) / sum(counts[i] for i in rows)
    return out


def test_per_row_and_per_kind_losses_against_a_float64_oracle_and_the_overall_mean_unchanged(char_tokenizer):
    tok = char_tokenizer
    model, teacher = tiny_model(tok, seed=0).eval(), tiny_model(tok, seed=1).eval()
    rng = random.Random(0)
    vocab, pad = len(tok), tok.pad_token_id
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))] for _ in range(len(TASKS))]
    completions = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 6))] for _ in range(len(TASKS))]
    cfg = EvaluateConfig(batch_size=3, max_new_tokens=6, seed=4, chunk_size=5)

    rkl = reverse_kl_on_own_samples(model, teacher, tok, prompts, cfg, vocab, CPU)
    nll = teacher_nll(model, tok, prompts, completions, cfg, vocab, CPU)

    # the samples the function drew, then each row alone through full-vocabulary float64 log-softmaxes
    eos = eos_token_ids(model, tok)
    torch.manual_seed(cfg.seed)
    samples = generate_token_ids(model, tok, prompts, 6, batch_size=3, do_sample=True, eos_ids=eos)
    kl_sums, kl_counts, nll_sums, nll_counts = [], [], [], []
    for p, s, c in zip(prompts, samples, completions):
        b = build_rollout_batch([p], [s], pad, eos)
        n = int(b["lengths"][0]) + len(p)
        lq, lp = (
            _log_softmax64(model, b["input_ids"][0, :n].tolist()),
            _log_softmax64(teacher, b["input_ids"][0, :n].tolist()),
        )
        m = b["loss_mask"][0, :n]
        kl_sums.append(float((lq.exp() * (lq - lp)).sum(-1)[m].sum()))
        kl_counts.append(int(m.sum()))
        ids = p + c
        lq = _log_softmax64(model, ids)
        nll_sums.append(-float(lq[torch.arange(len(p) - 1, len(ids) - 1), torch.tensor(c)].sum()))
        nll_counts.append(len(c))
    assert rkl.row_counts == kl_counts and nll.row_counts == nll_counts
    # fp32 forwards of padded batches against float64 ones of single rows, on a 1-layer model with small logits
    assert rkl.row_sums == pytest.approx(kl_sums, rel=1e-5, abs=1e-5)
    assert nll.row_sums == pytest.approx(nll_sums, rel=1e-5, abs=1e-5)
    per_kind_kl, per_kind_nll = rkl.per_task(TASKS), nll.per_task(TASKS)
    assert list(per_kind_kl) == ["a", "b", "c"]  # the row without a kind is in the overall mean only
    assert per_kind_kl == pytest.approx(_oracle_means(kl_sums, kl_counts), rel=1e-5)
    assert per_kind_nll == pytest.approx(_oracle_means(nll_sums, nll_counts), rel=1e-5)
    assert rkl.mean == pytest.approx(sum(kl_sums) / sum(kl_counts), rel=1e-5)

    # the overall means bit for bit as the stage computed them before rows were recorded: fp32 batch sums added
    # in order, no recording
    total, n = 0.0, 0
    total_nll, n_nll = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(TASKS), 3):
            b = build_rollout_batch(prompts[i : i + 3], samples[i : i + 3], pad, eos)
            kw = (b["input_ids"], b["attention_mask"])
            t_rows = TeacherLogits(
                select_rows(last_hidden_states(teacher, *kw), b["loss_mask"]), OutputHead.of(teacher, vocab)
            )
            total += float(
                chunked_head_loss(
                    select_rows(last_hidden_states(model, *kw), b["loss_mask"]),
                    OutputHead.of(model, vocab),
                    divergence_terms(t_rows.rows, beta=1.0),
                    5,
                )
            )
            n += int(b["loss_mask"].sum())
            b = pad_right_with_labels(prompts[i : i + 3], completions[i : i + 3], pad)
            mask, targets = shifted_targets(b["labels"])
            hidden = select_rows(last_hidden_states(model, b["input_ids"], b["attention_mask"]), mask)
            (lp,) = target_logprobs(hidden, OutputHead.of(model, vocab), targets, chunk_size=5)
            total_nll -= float(lp.sum())
            n_nll += int(targets.numel())
    assert rkl.mean == total / n and nll.mean == total_nll / n_nll


def test_token_losses_per_task():
    losses = TokenLosses(0.0, [1.0, 2.0, 3.0, 4.0], [1, 3, 0, 2])
    assert losses.per_task(["x", "y", "z", "x"]) == {"x": 5.0 / 3, "y": 2.0 / 3, "z": None}
    assert losses.per_task([None] * 4) == {}


def _rows(tok) -> list[dict]:
    """Held-out rows: natural checkable (one answered right, one wrong), natural open, synthetic."""
    rows = [
        {"task": "nl_capital", "q": "What is the capital of France?", "reference": "Paris"},
        {"task": "nl_sum", "q": "What is 7 + 5? Answer with just the number.", "reference": "12"},
        {"task": "nl_poem", "q": "Write a short poem about the sea.", "reference": None},
        {"task": "nl_poem", "q": "Write a short poem about the moon.", "reference": None},
    ]
    rows = [{"messages": [{"role": "user", "content": r.pop("q")}], **r} for r in rows]
    rows.append({"task": "add", "messages": alpaca_messages("Add the two numbers.", "7 + 5"), "reference": "12"})
    for i, r in enumerate(rows):
        r.update(id=str(i), completion="a b", finish_reason="stop")
    return rows


ANSWERS = ["The capital of France is Paris.", "7 + 5 = 13", "Paris", "The sea is blue.", "12"]


def test_natural_kinds_are_checked_by_their_rule_and_open_kinds_are_neither_right_nor_wrong(
    char_tokenizer, monkeypatch
):
    tok = char_tokenizer
    model, teacher = tiny_model(tok, seed=0).eval(), tiny_model(tok, seed=1).eval()
    rows = _rows(tok)
    data = ev.HeldOut(
        rows,
        encode_prompts(tok, [r["messages"] for r in rows]),
        encode_teacher_completions(tok, rows),
        [ev.is_checkable(r) for r in rows],
    )
    assert data.checkable == [True, True, False, False, True]
    # the greedy answers, written by hand (an open row's answer "Paris" is not scored at all)
    monkeypatch.setattr(scoring, "generate_token_ids", lambda *a, **k: encode_completions(tok, ANSWERS))
    cfg = EvaluateConfig(batch_size=2, max_new_tokens=8, seed=0, chunk_size=4)
    m, texts = ev.score_model(model, teacher, tok, data, cfg, len(tok), CPU)
    assert texts == ANSWERS
    assert m["exact_match"] == pytest.approx(2 / 3)  # 3 checkable rows: Paris right, 13 wrong, add right
    assert m["exact_match_per_task"] == {"add": 1.0, "nl_capital": 1.0, "nl_sum": 0.0}
    for key in ("reverse_kl_per_task", "teacher_nll_per_task"):
        assert list(m[key]) == ["add", "nl_capital", "nl_poem", "nl_sum"]
        assert all(v > 0 for v in m[key].values())
    t, _ = ev.score_model(teacher, teacher, tok, data, cfg, len(tok), CPU, is_teacher=True)
    assert t["reverse_kl"] == 0.0 and t["reverse_kl_per_task"] == dict.fromkeys(m["reverse_kl_per_task"], 0.0)

    metrics = {
        "examples": 5,
        "checkable_examples": 3,
        "examples_per_task": {"add": 1, "nl_capital": 1, "nl_poem": 2, "nl_sum": 1},
        "base": m,
        "teacher": t,
    }
    table = render_table(metrics)
    assert table.splitlines()[0].startswith("| model | exact match (checkable rows only) |")
    assert "the 3 checkable rows of the 5 held out" in table
    em, rkl, nll = (
        table.split(title)[1].split("\n\n")[1].splitlines()
        for title in ("Exact match:", "Reverse KL to teacher (per token):", "NLL of teacher completions (per token):")
    )
    assert em[0] == "| kind | n | base | teacher |"
    assert f"| nl_poem | 2 | {OPEN} | {OPEN} |" in em  # open: no exact match for any model
    assert "| nl_capital | 1 | 100.0% | " in "\n".join(em) and "| nl_sum | 1 | 0.0% | " in "\n".join(em)
    poem = next(line for line in rkl if line.startswith("| nl_poem |"))
    assert poem == f"| nl_poem | 2 | {m['reverse_kl_per_task']['nl_poem']:.4f} | 0.0000 |"
    assert any(line.startswith("| nl_poem | 2 | ") and OPEN not in line for line in nll)
    # the figures length cannot game: a table of their own, every model that has them, as the evaluation gave them
    proof = table.split("What a change of answer length cannot game")[1].split("\n\n")[1].splitlines()
    header = [c.strip() for c in proof[0].strip("|").split("|")]
    row = next(line for line in proof if line.startswith("| base |"))
    cells = dict(zip(header, [c.strip() for c in row.strip("|").split("|")]))
    prefix = m.get("reverse_kl_fixed_prefix")
    assert cells["reverse KL at the teacher's prefixes (per token)"] == ("n/a" if prefix is None else f"{prefix:.4g}")
    assert cells["reverse KL on own samples (per sequence)"] == f"{m['reverse_kl_per_sequence']:.4g}"
    assert cells["exact match, sampled at temperature 1"] == f"{m['exact_match_sampled']:.1%}"
    assert cells["own samples that end (EOS)"] == f"{m['own_eos_rate']:.1%}"
    assert "What a change of answer length" not in render_table({"base": {"reverse_kl": 1.0, "teacher_nll": 1.0}})


def test_answer_room_for_natural_kinds_is_the_bare_reference(char_tokenizer):
    tok = char_tokenizer
    rows = [
        {"task": "nl_capital", "reference": "New Delhi", "messages": []},
        {"task": "nl_poem", "reference": None, "messages": []},
        {"task": "elsewhere", "reference": "a reference no rule checks, however long it is", "messages": []},
        {"task": "add", "reference": "12", "messages": []},
    ]
    need = len(encode_completions(tok, ["New Delhi"], add_eos=False)[0])  # no EOS: it need not end the answer
    ev.check_answer_room(tok, rows, need)
    with pytest.raises(ConfigError, match="task nl_capital"):
        ev.check_answer_room(tok, rows, need - 1)
    synthetic_need = len(encode_completions(tok, ["12"])[0])  # a synthetic reference with its EOS
    ev.check_answer_room(tok, rows[1:], synthetic_need)
    with pytest.raises(ConfigError, match="with its EOS, task add"):
        ev.check_answer_room(tok, rows[1:], synthetic_need - 1)
