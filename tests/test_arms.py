"""OPD and its control arm at equal budget: same start, same prompts, same steps; budgets that add up."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from ars_opd.artifacts import read_jsonl
from ars_opd.config import OPDConfig, SFTConfig, load_params
from ars_opd.evaluation.distillation import collect, render_study
from ars_opd.evaluation.equal_budget import budget_note, compare, headline, interpolate, regime_note
from ars_opd.models.loading import load_model, sha256_of_files
from ars_opd.training.budget import matmul_parameters, read_budget, write_budget
from ars_opd.training.opd.stage import run_opd
from ars_opd.training.sft import continued_sft_config, run_sft_continued
from ars_opd.training.worker import TrainingJob
from micro import distill_workspace

REPO = Path(__file__).resolve().parents[1]


def test_the_control_arm_runs_opds_loop_with_sfts_data_budgets():
    sft = SFTConfig(steps=1000, lr=3e-3, max_completion_tokens=33, packing=True, pack_length=600)
    opd = OPDConfig(
        steps=300,
        lr=1e-3,
        warmup_steps=7,
        global_batch_size=48,
        micro_batch_size=12,
        max_grad_norm=None,
        snapshot_every=25,
    )
    cfg = continued_sft_config(sft, opd)
    assert (
        cfg.steps,
        cfg.lr,
        cfg.warmup_steps,
        cfg.global_batch_size,
        cfg.micro_batch_size,
        cfg.max_grad_norm,
        cfg.snapshot_every,
    ) == (300, 1e-3, 7, 48, 12, None, 25)
    assert (cfg.max_completion_tokens, cfg.packing, cfg.pack_length) == (33, True, 600)


def test_matmul_parameters_counts_an_untied_embedding_out():
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    tied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    untied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    n_tied = sum(p.numel() for p in tied.parameters())  # the shared matrix once: the output projection
    assert matmul_parameters(tied) == n_tied
    assert matmul_parameters(untied) == sum(p.numel() for p in untied.parameters()) - 50 * 16


@pytest.mark.slow
@pytest.mark.ddp
def test_arms_start_from_the_same_student_and_their_budgets_add_up(tmp_path):
    distill_workspace(
        REPO,
        tmp_path,
        {"steps": 4, "global_batch_size": 8, "micro_batch_size": 4, "snapshot_every": 2, "max_new_tokens": 5},
        workers=2,
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        p = load_params("params.yaml")
        init = Path(p.paths.distill_init)  # the sft model: the base student stands in for it
        start = {
            "steps": 100,
            "flops": 5e9,
            "tokens_trained": 700,
            "tokens_processed": 900,
            "tokens_generated": 0,
            "teacher_tokens": 300,
        }
        write_budget(init, start)
        init_sha = sha256_of_files(init)
        run_opd(TrainingJob.from_params("opd", p, progress=False))
        run_sft_continued(TrainingJob.from_params("sft_continued", p, progress=False))
        logs = {arm: read_jsonl(p.paths.training(arm).steps) for arm in ("opd", "sft_continued")}
        manifests = {
            arm: json.loads(Path(p.paths.training(arm).manifest).read_text()) for arm in ("opd", "sft_continued")
        }
        models = {arm: tmp_path / p.paths.training(arm).model for arm in ("opd", "sft_continued")}
        teacher = load_model(p.paths.models_dir, "teacher")
        student = load_model(p.paths.models_dir, "student")
    finally:
        os.chdir(cwd)
    # same number of optimiser steps, same prompts (every row kept by both), both from the same weights
    assert [r["step"] for r in logs["opd"]] == [r["step"] for r in logs["sft_continued"]] == [0, 1, 2, 3]
    assert manifests["opd"]["data"]["kept"] == manifests["sft_continued"]["data"]["kept"] == 64
    assert manifests["opd"]["geometry"] == manifests["sft_continued"]["geometry"]
    assert manifests["opd"]["inputs"]["init"] == manifests["sft_continued"]["inputs"]["init"] == init_sha
    assert manifests["opd"]["inputs"]["data"] == manifests["sft_continued"]["inputs"]["data"]
    assert sha256_of_files(tmp_path / p.paths.distill_init) == init_sha  # neither arm trained it in place
    for arm, rows in logs.items():
        budget = read_budget(models[arm])
        # the counters add up: the totals are the starting model's plus the sum over the logged steps
        assert budget["steps"] == start["steps"] + len(rows)
        assert budget["tokens_trained"] == start["tokens_trained"] + sum(r["tokens"] for r in rows)
        assert budget["tokens_trained"] == start["tokens_trained"] + sum(r["budget/tokens_trained"] for r in rows)
        assert budget["flops"] == pytest.approx(start["flops"] + sum(r["budget/flops"] for r in rows))
        assert rows[-1]["budget/flops_total"] == pytest.approx(budget["flops"])
        # the teacher's text: OPD and the repeating control train on rows the sft stage paid for, nothing new
        assert budget["teacher_tokens"] == start["teacher_tokens"]
        assert all(r["budget/teacher_tokens"] == 0 for r in rows)
        # learning-curve snapshots every 2 steps, each with the budget at that point
        snaps = sorted((models[arm] / "snapshots").glob("step_*"))
        assert [s.name for s in snaps] == ["step_0000002", "step_0000004"]
        assert read_budget(snaps[0])["steps"] == start["steps"] + 2
        assert read_budget(snaps[1]) == budget
    # the FLOPs model: the control does 6 P_s per processed token; OPD adds 2 P_t per scored token and the
    # rollouts' 2 P_s per prompt and generated token
    ps, pt = matmul_parameters(student), matmul_parameters(teacher)
    for r in logs["sft_continued"]:
        assert r["budget/flops"] == pytest.approx(6 * ps * r["budget/tokens_processed"])
        assert r["budget/tokens_generated"] == 0
    for r in logs["opd"]:
        scored = r["budget/tokens_processed"]
        assert r["budget/tokens_generated"] > 0
        assert r["budget/flops"] > (6 * ps + 2 * pt) * scored + 2 * ps * r["budget/tokens_generated"]
    assert sum(r["budget/flops"] for r in logs["opd"]) > 1.5 * sum(r["budget/flops"] for r in logs["sft_continued"])


def _curve(steps, flops, rkl, em):
    return [
        {"steps": s, "flops": f, "reverse_kl": r, "exact_match": e, "teacher_nll": 1.0}
        for s, f, r, e in zip(steps, flops, rkl, em)
    ]


def _evaluate(opd_rkl, ctl_rkl, opd_em=0.6, ctl_em=0.6):
    return {
        "opd": {
            "reverse_kl": opd_rkl,
            "exact_match": opd_em,
            "teacher_nll": 0.5,
            "budget": {"steps": 1300, "flops": 3e12, "tokens_generated": 9000},
        },
        "sft_continued": {
            "reverse_kl": ctl_rkl,
            "exact_match": ctl_em,
            "teacher_nll": 0.4,
            "budget": {"steps": 1300, "flops": 2e12, "tokens_generated": 0},
        },
        "curves": {
            "opd": _curve([1000, 1150, 1300], [1e12, 2e12, 3e12], [2.0, 1.5, opd_rkl], [0.5, 0.55, opd_em]),
            "sft_continued": _curve([1000, 1150, 1300], [1e12, 1.5e12, 2e12], [2.0, 1.8, ctl_rkl], [0.5, 0.55, ctl_em]),
            "sft": _curve([0, 1000], [0, 1e12], [9.0, 2.0], [0.0, 0.5]),
        },
    }


def test_interpolation_and_the_equal_budget_comparison():
    curve = _curve([0, 10], [0.0, 100.0], [4.0, 2.0], [0.0, 1.0])
    assert interpolate(curve, "flops", 25.0, "reverse_kl") == 3.5
    assert math.isnan(interpolate(curve, "flops", 200.0, "reverse_kl"))
    cmp = compare(_evaluate(1.0, 1.2))
    assert cmp["equal_steps"]["opd"]["reverse_kl"] == 1.0 and cmp["equal_steps"]["opd"]["flops"] == 3e12
    # equal FLOPs: the cheaper arm's total (2e12); OPD's curve read there (its 1,150-step point)
    assert cmp["equal_flops"]["flops"] == 2e12
    assert cmp["equal_flops"]["opd"]["reverse_kl"] == 1.5 and cmp["equal_flops"]["sft_continued"]["reverse_kl"] == 1.2
    text = "\n".join(headline(cmp))
    assert "at equal steps, OPD's reverse KL to the teacher is **lower**" in text
    assert "at equal FLOPs, OPD's reverse KL to the teacher is **not lower**" in text
    # it lost at equal FLOPs: the regime it is expected to win in
    assert "Where OPD is expected to win" in "\n".join(regime_note(cmp))
    # OPD ahead at both budgets (reverse KL and exact match): no regime paragraph
    ahead = compare(_evaluate(0.5, 2.0, opd_em=0.7, ctl_em=0.5))
    assert ahead["equal_flops"]["opd"]["reverse_kl"] == 1.5 < ahead["equal_flops"]["sft_continued"]["reverse_kl"]
    assert regime_note(ahead) == []
    assert compare({"opd": {"reverse_kl": 1.0}}) is None


def test_the_budget_note_states_the_budget_and_whether_the_curves_still_fall():
    ev = {**_evaluate(1.0, 1.2), "teacher": {"exact_match": 0.95}}
    text = " ".join(budget_note(ev))
    assert "had 1000 steps; each arm adds 300." in text
    assert "95.0% against the arms' 60.0% and 60.0%, so neither student is near the ceiling" in text
    assert "OPD's reverse KL was still falling over its last 150 steps (1.5 → 1 on the curve prompts)" in text
    flat = {
        **ev,
        "curves": {**ev["curves"], "sft_continued": _curve([1000, 1300], [1e12, 2e12], [1.0, 1.2], [0.5, 0.6])},
    }
    assert "continued SFT (control)'s reverse KL was flat or rising over its last 300 steps" in " ".join(
        budget_note(flat)
    )


def _show(evals: list[tuple[int, dict]], others: list[tuple[int, dict, dict]] = (), base_params: dict | None = None):
    def rev(name, seed, ev, extra=None, params=None):
        ddp = {"seed": seed, **(extra or {})}
        return {
            "rev": name,
            "name": name,
            "data": {
                "params": {"params.yaml": {"data": {"ddp": ddp, **(params or {})}}},
                "metrics": {"data/metrics/evaluate.json": {"data": ev}},
            },
        }

    base = rev("workspace", 0, evals[0][1], params=base_params)
    base["experiments"] = [{"name": f"s{s}", "revs": [rev(f"s{s}", s, ev)]} for s, ev in evals[1:]]
    base["experiments"] += [{"name": f"o{s}", "revs": [rev(f"o{s}", s, ev, extra)]} for s, ev, extra in others]
    return [base]


def test_the_seed_study_pairs_differences_by_seed_and_states_a_verdict():
    rng = np.random.default_rng(0)
    evals = [(s, _evaluate(1.0 + rng.normal(0, 0.02), 1.3 + rng.normal(0, 0.02))) for s in range(4)]
    # the same seeds under another seed scenario or with a fault injected are other experiments: not counted
    noise = _evaluate(9.0, 0.1)
    runs = collect(_show(evals, [(1, noise, {"scenario": "S1-3"}), (2, noise, {"inject": {"kind": "shard_skew"}})]))
    assert [r["seed"] for r in runs] == [0, 1, 2, 3]
    assert all(r["evaluate"] is not noise for r in runs)
    # a baseline run with another configuration (more steps) is not a seed of the experiments' study
    assert [r["seed"] for r in collect(_show(evals, base_params={"opd": {"steps": 300}}))] == [1, 2, 3]
    text, summary = render_study(runs, "cmds", {"steps": "distillation/curves_steps.png"})
    d, lo, hi = summary["equal_steps/reverse_kl/diff"]
    assert d == pytest.approx(np.mean([e["opd"]["reverse_kl"] - e["sft_continued"]["reverse_kl"] for _, e in evals]))
    assert lo < d < hi < 0
    assert "equal steps, reverse KL to the teacher (per token): OPD better" in text
    # identical exact match in both arms in every seed: a zero-width interval, no verdict
    assert "equal steps, exact match: not resolved (every seed gave the same difference" in text
    assert "![learning curves against steps](distillation/curves_steps.png)" in text
    # the positive control: the control arm's change over the second half of its steps (1,150 -> 1,300 on its
    # curve, whose 1,150-step point is 1.8), paired by seed
    m, lo, hi = summary["control_last_half/reverse_kl"]
    assert m == pytest.approx(np.mean([e["sft_continued"]["reverse_kl"] - 1.8 for _, e in evals]))
    assert lo < m < hi < 0 and "positive control" in text


def test_the_distillation_command_selects_seeds_by_params_and_reports_regimes(tmp_path):
    """`ars-opd distillation --where/--regime`: sets of seeds picked by their params, each in its section."""
    from ars_opd.cli import main

    def rev(name, seed, steps, ev):
        params = {"ddp": {"seed": seed}, "opd": {"steps": steps}}
        return {
            "rev": name,
            "name": name,
            "data": {
                "params": {"params.yaml": {"data": params}},
                "metrics": {"data/metrics/evaluate.json": {"data": ev}},
            },
        }

    rng = np.random.default_rng(1)
    base = rev("workspace", 0, 300, _evaluate(1.0, 1.3))
    exps = [(s, 300, _evaluate(1.0 + rng.normal(0, 0.02), 1.3 + rng.normal(0, 0.02))) for s in (1, 2, 3)]
    exps += [(s, 1000, _evaluate(2.0 + rng.normal(0, 0.02), 1.0 + rng.normal(0, 0.02))) for s in (1, 2, 3, 4)]
    base["experiments"] = [{"name": f"e{i}", "revs": [rev(f"e{i}", s, n, ev)]} for i, (s, n, ev) in enumerate(exps)]
    src, out = tmp_path / "exps.json", tmp_path / "reports" / "distillation.md"
    src.write_text(json.dumps([base]))
    assert (
        main(
            [
                "distillation",
                "--from",
                str(src),
                "--out",
                str(out),
                "--where",
                "opd.steps=300",
                "--regime",
                "longer horizon:opd.steps=1000",
            ]
        )
        == 0
    )
    text = out.read_text()
    main_part, regime_part = text.split("## Regime: longer horizon")
    # the baseline revision (seed 0, same params) is a seed of the main study; the regime has its own four
    assert "Seeds: [0, 1, 2, 3]" in main_part and "Seeds: [1, 2, 3, 4]." in regime_part
    assert "equal steps, reverse KL to the teacher (per token): OPD better" in main_part
    assert "longer horizon: at equal steps, reverse KL to the teacher (per token): control better" in regime_part
    assert "Where OPD is expected to win" in regime_part
    assert (tmp_path / "reports" / "distillation" / "curves_flops.png").stat().st_size > 0
    # a malformed selector is refused with a message, and a regime without two seeds is not reported
    assert main(["distillation", "--from", str(src), "--out", str(out), "--regime", "no colon"]) == 2
    assert main(["distillation", "--from", str(src), "--out", str(out), "--regime", "x:opd.steps=7"]) == 1


def test_learning_curves_dropped_by_dvc_exp_show_are_read_from_the_experiment_commits(tmp_path, monkeypatch):
    """`dvc exp show --json` keeps dicts of numbers but drops lists, so an experiment's learning curves arrive
    as {"examples": N}; the study reads them whole from the experiment's commit instead."""
    import subprocess

    from ars_opd.evaluation.distillation import git_metrics_reader, has_curves, with_curves

    rng = np.random.default_rng(2)
    evals = [(s, _evaluate(1.0 + rng.normal(0, 0.02), 1.3 + rng.normal(0, 0.02))) for s in range(3)]
    # a git repository with one commit per "experiment", each holding its whole evaluate metrics
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    revs = []
    for _, ev in evals:
        Path("data/metrics").mkdir(parents=True, exist_ok=True)
        Path("data/metrics/evaluate.json").write_text(json.dumps(ev))
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-qm", "exp"], check=True)
        revs.append(subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
    dropped = [{**ev, "curves": {"examples": 50}} for _, ev in evals]  # what dvc exp show hands over
    show = _show(list(zip([s for s, _ in evals], dropped)))
    for exp, rev in zip(show[0]["experiments"], revs[1:]):
        exp["revs"][0]["rev"] = rev
    show[0]["rev"] = revs[0]
    runs = collect(show)
    assert not any(has_curves(r["evaluate"]) for r in runs)
    assert render_study(runs, "cmds", {})[1].get("equal_flops/reverse_kl/diff") is None  # nothing to read off
    full = with_curves(runs)
    assert all(has_curves(r["evaluate"]) for r in full)
    assert [r["evaluate"] for r in full] == [json.loads(json.dumps(ev)) for _, ev in evals]
    d, lo, hi = render_study(full, "cmds", {})[1]["equal_flops/reverse_kl/diff"]
    # equal FLOPs (2e12): OPD's curve is 1.5 there in every seed, the control's final value is 1.3 + noise
    assert d == pytest.approx(np.mean([1.5 - ev["sft_continued"]["reverse_kl"] for _, ev in evals]))
    assert git_metrics_reader(revs[0], "no/such.json") is None and git_metrics_reader("0" * 40, "x") is None
    assert json.loads(git_metrics_reader("workspace", "data/metrics/evaluate.json")) == json.loads(
        json.dumps(evals[-1][1])
    )


def test_a_zero_width_interval_is_not_a_verdict():
    """Every seed giving the same difference (exact match moves in steps of one prompt) is not evidence."""
    evals = [_evaluate(1.0 + 0.01 * s, 1.3 + 0.02 * s, opd_em=0.60, ctl_em=0.62) for s in range(3)]
    text, summary = render_study([{"name": f"s{s}", "seed": s, "evaluate": e} for s, e in enumerate(evals)], "c", {})
    d, lo, hi = summary["equal_steps/exact_match/diff"]
    assert lo == hi == pytest.approx(-0.02)
    assert "equal steps, exact match: not resolved (every seed gave the same difference" in text
    assert "at equal steps, exact match: control better" not in text


def test_one_prompt_fewer_in_every_seed_is_not_a_verdict():
    """Exact match moves in steps of one prompt: one prompt fewer of 78 in every seed, at different levels, is one
    difference in exact arithmetic (the oracle: fractions) but three floats 1e-17 apart, whose t-interval is a
    sliver that excludes 0. No page may call that better or worse: not the seed study's, not the recovery
    study's, not the multi-teacher study's."""
    from fractions import Fraction

    from ars_opd.evaluation import multi_teacher, recovery
    from ars_opd.evaluation.stats import mean_ci, one_difference

    counts = [(36, 37), (37, 38), (38, 39)]
    diffs = [a / 78 - b / 78 for a, b in counts]
    assert {Fraction(a, 78) - Fraction(b, 78) for a, b in counts} == {Fraction(-1, 78)}
    _, lo, hi = mean_ci(diffs)
    assert len(set(diffs)) > 1 and lo < hi < 0  # the floats differ, and their interval excludes 0
    arm, control = [a / 78 for a, _ in counts], [b / 78 for _, b in counts]
    assert one_difference(arm, control)
    spread = ([33 / 78, 34 / 78, 35 / 78], [36 / 78, 38 / 78, 38 / 78])  # -3, -4, -3 prompts
    assert not one_difference(*spread)
    assert not multi_teacher.difference(arm, control)["resolved"]
    assert multi_teacher.difference(*spread)["resolved"]  # a spread that still excludes 0 is resolved
    evals = [_evaluate(1.0 + 0.01 * s, 1.3 + 0.02 * s, opd_em=a / 78, ctl_em=b / 78) for s, (a, b) in enumerate(counts)]
    runs = [{"name": f"s{s}", "seed": s, "evaluate": e} for s, e in enumerate(evals)]
    text, _ = render_study(runs, "c", {})
    assert "equal steps, exact match: not resolved (every seed gave the same difference" in text
    assert "at equal steps, exact match: control better" not in text
    words = "\n".join(recovery.verdict({"opd": runs}))
    assert "at equal steps, exact match: not resolved (every seed gave the same difference)" in words
    assert "at equal steps, exact match: worse than the control" not in words
