"""The consistency detector's pure functions on synthetic series with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ars_opd.config import ReportConfig
from ars_opd.evaluation.detector import (
    STATISTICS,
    cusum,
    cusum_threshold,
    detect,
    rank_residuals,
    rate_interval,
    siegmund_arl,
    standardise,
    threshold_for,
)


def test_threshold_inverts_siegmunds_approximation():
    for k in (0.25, 0.5, 1.0):
        for arl in (100.0, 5_000.0, 1e6):
            h = cusum_threshold(arl, k)
            assert siegmund_arl(h, k) == pytest.approx(arl, rel=1e-9)
    # a stricter target needs a higher boundary
    assert cusum_threshold(1e5, 0.5) > cusum_threshold(1e4, 0.5) > cusum_threshold(1e3, 0.5)
    with pytest.raises(ValueError):
        cusum_threshold(0.5, 0.5)


def test_threshold_spreads_the_target_over_every_test():
    cfg = ReportConfig(false_alarms_per_1000=1.0, two_worker_false_alarms_per_1000=1.0, k=0.5)
    h4 = threshold_for(cfg, workers=4)
    assert h4 == pytest.approx(cusum_threshold(1000 * len(STATISTICS) * 4 * 2, 0.5))
    # two workers: one tested rank (each residual is the other's negative)
    assert threshold_for(cfg, workers=2) == pytest.approx(cusum_threshold(1000 * len(STATISTICS) * 1 * 2, 0.5))
    assert threshold_for(cfg, workers=8) > h4 > threshold_for(cfg, workers=2)


def test_each_worker_count_has_its_own_design_rate():
    """K = 2 and K >= 3 are calibrated apart: each threshold follows its own key and ignores the other's."""
    cfg = ReportConfig(false_alarms_per_1000=0.25, two_worker_false_alarms_per_1000=0.05)
    assert threshold_for(cfg, workers=2) == pytest.approx(cusum_threshold(1000 * len(STATISTICS) * 2 / 0.05, 0.5))
    assert threshold_for(cfg, workers=4) == pytest.approx(cusum_threshold(1000 * len(STATISTICS) * 8 / 0.25, 0.5))
    loose = ReportConfig(false_alarms_per_1000=0.25, two_worker_false_alarms_per_1000=1.0)
    assert threshold_for(loose, workers=4) == threshold_for(cfg, workers=4)
    assert threshold_for(loose, workers=2) < threshold_for(cfg, workers=2)


def test_rate_interval_is_the_exact_poisson_interval():
    """Garwood's interval against values from the chi-square quantiles (chi2(0.975, 2)/2 = 3.6889 for no
    events; 0.6187 and 8.7673 for three), and coverage checked by simulation."""
    lo, hi = rate_interval(0, 1.0, per=1)
    assert lo == 0 and hi == pytest.approx(3.688879, rel=1e-5)
    lo, hi = rate_interval(3, 1.0, per=1)
    assert lo == pytest.approx(0.618672, rel=1e-5) and hi == pytest.approx(8.767273, rel=1e-5)
    rng = np.random.default_rng(0)
    mu, n = 4.0, 4000
    hits = sum(lo <= mu <= hi for lo, hi in (rate_interval(int(c), 1.0, per=1) for c in rng.poisson(mu, n)))
    assert hits / n >= 0.95  # exact intervals are conservative


def test_cusum_run_length_on_gaussian_noise_matches_the_target():
    """In-control ARL of one side, simulated on N(0, 1): within 25% of Siegmund's value (its known accuracy
    for k = 0.5 is a few percent; the tolerance covers the simulation's own error)."""
    rng = np.random.default_rng(0)
    k, target = 0.5, 400.0
    h = cusum_threshold(target, k)
    z = rng.standard_normal(400_000)
    ups = [t for t, side, _, _ in cusum(z, k, h) if side == "up"]
    arl = len(z) / len(ups)
    assert 0.75 * target < arl < 1.25 * target, arl


def test_cusum_detects_a_shift_at_the_expected_delay_and_estimates_its_onset():
    rng = np.random.default_rng(1)
    k, h = 0.5, cusum_threshold(20_000, 0.5)
    delays, onsets = [], []
    for trial in range(200):
        z = rng.standard_normal(300)
        z[200:] += 2.0  # a 2-sigma shift from step 200
        after = [(t, onset) for t, side, _, onset in cusum(z, k, h) if side == "up" and t >= 200]
        t, onset = after[0]
        delays.append(t - 200)
        onsets.append(onset)
    # a sustained shift delta is found in about h / (delta - k) steps
    assert abs(np.median(delays) - h / (2.0 - k)) < 2.5, (np.median(delays), h / 1.5)
    # the estimated onset (the step after the statistic last stood at 0) is near the true one
    assert 195 <= np.median(onsets) <= 201 and min(onsets) > 120


def test_cusum_restarts_after_an_alarm_and_skips_nan():
    z = np.array([5.0] * 6 + [math.nan] * 3 + [5.0] * 6)
    alarms = cusum(z, 0.5, 9.0)
    # 4.5 per finite step: alarms at the 2nd, 4th, 6th finite step of each run, NaN steps leave S alone
    assert [t for t, _, _, _ in alarms] == [1, 3, 5, 10, 12, 14]
    assert all(side == "up" for _, side, _, _ in alarms)


