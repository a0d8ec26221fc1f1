"""Rollout health: the detector's exact tests, its verdict on collapsed and steady logs, the columns the OPD stage
logs for it (per step and per worker), and where the verdict shows (check, summary).

Oracles: Fisher's tail against a brute-force sum of ``math.comb`` ratios; the test's size under the null by exact
enumeration of every binomial outcome; the student's entropy against ``torch.distributions`` in float64; the
per-worker columns against the all-worker ones they must average to.
"""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from ars_opd.checks import Problems, check_training
from ars_opd.training.opd.rollout_health import (
    HealthConfig,
    HealthMonitor,
    StepRollouts,
    detect,
    hypergeometric_tail,
    rollouts_of,
    step_tests,
)

REPO = Path(__file__).resolve().parents[1]


def _tail_by_enumeration(k: int, n_w: int, total: int, n_all: int, upper: bool) -> float:
    """P(X <= k) or P(X >= k), X hypergeometric, in exact rationals."""
    den = math.comb(n_all, n_w)
    ks = range(0, k + 1) if not upper else range(k, n_w + 1)
    return float(sum(Fraction(math.comb(total, j) * math.comb(n_all - total, n_w - j), den) for j in ks))


@pytest.mark.parametrize("n_b,n_w", [(8, 8), (8, 48), (16, 24), (3, 5)])
def test_fisher_tail_against_exact_rationals(n_b, n_w):
    for total in range(0, n_b + n_w + 1, max(1, (n_b + n_w) // 7)):
        for k in range(max(0, total - n_b), min(total, n_w) + 1):
            for upper in (False, True):
                got = hypergeometric_tail(k, n_w, total, n_b + n_w, upper)
                assert got == pytest.approx(_tail_by_enumeration(k, n_w, total, n_b + n_w, upper), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.62, 0.9])
def test_the_rate_tests_keep_their_size_under_the_null(p):
    """Every rollout ends with the same probability p: over every outcome of a baseline of 8 and a window of 16
    (exact binomial probabilities), the chance that a one-sided test's p-value falls below α is at most α."""
    n_b, n_w = 8, 16
    for alpha in (0.05, 1e-2, 1e-3):
        for kind in ("stopped_ending", "ending_early"):
            size = 0.0
            for e_b, e_w in itertools.product(range(n_b + 1), range(n_w + 1)):
                prob = math.comb(n_b, e_b) * p**e_b * (1 - p) ** (n_b - e_b)
                prob *= math.comb(n_w, e_w) * p**e_w * (1 - p) ** (n_w - e_w)
                base = [StepRollouts(0, n_b, e_b, 0, 10.0 * n_b)]
                win = [StepRollouts(1, n_w, e_w, 0, 10.0 * n_w)]
                if step_tests(base, win)[kind][0] < alpha:
                    size += prob
            assert size <= alpha * (1 + 1e-9), (kind, alpha, size)


def _log(eos: list[float], batch: int = 8, lengths: list[float] | None = None, on_policy=None) -> list[dict]:
    rows = []
    for i, e in enumerate(eos):
        # ended rollouts 20 tokens long, cut ones 48 (their mixture's second moment); or every rollout within 2
        # tokens of a given mean length
        length = lengths[i] if lengths else (48.0 * (1 - e) + 20.0 * e)
        square = length * length + 4.0 if lengths else 48.0**2 * (1 - e) + 20.0**2 * e
        rows.append(
            {
                "step": i,
                "task/rollouts": float(batch),
                "task/eos_rate": e,
                "task/truncation_rate": 1 - e,
                "task/response_length": length,
                "task/response_length_sq": square,
                "task/on_policy": 1.0 if on_policy is None else on_policy[i],
            }
        )
    return rows


def test_the_gpu_collapse_alarms_and_a_steady_run_does_not():
    # the committed study's seed 1: 62% at the start, then 38%, 38% and never again an end
    collapse = _log([0.625, 0.375, 0.375] + [0.0] * 57)
    monitor = detect(collapse, HealthConfig(1, 6, 1e-4))
    assert monitor.alarm is not None and monitor.alarm.kind in ("stopped_ending", "truncated_more", "longer")
    assert 3 < monitor.alarm.step <= 9
    assert "the rollouts stopped ending at step" in detect(collapse, HealthConfig(1, 6, 1e-4)).alarm.line("opd") or (
        monitor.alarm.kind != "stopped_ending"
    )
    steady = _log([0.625, 0.5, 0.75, 0.5, 0.625, 0.5, 0.75, 0.625] * 8)
    assert detect(steady, HealthConfig(1, 6, 1e-4)).alarm is None
    # teacher-text steps (GKD) are not judged: a zero EOS rate there is the teacher's completions
    gkd = _log([0.625] + [0.0] * 20, on_policy=[1.0] + [0.0] * 20)
    assert detect(gkd).alarm is None and len(detect(gkd).steps) == 1


def test_length_alone_can_raise_the_alarm():
    """Rollouts that always end (EOS rate 100% throughout) but grew from 10 to 30 tokens."""
    rows = _log([1.0] * 12, lengths=[10.0] * 3 + [30.0] * 9)
    alarm = detect(rows).alarm
    assert alarm is not None and alarm.kind == "longer" and alarm.window_value > alarm.baseline_value == 10.0
    assert 3 <= alarm.step <= 5  # within a few steps of the change, not before it


def test_the_live_monitor_fires_once_at_the_same_step_as_the_whole_log():
    rows = _log([0.75, 0.5, 0.25] + [0.0] * 20)
    monitor, fired = HealthMonitor(), []
    for s in rollouts_of(rows):
        a = monitor.add(s)
        if a is not None:
            fired.append(a.step)
    assert fired == [detect(rows).alarm.step]


def test_an_old_log_needs_the_batch_size():
    rows = [{k: v for k, v in r.items() if k != "task/rollouts"} for r in _log([0.625] + [0.0] * 10)]
    assert rollouts_of(rows) == [] and detect(rows).alarm is None
    assert detect(rows, batch=8).alarm is not None


def test_check_names_a_collapsed_run_in_one_line(tmp_path):
    """``ars-opd check`` on a training log whose rollouts stopped ending: one problem line naming the step."""
    from micro import load_committed_params

    p = load_committed_params(sections=("paths",)).paths
    out = p.training("opd")
    steps = tmp_path / out.steps
    steps.parent.mkdir(parents=True)
    rows = _log([0.625, 0.5] + [0.0] * 10)
    for r in rows:
        r.update(loss=1.0, grad_norm=1.0, worker_loss=[1.0], worker_tokens=[10])
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        problems = Problems()
        check_training("opd", p, problems)
    finally:
        os.chdir(cwd)
    lines = [x for x in problems if "stopped ending" in x]
    assert len(lines) == 1 and "opd: the rollouts stopped ending at step" in lines[0]


def test_entropy_column_against_torch_distributions(char_tokenizer):
    """The OPD loss's entropy record: H(softmax(z)) of the student at each scored row, against
    torch.distributions.Categorical in float64 on the same fp32 logits (the head's own product, so the inputs are
    exact): what is left is the record's own arithmetic, a shift, a logsumexp and a weighted sum over V, bounded by
    γ_{V+5}·(2·Σ_v q_v·|z_v − max z| + logsumexp(z − max z)) per row."""
    from ars_opd.lm.head import OutputHead
    from ars_opd.lm.opd_objectives import TeacherLogits, TeacherScores, get_objective
    from tolerances import gamma

    torch.manual_seed(0)
    V, H, M = len(char_tokenizer), 16, 11
    hidden, teacher_hidden = torch.randn(M, H), torch.randn(M, H)
    head, teacher_head = OutputHead(torch.randn(V, H), None), OutputHead(torch.randn(V, H), None)
    targets = torch.randint(0, V, (M,))
    entropy = torch.empty(M)
    get_objective("full_vocab").loss(
        hidden,
        head,
        TeacherScores(logits=TeacherLogits(teacher_hidden, teacher_head, targets)),
        targets,
        1.0,
        1.0,
        4,
        entropy=entropy,
    )
    z = head.logits(hidden).double()  # the fp32 logits the loss formed, exactly
    exact = torch.distributions.Categorical(logits=z).entropy()
    shifted = z - z.amax(-1, keepdim=True)
    q = torch.softmax(shifted, -1)
    bound = gamma(V + 5) * (2 * (q * shifted.abs()).sum(-1) + torch.logsumexp(shifted, -1))
    assert ((entropy.double() - exact).abs() <= bound).all()
    assert (entropy > 0).all()


@pytest.mark.slow
def test_opd_logs_rollout_health_per_step_and_per_worker(tmp_path):
    """Two workers: each step logs its rollouts' count (the global batch on an on-policy step), and each health
    column per worker, whose count-weighted mean is the all-worker column."""
    from micro import distill_workspace, run_opd_in

    distill_workspace(REPO, tmp_path, {"steps": 3}, workers=2)
    steps, _, _ = run_opd_in(tmp_path)
    from ars_opd.config import load_params

    batch = load_params(tmp_path / "params.yaml", base=tmp_path, sections=("opd",)).opd.global_batch_size
    for r in steps:
        assert r["task/rollouts"] == batch
        for name in ("eos_rate", "truncation_rate", "response_length", "entropy", "teacher_logprob"):
            per = r[f"worker_task/{name}"]
            assert len(per) == 2
        # the rollout shares are over each worker's equal share of the batch: the plain mean is the global one
        for name in ("eos_rate", "truncation_rate", "response_length"):
            assert sum(r[f"worker_task/{name}"]) / 2 == pytest.approx(r[f"task/{name}"], rel=1e-12, abs=1e-12)
        assert r["task/entropy"] > 0
        assert r["task/response_length_sq"] >= r["task/response_length"] ** 2 * (1 - 1e-12)


def test_the_calibration_study_counts_alarms_and_delays(tmp_path):
    """studies/rollout_health.py: the exact Poisson interval against its closed forms and tabulated values
    (0 events: upper −ln 0.025; 2 events: Garwood's 0.2422–7.2247), the collapse step, and one healthy and one
    collapsed log judged: no false alarm, the collapse found with its delay."""
    import sys

    sys.path.insert(0, str(REPO / "studies"))
    try:
        import rollout_health as study
    finally:
        sys.path.remove(str(REPO / "studies"))
    lo, hi = study.poisson_interval(0, 1.0)
    assert lo == 0.0 and hi == pytest.approx(-math.log(0.025), rel=1e-9)
    lo, hi = study.poisson_interval(2, 1.0)
    assert lo == pytest.approx(0.2422, abs=1e-4) and hi == pytest.approx(7.2247, abs=1e-4)
    collapsed = _log([0.625, 0.375, 0.375] + [0.0] * 20)
    assert study.collapse_step(collapsed, None, 5) == 3
    steady = _log([0.625, 0.5, 0.75, 0.5] * 10)
    out = study.judge([("steady", steady, None)], [("collapsed", collapsed, None)], HealthConfig(1, 4, 1e-4), 5)
    assert out["false_alarms"] == 0 and out["judged_steps"] == 39
    assert out["detected"] == 1 and out["delays"][0]["delay"] == out["delays"][0]["alarm_step"] - 3
