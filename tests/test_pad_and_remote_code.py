"""A student without a pad token, and ``models.trust_remote_code``, through every stage that loads a model.

One micro pipeline on pretrained-style local models whose tokenizer has no pad token (as Llama 3's has
none), with ``models.trust_remote_code: true``: sft, opd (with GKD teacher-text steps), sft_continued and
evaluate run in this process (one worker each), while a spy on ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` records every load. Checked:

- every stage completes, pads with the one rule (``ars_opd.lm.batching.pad_token_id``: EOS when there is no
  pad token) and writes outputs that ``ars-opd check`` finds sound;
- every model and tokenizer load of those stages received ``trust_remote_code=True``, and every model the
  stages are meant to load was loaded (the student, the SFT student each arm starts from, the teacher, each
  trained model and learning-curve snapshot in evaluate);
- the training manifests count the teacher's truncated completions (sft drops them here, opd keeps them).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path

import pytest

from ars_opd.artifacts import write_jsonl
from ars_opd.config import BaseConfig, load_params
from ars_opd.training.budget import SNAPSHOTS
from micro import run_stage_here, teacher_rows, write_micro_params
from tiny_models import save_tiny_model

REPO = Path(__file__).resolve().parents[1]
STAGES = ("sft", "opd", "sft_continued", "evaluate")
TRUNCATED = 3  # train rows whose completion the teacher was cut off in


def _workspace(root: Path, tokenizer) -> None:
    """Local teacher and student without a pad token, and teacher rows (the models stage runs under the spy)."""
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    assert tok.pad_token_id is None and tok.eos_token_id is not None
    models = {
        role: str(save_tiny_model(root / f"{role}_model", tok, seed=seed))
        for role, seed in (("teacher", 1), ("student", 2))
    }
    extra = {
        "models": {**models, "trust_remote_code": True},
        "inputs": dict(models),
        "ddp": {"workers": 1, "threads_per_worker": 1},
        "sft": {"truncated_completions": "drop"},
        "opd": {"on_policy_fraction": 0.5, "steps": 6, "checkpoint_every": 3, "snapshot_every": 3},
    }
    write_micro_params(REPO, root / "params.yaml", extra)
    p = load_params(root / "params.yaml")
    cwd = os.getcwd()
    os.chdir(root)  # paths in params.yaml are relative to the repository root, here ``root``
    try:
        rows = teacher_rows(48, seed=3)
        for r in rows[:TRUNCATED]:
            r["finish_reason"] = "length"
        Path(p.paths.teacher_dir).mkdir(parents=True)
        write_jsonl(Path(p.paths.completions("train")), rows)
        write_jsonl(Path(p.paths.completions("eval")), teacher_rows(10, seed=9))
    finally:
        os.chdir(cwd)


@contextlib.contextmanager
def _inside(root: Path):
    cwd = os.getcwd()
    os.chdir(root)
    try:
        yield
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, char_tokenizer):
    """The models stage and the four training and evaluation stages run once under the spy: (root, params,
    {stage: [(what, path, trust_remote_code)]})."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ars_opd.models.prepare import prepare_models

    root = tmp_path_factory.mktemp("nopad")
    _workspace(root, char_tokenizer)
    calls: dict[str, list[tuple[str, str, object]]] = {}
    current = [""]

    def spy(cls_name, original):
        def load(path, *args, **kwargs):
            calls.setdefault(current[0], []).append((cls_name, str(path), kwargs.get("trust_remote_code")))
            return original(path, *args, **kwargs)

        return load

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AutoModelForCausalLM, "from_pretrained", spy("model", AutoModelForCausalLM.from_pretrained))
        mp.setattr(AutoTokenizer, "from_pretrained", spy("tokenizer", AutoTokenizer.from_pretrained))
        current[0] = "models"  # pins the local models and saves the shared tokenizer (loads it back)
        p = load_params(root / "params.yaml")
        with _inside(root):
            prepare_models(
                BaseConfig(threads=1), p.models, p.synthetic, p.paths.models_dir, p.paths.models_metrics, progress=False
            )
        for stage in STAGES:
            current[0] = stage
            run_stage_here(root, stage)
    return root, load_params(root / "params.yaml"), calls


@pytest.mark.slow
def test_a_tokenizer_without_pad_token_trains_and_evaluates(pipeline):
    from ars_opd.checks import check_outputs

    root, p, _ = pipeline
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert check_outputs(p.paths, STAGES) == []
        sft = json.loads(Path(p.paths.training("sft").manifest).read_text())["data"]
        opd = json.loads(Path(p.paths.training("opd").manifest).read_text())["data"]
        steps = [json.loads(line) for line in Path(p.paths.training("opd").steps).read_text().splitlines()]
    finally:
        os.chdir(cwd)
    assert sft["teacher_truncated"] == TRUNCATED and sft["dropped_teacher_truncated"] == TRUNCATED
    assert opd["teacher_truncated"] == TRUNCATED and opd["dropped_teacher_truncated"] == 0  # opd keeps them
    assert {s["gkd_source"] for s in steps} == {"student", "teacher"}  # both kinds of OPD step ran without a pad


@pytest.mark.slow
def test_trust_remote_code_reaches_every_load(pipeline):
    root, p, calls = pipeline

    def where(path: str) -> Path:  # stages open relative paths from the repository root, here ``root``
        return (Path(path) if Path(path).is_absolute() else root / path).resolve()

    for stage in ("models", *STAGES):
        assert calls.get(stage), f"{stage} loaded nothing"
        refused = [c for c in calls[stage] if c[2] is not True]
        assert not refused, f"{stage}: loads without trust_remote_code=True: {refused}"
    loaded = {stage: {where(path) for what, path, _ in calls[stage] if what == "model"} for stage in STAGES}
    teacher, student = where(p.models.teacher), where(p.models.student)
    trained = {s: where(p.paths.training(s).model) for s in ("sft", "opd", "sft_continued")}
    assert student in loaded["sft"]
    assert {trained["sft"], teacher} <= loaded["opd"]  # the SFT student it starts from, the teacher
    assert trained["sft"] in loaded["sft_continued"]
    assert {teacher, student, *trained.values()} <= loaded["evaluate"]
    assert any(SNAPSHOTS in x.parts for x in loaded["evaluate"])  # the learning-curve snapshots too