def test_standardise_scores_ranks_in_the_trailing_pooled_window_only():
    from statistics import NormalDist

    cfg = ReportConfig(warmup=10, window=20, lag=0)
    rng = np.random.default_rng(2)
    x = rng.standard_t(3, size=(2000, 4)) * 5.0  # heavy tails, any scale: the scores are N(0, 1) anyway
    x[1900:, 1] += 1000.0  # a change must not leak into the yardstick of earlier steps
    z = standardise(x, cfg)
    assert np.isnan(z[:10]).all() and np.isfinite(z[10:]).all()
    t = 250
    w = x[t - 20 : t].ravel()
    u = ((w < x[t, 2]).sum() + 0.5 * (w == x[t, 2]).sum() + 0.5) / (len(w) + 1)
    assert z[t, 2] == pytest.approx(NormalDist().inv_cdf(u))
    ok = z[50:1900].ravel()
    assert abs(ok.mean()) < 0.03 and 0.9 < ok.std() < 1.05 and 0.03 < (abs(ok) > 2).mean() < 0.06
    top = NormalDist().inv_cdf((80 + 0.5) / 81)  # beyond every value of the window: the largest score
    assert z[1900, 1] == pytest.approx(top) and z[1899, 1] < top


def test_residuals_compare_each_rank_with_the_median_worker():
    loss = np.array([[1.0, 1.0, 1.0, 2.0], [1.0, 2.0, 3.0, 4.0]])
    norm = np.array([[1.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]])
    cos = np.array([[0.5, 0.5, 0.9, 0.5], [0.1, 0.2, 0.3, 0.4]])
    r = rank_residuals(loss, norm, cos)
    assert r["loss"][0] == pytest.approx([0, 0, 0, math.log(2)])  # an outlier leaves the median alone
    assert r["loss"][1] == pytest.approx(np.log([1 / 2.5, 2 / 2.5, 3 / 2.5, 4 / 2.5]))
    assert r["grad_norm"][0] == pytest.approx([-math.log(2), 0, 0, 0])
    assert r["direction"][0] == pytest.approx([0, 0, 0.4, 0])
    assert r["direction"][1] == pytest.approx([-0.15, -0.05, 0.05, 0.15])


def _rows(
    steps: int, workers: int, seed: int, shift_rank: int | None = None, start: int = 0, factor: float = 1.0
) -> list[dict]:
    """Per-step rows with iid noisy per-worker statistics and a shared downward trend."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(steps):
        trend = 3.0 * math.exp(-t / 150)
        loss = trend * np.exp(rng.normal(0, 0.1, workers))
        norm = (1 + trend) * np.exp(rng.normal(0, 0.1, workers))
        cos = np.clip(rng.normal(0.6, 0.05, workers), -1, 1)
        if shift_rank is not None and t >= start:
            norm[shift_rank] *= factor
        rows.append(
            {
                "step": t,
                "loss": float(loss.mean()),
                "worker_loss": loss.tolist(),
                "consistency/worker_grad_norm": norm.tolist(),
                "consistency/worker_cos_to_mean": cos.tolist(),
                "drift_mismatch": [] if t % 10 == 0 else None,
            }
        )
    return rows


def test_detect_is_quiet_on_healthy_series_and_names_a_scaled_rank():
    cfg = ReportConfig()
    quiet = sum(len(detect(_rows(1000, 4, seed), cfg)) for seed in range(5))
    # 4,500 judged steps at the default design rate (at most 0.25 per 1,000): Poisson(<= 1.1) exceeds 5 with
    # probability <= 0.001
    assert quiet <= 5
    alarms = detect(_rows(400, 4, 9, shift_rank=2, start=250, factor=2.0), cfg)
    after = [a for a in alarms if a.step >= 250]
    assert after and after[0].rank == 2 and "grad_norm" in after[0].statistic.split("+")
    assert after[0].direction.startswith("up") and after[0].last_step > after[0].step  # sustained: one alarm
    assert after[0].step - 250 <= 5 and after[0].onset >= 245
    assert not after[0].visible  # the scaled gradient leaves the averaged loss alone


def test_crossings_of_one_rank_close_together_are_one_alarm():
    from ars_opd.evaluation.detector import merge_crossings

    alarms = merge_crossings(
        [
            (100, 2, "grad_norm", "up", 9.0, 97, False),
            (100, 2, "direction", "up", 8.5, 98, False),
            (106, 2, "grad_norm", "up", 8.4, 101, True),
            (130, 2, "loss", "down", 8.8, 125, False),
            (104, 1, "loss", "up", 8.3, 96, False),
        ]
    )
    assert [(a.step, a.rank, a.statistic, a.direction, a.last_step, a.crossings) for a in alarms] == [
        (100, 2, "direction+grad_norm", "up+up", 106, 3),
        (104, 1, "loss", "up", 104, 1),
        (130, 2, "loss", "down", 130, 1),
    ]
    assert alarms[0].value == 9.0 and alarms[0].onset == 97 and alarms[0].visible


def test_drift_mismatches_are_alarms_naming_the_ranks():
    rows = _rows(100, 4, 3)
    rows[60]["drift_mismatch"] = [1]
    alarms = [a for a in detect(rows, ReportConfig()) if a.statistic == "drift"]
    assert [(a.step, a.rank, a.direction) for a in alarms] == [(60, 1, "mismatch")]
