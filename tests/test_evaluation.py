"""The evaluate stage on micro models: metric structure, an independent exact-match recount, invariants."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from ars_opd.artifacts import read_jsonl, write_jsonl
from ars_opd.config import BaseConfig, load_params
from ars_opd.evaluation.evaluate import evaluate_models
from ars_opd.models.loading import load_model
from ars_opd.models.prepare import prepare_models
from ars_opd.training.budget import write_budget
from micro import teacher_rows, write_micro_params

REPO = Path(__file__).resolve().parents[1]


def _budget(steps: int, flops: float) -> dict:
    """A stand-in model's budget.json: its steps and FLOPs, one token of each kind, no teacher text."""
    return {
        "steps": steps,
        "flops": flops,
        "tokens_trained": 1,
        "tokens_processed": 1,
        "tokens_generated": 0,
        "teacher_tokens": 0,
    }


def _micro_models(tmp_path, monkeypatch):
    """params of the micro config in ``tmp_path`` (the working directory), its models built, the teacher's
    held-out completions written."""
    write_micro_params(REPO, tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    p = load_params("params.yaml")
    prepare_models(
        BaseConfig(threads=1), p.models, p.synthetic, p.paths.models_dir, p.paths.models_metrics, progress=False
    )
    Path(p.paths.teacher_dir).mkdir(parents=True)
    write_jsonl(Path(p.paths.teacher_dir) / "eval.jsonl", teacher_rows(12, seed=9))
    return p


@pytest.mark.slow
def test_evaluate_on_micro_models(tmp_path, monkeypatch):
    p = _micro_models(tmp_path, monkeypatch)
    rows = teacher_rows(12, seed=9)
    # stand-ins: the trained-student directories hold the teacher or the base student
    # budgets: sft 5 steps; both arms continue it to 10 steps (OPD at more FLOPs)
    budgets = {"sft": (5, 1e9), "opd": (10, 3e9), "sft_continued": (10, 2e9)}
    for stage, (steps, flops) in budgets.items():
        model_dir = Path(p.paths.training(stage).model)
        load_model(p.paths.models_dir, "teacher" if stage == "opd" else "student").save_pretrained(model_dir)
        write_budget(
            model_dir,
            _budget(steps, flops),
        )
    snap = Path(p.paths.training("opd").model) / "snapshots" / "step_0000007"  # a learning-curve point: the base
    load_model(p.paths.models_dir, "student").save_pretrained(snap)
    write_budget(snap, _budget(7, 2e9))
    m = evaluate_models(p.evaluate, p.paths)
    assert m["examples"] == 10 and m["checkable_examples"] == 10  # micro config: max_examples 10
    on_disk = json.loads(Path(p.paths.eval_metrics).read_text())
    assert on_disk == json.loads(json.dumps(m))
    answers = read_jsonl(Path(p.paths.eval_dir) / "answers.jsonl")
    refs = {r["id"]: r["reference"] for r in rows}
    for model in ("base", "sft", "opd", "teacher"):
        recount = sum(a[model].strip() == refs[a["id"]] for a in answers) / len(answers)
        assert m[model]["exact_match"] == pytest.approx(recount)
        assert m[model]["teacher_nll"] > 0 and m[model]["reverse_kl"] >= 0
    assert m["teacher"]["reverse_kl"] == 0.0
    # the "opd" stand-in is the teacher itself: its samples are the teacher's, so the KL is ~0. 1e-4 is a
    # separation, not a rounding bound: the exact value is 0 and the fp32 one rounding-sized (a per-token mean
    # of fp32 KLs between two evaluations of one model), while the base student's is above 0.01
    assert m["opd"]["reverse_kl"] < 1e-4 < m["base"]["reverse_kl"]
    # exact: the same weights scored by the same code, the same ops in the same order
    assert m["opd"]["teacher_nll"] == m["teacher"]["teacher_nll"]
    assert [a["teacher"] for a in answers] == [a["opd"] for a in answers]
    # per kind: every task of the held-out rows, for every model; the teacher's reverse KL is 0 on each
    tasks = {r["task"] for r in rows[:10]}
    assert set(m["examples_per_task"]) == tasks and sum(m["examples_per_task"].values()) == 10
    for model in ("base", "sft", "opd", "sft_continued", "teacher"):
        for key in ("exact_match_per_task", "reverse_kl_per_task", "teacher_nll_per_task"):
            assert set(m[model][key]) == tasks, (model, key)
    assert set(m["teacher"]["reverse_kl_per_task"].values()) == {0.0}
    assert max(m["opd"]["reverse_kl_per_task"].values()) < 1e-4 < min(m["base"]["reverse_kl_per_task"].values())
    assert m["opd"]["teacher_nll_per_task"] == m["teacher"]["teacher_nll_per_task"]
    table = (Path(p.paths.eval_dir) / "table.md").read_text()
    assert table.splitlines()[0].startswith("| model | exact match")
    # learning curves: each arm's start (the sft model, distill_init), every snapshot, then the final model,
    # in step order, scored on the curve prompts
    curves = m["curves"]
    assert curves["examples"] == 4 and [c["steps"] for c in curves["opd"]] == [5, 7, 10]
    assert [c["steps"] for c in curves["sft_continued"]] == [5, 10] and len(curves["sft"]) == 1
    assert curves["opd"][0] == curves["sft_continued"][0] == {**curves["sft"][0], "start": True}
    assert curves["opd"][1]["flops"] == 2e9 and curves["opd"][2]["reverse_kl"] < 1e-4  # final: the teacher
    assert curves["opd"][1]["reverse_kl"] > 0.01
    assert m["opd"]["budget"]["flops"] == 3e9
    # the same curves through DVCLive: one TSV per stage and metric, one row per point, against steps
    import csv

    for stage in ("sft", "opd", "sft_continued"):
        for key in ("reverse_kl", "teacher_nll", "flops"):
            tsv = Path(p.paths.eval_live) / "plots" / "metrics" / stage / f"{key}.tsv"
            rows = list(csv.DictReader(tsv.open(), delimiter="\t"))
            # exact: the csv module writes a float's repr, which reads back to the same float
            assert [(int(r["step"]), float(r[key])) for r in rows] == [
                (c["steps"], float(c[key])) for c in curves[stage]
            ], (stage, key)
    assert not list(Path(p.paths.eval_live).glob("*.json"))  # plot files only: the numbers are in the metrics
    # a start elsewhere (a pinned copy, as a study uses) is scored itself: here the teacher stands in for it;
    # a snapshot taken at the final step is the final model and is scored once
    init = Path("data/init")  # paths are relative to the repo root (here tmp_path)
    load_model(p.paths.models_dir, "teacher").save_pretrained(init)
    write_budget(init, _budget(5, 1e9))
    final_snap = Path(p.paths.training("sft_continued").model) / "snapshots" / "step_0000010"
    load_model(p.paths.models_dir, "student").save_pretrained(final_snap)
    write_budget(final_snap, _budget(10, 2e9))
    again = evaluate_models(p.evaluate, dataclasses.replace(p.paths, distill_init=str(init)))["curves"]
    assert again["opd"][0]["reverse_kl"] < 1e-4 < again["sft"][0]["reverse_kl"]
    assert [c["steps"] for c in again["sft_continued"]] == [5, 10]


def _stand_ins(p, opd_role: str = "teacher") -> None:
    """Trained-model directories that hold a built model: sft and the control the base student, opd
    ``opd_role``'s model, with one snapshot (the base student) in opd's."""
    for stage, steps in (("sft", 5), ("opd", 10), ("sft_continued", 10)):
        model_dir = Path(p.paths.training(stage).model)
        load_model(p.paths.models_dir, opd_role if stage == "opd" else "student").save_pretrained(model_dir)
        write_budget(model_dir, _budget(steps, 1e9 * steps))
    snap = Path(p.paths.training("opd").model) / "snapshots" / "step_0000007"
    load_model(p.paths.models_dir, "student").save_pretrained(snap)
    write_budget(snap, _budget(7, 7e9))


def _outputs(p) -> dict:
    """Every file the evaluate stage wrote, by path, as bytes."""
    out = {}
    for root in (p.paths.eval_dir, p.paths.eval_live):
        out.update({str(f): f.read_bytes() for f in sorted(Path(root).rglob("*")) if f.is_file()})
    out[p.paths.eval_metrics] = Path(p.paths.eval_metrics).read_bytes()
    return out


@pytest.mark.slow
def test_stored_scores_give_the_stages_outputs_byte_for_byte(tmp_path, monkeypatch):
    """ARS_OPD_EVAL_CACHE: a rerun reads every score back and writes the same files as scoring afresh; a changed
    model, and only it, is scored again; a changed evaluate section or data misses everything."""
    import ars_opd.evaluation.curves as curves
    import ars_opd.evaluation.evaluate as ev

    p = _micro_models(tmp_path, monkeypatch)
    _stand_ins(p)
    calls = []
    score = ev.score_model
    for scorer in (ev, curves):  # the stage's models and the curves' points
        monkeypatch.setattr(scorer, "score_model", lambda *a, **k: calls.append(1) or score(*a, **k))

    def run(cache: bool) -> tuple[dict, int]:
        if cache:
            monkeypatch.setenv("ARS_OPD_EVAL_CACHE", str(tmp_path / "scores"))
        else:
            monkeypatch.delenv("ARS_OPD_EVAL_CACHE", raising=False)
        calls.clear()
        evaluate_models(p.evaluate, p.paths)
        return _outputs(p), len(calls)

    fresh, n = run(cache=False)
    # 5 models on the held-out prompts; curves: sft's final, opd's snapshot and final, the control's final
    # (the start is sft's final point, reused)
    assert n == 9
    first, n_first = run(cache=True)
    assert n_first == 9 and first == fresh  # nothing stored yet: every score computed, the same files
    assert len(list((tmp_path / "scores").glob("*.json"))) == 9
    again, n_again = run(cache=True)
    assert n_again == 0 and again == fresh  # every score read back: the same bytes
    # opd's final model becomes another model (the base student with one weight matrix halved): its two scores
    # (held-out, curve) are computed again, and the outputs are those of a fresh evaluation of the new state
    other = load_model(p.paths.models_dir, "student")
    with torch.no_grad():
        next(other.parameters()).mul_(0.5)
    other.save_pretrained(p.paths.training("opd").model)
    changed, n_changed = run(cache=True)
    assert n_changed == 2
    assert changed == run(cache=False)[0] and changed != fresh
    # another evaluate section (a sampling seed) shares no key
    p2 = dataclasses.replace(p, evaluate=dataclasses.replace(p.evaluate, seed=p.evaluate.seed + 1))
    monkeypatch.setenv("ARS_OPD_EVAL_CACHE", str(tmp_path / "scores"))
    calls.clear()
    evaluate_models(p2.evaluate, p2.paths)
    assert len(calls) == 9


def test_score_cache_keys_and_a_torn_entry(tmp_path):
    """Keys differ by model, data and teacher flag; a stored entry that does not parse is scored again."""
    from ars_opd.evaluation.score_cache import ScoreCache, dir_sha256

    cache = ScoreCache(tmp_path / "s", {"code": "x"})
    keys = {cache.key(m, d, t) for m in ("a", "b") for d in ("1", "2") for t in (False, True)}
    assert len(keys) == 8
    assert ScoreCache(tmp_path / "s", {"code": "y"}).key("a", "1", False) != cache.key("a", "1", False)
    n = []
    m, texts = cache.score("a", "1", False, lambda: n.append(1) or ({"x": 1.5, "y": None}, ["t"]))
    assert (m, texts, len(n)) == ({"x": 1.5, "y": None}, ["t"], 1)
    assert cache.score("a", "1", False, lambda: n.append(1) or ({}, [])) == ({"x": 1.5, "y": None}, ["t"])
    assert len(n) == 1 and (cache.hits, cache.misses) == (1, 1)
    (tmp_path / "s" / f"{cache.key('a', '1', False)}.json").write_text('{"metrics": {"x"')  # a torn write
    assert cache.score("a", "1", False, lambda: ({"x": 2.0}, ["u"])) == ({"x": 2.0}, ["u"])
    # a directory's hash: every file's name and bytes, its snapshots left out
    d = tmp_path / "m"
    (d / "snapshots" / "step_1").mkdir(parents=True)
    (d / "w.bin").write_bytes(b"ab")
    h = dir_sha256(d)
    (d / "snapshots" / "step_1" / "w.bin").write_bytes(b"zz")
    assert dir_sha256(d) == h
    (d / "w.bin").write_bytes(b"ac")
    assert dir_sha256(d) != h
    (d / "w.bin").write_bytes(b"ab")
    (d / "x.bin").write_bytes(b"")
    assert dir_sha256(d) != h


def test_evaluation_losses_from_hidden_equal_the_logits_formulas(char_tokenizer):
    """Teacher NLL and reverse KL on own samples, from hidden states in chunks, against the logits formulas."""
    import random

    import torch

    from ars_opd.config import EvaluateConfig
    from ars_opd.evaluation.token_losses import reverse_kl_on_own_samples, teacher_nll
    from ars_opd.lm.batching import build_rollout_batch, pad_right_with_labels
    from ars_opd.lm.cross_entropy import causal_lm_token_loss_sum
    from ars_opd.lm.generation import generate_token_ids
    from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
    from ddp_probe import tiny_model
    from oracles import divergence_sum
    from tolerances import chain_bound, decoder_lengths, linear_bound, loss_bound, softmax_length, two_computations

    model, teacher = tiny_model(char_tokenizer, seed=0).eval(), tiny_model(char_tokenizer, seed=1).eval()
    rng = random.Random(0)
    vocab, pad, eos = len(char_tokenizer), char_tokenizer.pad_token_id, char_tokenizer.eos_token_id
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))] for _ in range(7)]
    completions = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 6))] for _ in range(7)]
    cfg = EvaluateConfig(batch_size=3, max_new_tokens=6, seed=4, chunk_size=5)
    cpu = torch.device("cpu")
    with torch.no_grad():
        b = pad_right_with_labels(prompts, completions, pad)
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        s, n = causal_lm_token_loss_sum(logits, b["labels"])
        # two fp32 computations through the decoder at other batch shapes (3 rows, 7 rows): the chain of its
        # forward, the head, the log-softmax and the sum over the tokens, on the mean NLL's size
        nll = s.item() / n.item()
        lengths = decoder_lengths(model.config, b["input_ids"].shape[1]) + [
            model.config.hidden_size,
            softmax_length(vocab, logits.abs().max().item()),
            n.item(),
        ]
        assert abs(
            teacher_nll(model, char_tokenizer, prompts, completions, cfg, vocab, cpu).mean - nll
        ) <= two_computations(chain_bound(lengths, nll))
        torch.manual_seed(cfg.seed)  # the samples the function draws
        samples = generate_token_ids(model, char_tokenizer, prompts, 6, batch_size=3, do_sample=True)
        total, count, bound = 0.0, 0, 0.0
        for i in range(0, 7, 3):
            r = build_rollout_batch(prompts[i : i + 3], samples[i : i + 3], pad, eos)
            kw = {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]}
            v, k = divergence_sum(model(**kw).logits, teacher(**kw).logits, r["loss_mask"])
            total, count = total + v.item(), count + k
            # both paths run the same batches through the same decoder ops: they differ in the heads'
            # products (all positions, or chunks of the scored rows) and the KLs' sums, fp32 each
            z, zb = [], []
            for net in (model, teacher):
                h, head = select_rows(last_hidden_states(net, **kw), r["loss_mask"]), OutputHead.of(net, vocab)
                z.append(torch.nn.functional.linear(h.double(), head.weight.double()))
                zb.append(linear_bound(h, head.weight))
            bound += loss_bound("divergence", z[0], zb[0], z[1], zb[1], beta=1.0)[1].item()
        rkl = reverse_kl_on_own_samples(model, teacher, char_tokenizer, prompts, cfg, vocab, cpu).mean
    assert abs(rkl - total / count) <= two_computations(bound) / count and rkl > 0
