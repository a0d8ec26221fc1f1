"""Rollout health: the detector's exact tests, its verdict on collapsed and steady logs, the columns the OPD stage
logs for it (per step and per worker), and where the verdict shows (check, summary).

Oracles: Fisher's tail against a brute-force sum of ``math.comb`` ratios (Student's t tail is tested in
test_student_t.py); the length test against Welch's
statistic recomputed from the raw lengths; the test's size under the null by exact
enumeration of every binomial outcome; the student's entropy against ``torch.distributions`` in float64; the
per-worker columns against the all-worker ones they must average to.
"""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction
from pathlib import Path

import pandas as pd
import pytest
import torch

from ars_opd.checks import Problems, check_training
from ars_opd.evaluation.rollout_dashboard import health_line
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


def _welch_p_by_hand(base: list[float], win: list[float]) -> float:
    """Welch's one-sided p-value that the window is longer, from the raw lengths (float64 numpy, ddof 1) and
    mpmath's t tail: the independent route to what ``step_tests`` gets from per-step sums."""
    import mpmath
    import numpy as np

    a, b = np.asarray(base, dtype=float), np.asarray(win, dtype=float)
    sa, sb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    t = (b.mean() - a.mean()) / math.sqrt(sa + sb)
    df = (sa + sb) ** 2 / (sa**2 / (len(a) - 1) + sb**2 / (len(b) - 1))
    with mpmath.workdps(50):
        tail = 0.5 * mpmath.betainc(
            mpmath.mpf(df) / 2, 0.5, 0, mpmath.mpf(df) / (df + mpmath.mpf(t) ** 2), regularized=True
        )
    return float(tail if t > 0 else 1 - tail)


def _steps(groups: list[list[float]], max_new: float = 48.0) -> list[StepRollouts]:
    return [
        StepRollouts(
            i, len(g), sum(x < max_new for x in g), sum(x >= max_new for x in g), sum(g), sum(x * x for x in g)
        )
        for i, g in enumerate(groups)
    ]


def test_the_length_test_is_welch_read_against_student_t():
    """The longer/shorter p-values equal Welch's from the raw lengths. And the case that made it matter: a baseline
    of 8 rollouts (7 ended, mean 16.1 tokens; the run's was 17.4) against one step of 8 all cut at 48, a one-step
    stall a λ = 0.25 run recovered from. Read against the normal it is p < 1e-10 and alarms; against t (7 degrees
    of freedom) it is above α = 1e-4, and Fisher's test on the ended counts (p = 8/11440) does not alarm either."""
    base = [6.0, 8.0, 10.0, 11.0, 12.0, 14.0, 20.0, 48.0]
    for win in ([9.0, 12.0, 15.0, 16.0, 21.0, 30.0], [4.0, 5.0, 9.0, 6.0], [48.0] * 7 + [47.0]):
        tests = step_tests(_steps([base]), _steps([win]))
        want = _welch_p_by_hand(base, win)
        assert tests["longer"][0] == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert tests["shorter"][0] == pytest.approx(1 - want, rel=1e-9, abs=1e-15)
    stall = [base, [48.0] * 8]
    tests = step_tests(_steps(stall[:1]), _steps(stall[1:]))
    mean = sum(base) / 8
    se = math.sqrt(sum((x - mean) ** 2 for x in base) / 7 / 8)
    normal_p = 0.5 * math.erfc((48.0 - mean) / se / math.sqrt(2))
    assert normal_p < 1e-10  # what the normal reading said
    assert tests["longer"][0] == pytest.approx(_welch_p_by_hand(base, [48.0] * 8), rel=1e-9)
    assert tests["longer"][0] > 1e-4 and tests["stopped_ending"][0] == pytest.approx(8 / 11440, rel=1e-12)
    assert detect([r for r in _rows_of(stall)]).alarm is None
    # the study page's line says how near it came rather than that nothing moved
    line = health_line("opd", pd.DataFrame(_rows_of(stall)))
    assert "no alarm in 2 on-policy steps" in line and f"p = {tests['longer'][0]:.1e}, longer" in line


def _rows_of(groups: list[list[float]], max_new: float = 48.0) -> list[dict]:
    rows = []
    for s in _steps(groups, max_new):
        rows.append(
            {
                "step": s.step,
                "task/rollouts": float(s.n),
                "task/eos_rate": s.ended / s.n,
                "task/truncation_rate": s.cut / s.n,
                "task/response_length": s.length_sum / s.n,
                "task/response_length_sq": s.length_sq_sum / s.n,
            }
        )
    return rows


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


def test_lengths_that_are_not_numbers_are_not_tested():
    """A log whose length columns overflowed to inf gives no length verdict (the old branch called it p = 0)."""
    base = [StepRollouts(0, 8, 4, 4, 200.0, 6000.0)]
    win = [StepRollouts(1, 8, 4, 4, math.inf, math.inf)]
    tests = step_tests(base, win)
    assert "longer" not in tests and "shorter" not in tests and "stopped_ending" in tests
