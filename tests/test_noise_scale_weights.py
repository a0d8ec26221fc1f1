"""The noise scale's per-step terms when the workers' token counts differ (OPD's completions, SFT's ragged rows).

A brute force on Gaussian token gradients with known |G|² and tr Σ: every token's gradient is drawn, each
worker's local gradient is their sum in the engine's scale, and the estimates of many steps are averaged. The
mean over workers of ‖G_k‖² paired with B_small = N/K (the estimator before, App. A.1's for equal batches)
overstates tr Σ by (N·mean_k(1/n_k) − 1)/(K − 1); the token-weighted mean (``noise_scale_terms``) does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from ars_opd.training.consistency import noise_scale_terms


def _unweighted(sq, tokens, mean_sq):
    """The estimator before the weighting: |G_small|² the plain mean over workers, at B_small = N/K."""
    K, N = len(sq), float(sum(tokens))
    small = sum(s * (N / (K * n)) ** 2 for s, n in zip(sq, tokens)) / K
    b_small, b_big = N / K, N
    return (b_big * mean_sq - b_small * small) / (b_big - b_small), (small - mean_sq) / (1 / b_small - 1 / b_big)


def _draw(tokens: tuple[int, ...], steps: int, seed: int):
    """Per step: each worker's ‖g_k‖² and ‖ḡ‖² from per-token gradients G + σ⊙z (P = 12 parameters)."""
    rng = np.random.default_rng(seed)
    P, K, N = 12, len(tokens), sum(tokens)
    G = rng.normal(0.0, 0.4, P)
    sigma = rng.uniform(0.5, 1.5, P)
    out = []
    for _ in range(steps):
        local = np.stack([(G + rng.normal(0.0, 1.0, (n, P)) * sigma).sum(0) * K / N for n in tokens])  # (K, P)
        mean = local.mean(0)
        out.append(((local**2).sum(1).tolist(), float((mean**2).sum())))
    return out, float((G**2).sum()), float((sigma**2).sum())


@pytest.mark.parametrize("tokens", [(20, 60), (8, 16, 40, 96)])
def test_noise_scale_terms_are_unbiased_when_token_counts_differ(tokens):
    steps = 20_000
    draws, g2_true, trace_true = _draw(tokens, steps, seed=len(tokens))
    K, N = len(tokens), sum(tokens)
    for estimator in (noise_scale_terms, _unweighted):
        est = np.array([estimator(sq, list(tokens), m) for sq, m in draws])  # (steps, 2): |G|², tr Σ
        mean, se = est.mean(0), est.std(0, ddof=1) / np.sqrt(steps)
        # statistical, not rounding: a mean of 20,000 independent estimates is within 4 standard errors of its
        # expectation but for a 6e-5 chance (the seed is fixed, so the outcome is too)
        if estimator is noise_scale_terms:
            assert abs(mean[0] - g2_true) <= 4 * se[0] and abs(mean[1] - trace_true) <= 4 * se[1], (mean, se)
        else:  # the bias the weighting removes, as derived (the measured figure: the factor below)
            factor = (N * np.mean([1 / n for n in tokens]) - 1) / (K - 1)
            assert abs(mean[1] - factor * trace_true) <= 4 * se[1], (mean[1], factor * trace_true, se[1])
            assert mean[1] - trace_true > 8 * se[1]  # resolved: tr Σ overstated by 66% (K = 2) and 164% (K = 4)
    # equal counts: the two estimators are one (the weights are all 1/K)
    sq, m = draws[0]
    even = [N // K] * K
    assert noise_scale_terms(sq, even, m) == pytest.approx(_unweighted(sq, even, m), rel=1e-12)
