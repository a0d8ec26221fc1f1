"""The report: the silent-inconsistency rule on planted and clean logs, and the files it writes."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from ars_opd.config import PathsConfig, ReportConfig
from ars_opd.evaluation.report import build_report, loss_spikes, silent_steps, summarise, write_report


def _log(n=200, seed=0, plant=None, loss_spike_at=None):
    rng = np.random.default_rng(seed)
    steps = np.arange(n)
    loss = 3.0 * np.exp(-steps / 80) + 0.5 + rng.normal(0, 0.01, n)
    ld = np.abs(rng.normal(0.05, 0.005, n))
    gnd = np.abs(rng.normal(0.2, 0.02, n))
    gdc = np.clip(rng.normal(0.8, 0.02, n), -1, 1)
    for step, col, value in plant or []:
        {"ld": ld, "gnd": gnd, "gdc": gdc}[col][step] = value
    if loss_spike_at is not None:
        loss[loss_spike_at] += 2.0
    rows = []
    for i in range(n):
        rows.append({"step": int(i), "loss": float(loss[i]), "grad_norm": 1.0, "scenario": "S1-1",
                     "worker_loss": [float(loss[i] - ld[i]), float(loss[i] + ld[i])], "worker_tokens": [50, 50],
                     "consistency/loss_dispersion": float(ld[i]), "consistency/loss_range": float(2 * ld[i]),
                     "consistency/grad_norm_dispersion": float(gnd[i]),
                     "consistency/grad_direction_consistency": float(gdc[i]),
                     "consistency/gradient_diversity": 0.6})
    return pd.DataFrame(rows)


def test_clean_log_flags_nothing():
    for seed in range(5):
        assert silent_steps(_log(seed=seed)).empty


def test_planted_dispersion_with_smooth_loss_is_flagged():
    df = _log(plant=[(120, "ld", 0.6), (150, "gnd", 2.0), (170, "gdc", -0.2)])
    flagged = silent_steps(df)
    assert set(zip(flagged["step"], flagged["statistic"])) == {
        (120, "loss_dispersion"), (150, "grad_norm_dispersion"), (170, "direction_inconsistency")}
    row = flagged[flagged["step"] == 120].iloc[0]
    assert row["value"] == 0.6 and 0.04 < row["baseline"] < 0.06


def test_dispersion_with_a_visible_loss_spike_is_not_silent():
    df = _log(plant=[(120, "ld", 0.6)], loss_spike_at=120)
    assert 120 not in set(silent_steps(df)["step"])


def test_loss_spikes_count_visible_jumps_only():
    assert loss_spikes(_log()) == 0
    assert loss_spikes(_log(loss_spike_at=120)) == 2  # up at 120, back down at 121


def test_early_steps_have_no_baseline():
    df = _log(plant=[(3, "ld", 5.0)])
    assert 3 not in set(silent_steps(df, window=50)["step"])


def test_summary_and_markdown_name_definitions_and_flags():
    df = _log(plant=[(120, "ld", 0.6)])
    s = summarise(df)
    assert abs(s["consistency/loss_dispersion"]["max"] - 0.6) < 1e-12
    assert s["loss"]["p95"] <= s["loss"]["max"]
    evaluation = {"base": {"exact_match": 0.0, "reverse_kl": 2.0, "teacher_nll": 3.0},
                  "sft": {"exact_match": 0.5, "reverse_kl": 0.8, "teacher_nll": 0.9},
                  "opd": {"exact_match": 0.55, "reverse_kl": 0.6, "teacher_nll": 0.95},
                  "teacher": {"exact_match": 0.95, "reverse_kl": 0.0, "teacher_nll": 0.2}}
    md, flat, flagged = build_report({"sft": df, "opd": _log(seed=1)}, evaluation, ReportConfig())
    assert "population std over k of L_k" in md and "mean over pairs i<j of cos(g_i, g_j)" in md
    assert "| 120 | loss_dispersion |" in md and "No silent steps flagged in opd." in md
    assert "**lower** than SFT's" in md
    assert flat["sft/silent_steps"] == 1 and flat["opd/silent_steps"] == 0
    assert flat["eval/opd/reverse_kl"] == 0.6


def test_write_report_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = PathsConfig()
    for stage, df in (("sft", _log()), ("opd", _log(seed=2, plant=[(100, "gnd", 3.0)]))):
        steps = tmp_path / paths.training(stage).steps
        steps.parent.mkdir(parents=True)
        with open(steps, "w") as f:
            for row in df.to_dict("records"):
                f.write(json.dumps(row) + "\n")
    flat = write_report(ReportConfig(), paths)
    assert (tmp_path / "reports/report.md").read_text().startswith("# ars-opd report")
    for stage in ("sft", "opd"):
        png = (tmp_path / f"reports/figures/{stage}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        csv = pd.read_csv(tmp_path / f"reports/plots/{stage}.csv")
        assert list(csv["step"]) == list(range(200)) and "loss_dispersion" in csv
    assert json.loads((tmp_path / "reports/metrics.json").read_text()) == flat and flat["opd/silent_steps"] == 1


def test_a_step_is_judged_as_soon_as_half_a_window_of_baseline_exists():
    """Regression: the MAD was NaN until step 2·(window/2) − 1, so with window 50 steps 26–49 went unjudged
    while the report said only the first 25 were."""
    for step in (26, 30, 49):
        df = _log(plant=[(step, "ld", 0.6)])
        assert (step, "loss_dispersion") in set(zip(*silent_steps(df, window=50).loc[:, ["step", "statistic"]].T.values))


def test_the_baseline_is_the_median_and_mad_of_the_previous_window():
    from ars_opd.evaluation.report import _rolling_bound

    x = pd.Series(np.linspace(1.0, 2.0, 200))
    med, hi = _rolling_bound(x, window=50, k=4.0)
    prev = x.iloc[100:150].to_numpy()  # the 50 steps before step 150
    m = float(np.median(prev))
    mad = 1.4826 * float(np.median(np.abs(prev - m)))
    assert med.iloc[150] == np.float64(m) and hi.iloc[150] == np.float64(m + 4.0 * max(mad, 0.05 * m))
    assert med.iloc[:25].isna().all() and not np.isnan(med.iloc[25])
