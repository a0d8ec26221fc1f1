"""On-policy distillation: rollout batch rebuilding, the GKD draw, and the stage on a micro config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ars_opd.artifacts import read_jsonl
from ars_opd.config import load_params
from ars_opd.lm.batching import build_rollout_batch
from ars_opd.models.loading import load_model, load_tokenizer
from ars_opd.training.distributed import launch
from ars_opd.training.opd.stage import run_opd
from ars_opd.training.opd.task import uses_student_rollouts
from ars_opd.training.worker import TrainingJob
from ddp_probe import gkd_probe
from micro import distill_workspace

REPO = Path(__file__).resolve().parents[1]
EOS, PAD = 2, 2  # pad == eos, as in several real tokenizers


def test_rollout_batch_keeps_up_to_first_eos_when_pad_equals_eos():
    prompts = [[5, 6, 7], [5, 6], [9, 9, 9, 9]]
    completions = [[8, EOS, EOS, 9], [EOS, 4, 4], [10, 11, 12]]  # EOS mid-way; EOS first; no EOS
    b = build_rollout_batch(prompts, completions, pad_id=PAD, eos_id=EOS)
    assert b["lengths"].tolist() == [2, 1, 3] and b["has_eos"].tolist() == [True, True, False]
    assert b["input_ids"][0, :5].tolist() == [5, 6, 7, 8, EOS]
    # loss positions are those predicting completion tokens, EOS included, nothing after it
    assert b["loss_mask"][0].nonzero().squeeze(-1).tolist() == [2, 3]
    assert b["targets"][0, 2:4].tolist() == [8, EOS]
    assert b["loss_mask"][1].nonzero().squeeze(-1).tolist() == [1] and b["targets"][1, 1] == EOS
    assert b["loss_mask"][2].nonzero().squeeze(-1).tolist() == [3, 4, 5]
    assert b["attention_mask"].sum(1).tolist() == [5, 3, 7]  # padding (== EOS id) is not attended
    assert int(b["loss_mask"].sum()) == 6


def test_rollout_batch_masks_come_from_lengths_not_ids():
    b = build_rollout_batch([[PAD, 5]], [[PAD]], pad_id=PAD, eos_id=EOS)  # a prompt containing the pad id
    assert b["attention_mask"].tolist() == [[1, 1, 1]] and b["loss_mask"].tolist() == [[False, True, False]]


def test_gkd_draw_follows_lambda_and_is_a_function_of_seed_and_step():
    draws = [uses_student_rollouts(3, s, 0.3) for s in range(2000)]
    assert 0.25 < sum(draws) / len(draws) < 0.35
    assert draws == [uses_student_rollouts(3, s, 0.3) for s in range(2000)]
    assert all(uses_student_rollouts(3, s, 1.0) for s in range(100))
    assert not any(uses_student_rollouts(3, s, 0.0) for s in range(100))


@pytest.mark.ddp
def test_gkd_draw_identical_on_every_worker():
    parts = launch(gkd_probe, {"seed": 11, "steps": 64, "lam": 0.5}, workers=2)
    assert parts[0] == parts[1] and 10 < sum(parts[0]) < 54


def _workspace(root: Path, opd: dict) -> None:
    distill_workspace(REPO, root, opd, workers=2)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("loss, lam", [("full_vocab", 0.5), ("sampled_token", 1.0)])
def test_opd_stage_end_to_end_on_micro_config(tmp_path, loss, lam):
    opd = {
        "steps": 6,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "max_new_tokens": 6,
        "loss": loss,
        "on_policy_fraction": lam,
        "checkpoint_every": 3,
        "warmup_steps": 1,
        "lr": 0.005,
    }
    _workspace(tmp_path, opd)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        p = load_params("params.yaml")
        before = {k: v.clone() for k, v in load_model(p.paths.models_dir, "student").state_dict().items()}
        summary = run_opd(TrainingJob.from_params("opd", p, progress=False))
        steps = read_jsonl(p.paths.training("opd").steps)
        after = load_model_dir_state(Path(p.paths.opd_model))
    finally:
        os.chdir(cwd)
    assert summary["steps"] == 6 and [r["step"] for r in steps] == list(range(6))
    sources = [r["gkd_source"] for r in steps]
    assert sources == ["student" if uses_student_rollouts_for(s, lam, p) else "teacher" for s in range(6)]
    for r in steps:
        for key in (
            "task/teacher_logprob",
            "task/response_length",
            "task/eos_rate",
            "task/truncation_rate",
            "task/correct_rate",
            "task/divergence_first_half",
            "task/divergence_second_half",
            "lr",
            "consistency/grad_direction_consistency",
            "grad_norm",
            "worker_loss",
        ):
            assert key in r, key
        assert "task/gen_s" not in r and "task/teacher_s" not in r  # wall-clock columns: DVCLive only
        assert r["task/teacher_logprob"] <= 0 and 0 <= r["task/eos_rate"] <= 1
        assert 1 <= r["task/response_length"] <= 6
        assert 0 <= r["task/correct_rate"] <= 1 and 0 <= r["task/truncation_rate"] <= 1 - r["task/eos_rate"]
        if loss == "full_vocab":
            assert r["loss"] >= 0  # a divergence
        assert r["task/on_policy"] == (1.0 if r["gkd_source"] == "student" else 0.0)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the student was trained
    live = tmp_path / p.paths.opd_live / "plots/metrics/train/task"
    assert (live / "gen_s.tsv").is_file() and (live / "teacher_s.tsv").is_file()
    manifest = json.loads((tmp_path / p.paths.training("opd").manifest).read_text())
    assert manifest["vocab"] == len(load_tokenizer(tmp_path / p.paths.models_dir))
    assert manifest["data"]["kept"] == 64


def uses_student_rollouts_for(step: int, lam: float, p) -> bool:
    from ars_opd.seeding import derive_seed

    return uses_student_rollouts(derive_seed(p.base.seed, "opd"), step, lam)


def load_model_dir_state(path: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()
