"""The opd stage with ``opd.cross_tokenizer``: trainer and engine rollouts, a local and a served teacher.

The micro workspace's teacher and student share the built-in tokenizer, so every run can be checked against
another: the endpoint-scored run against the locally scored one (the same teacher weights, the teacher's own
tokenisation sent as token ids to ``prompt_logprobs``), and every text the student writes is one the teacher can
spell (no unaligned tokens). The different-tokenizer arithmetic is checked in tests/test_cross_tokenizer_opd.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from micro import distill_workspace, run_opd_in

REPO = Path(__file__).resolve().parents[1]

OPD = {
    "steps": 6,
    "global_batch_size": 8,
    "micro_batch_size": 4,
    "max_new_tokens": 6,
    "loss": "sampled_token",
    "cross_tokenizer": True,
    "checkpoint_every": 0,
    "snapshot_every": 0,
    "warmup_steps": 1,
    "lr": 0.005,
    "teacher_server": {"threads": 1},
    "engine": {"bundled": {"threads": 1}},
}


def _run(root: Path, opd: dict) -> tuple[list[dict], dict]:
    distill_workspace(REPO, root, opd, workers=2)
    steps, _, manifest = run_opd_in(root)
    return steps, manifest


@pytest.mark.slow
@pytest.mark.ddp
def test_cross_tokenizer_opd_scored_by_an_endpoint_matches_the_local_teacher(tmp_path):
    local, manifest = _run(tmp_path / "local", {**OPD, "teacher": "local"})
    served, _ = _run(tmp_path / "endpoint", {**OPD, "teacher": "endpoint"})
    assert manifest["cross_tokenizer"]["loss"] == "sampled_token"
    assert len(local) == len(served) == OPD["steps"]
    for a, b in zip(local, served):
        assert a["task/unaligned_rate"] == 0.0 and b["task/unaligned_rate"] == 0.0
        assert math.isfinite(a["loss"]) and a["task/teacher_logprob"] < 0
        # the same rollouts, scored by two fp32 forwards of the same teacher (in process, in the server): as in
        # test_opd_endpoint, an allowance for two forwards' rounding and its drift over a few steps
        assert abs(a["loss"] - b["loss"]) <= 1e-4 and abs(a["task/teacher_logprob"] - b["task/teacher_logprob"]) <= 1e-4
    assert len({round(r["loss"], 3) for r in local}) > 2  # it trained: the losses moved


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("loss", ["sampled_token", "cross_vocab"])
def test_cross_tokenizer_opd_with_engine_rollouts(tmp_path, loss):
    steps, manifest = _run(tmp_path, {**OPD, "loss": loss, "rollouts": "engine", "steps": 3})
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert manifest["cross_tokenizer"]["loss"] == loss
    for r in steps:
        assert math.isfinite(r["loss"]) and r["task/unaligned_rate"] == 0.0
        if loss == "cross_vocab":
            assert r["loss"] >= -1e-6  # a sum of a divergence and a distance
