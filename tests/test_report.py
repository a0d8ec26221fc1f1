"""The report: detector alarms on clean and faulty logs, clipping, noise scale, drift, and the files written."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from ars_opd.config import PathsConfig, ReportConfig
from ars_opd.evaluation.consistency_report import detection_benchmark, noise_scale_summary
from ars_opd.evaluation.detector import rate_interval
from ars_opd.evaluation.report import build_report, write_report


def _log(n=300, workers=4, seed=0, scale_rank=None, start=200, clip_every=0, drift_at=None):
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(n):
        trend = 3.0 * np.exp(-t / 80) + 0.5
        wl = trend * np.exp(rng.normal(0, 0.1, workers))
        wn = (1 + trend) * np.exp(rng.normal(0, 0.1, workers))
        if scale_rank is not None and t >= start:
            wn[scale_rank] *= 2.0
        cos = np.clip(rng.normal(0.6, 0.05, workers), -1, 1)
        rows.append(
            {
                "step": t,
                "loss": float(wl.mean()),
                "grad_norm": float(wn.mean() * 0.7),
                "tokens": 400,
                "scenario": "S1-1",
                "clipped": bool(clip_every and t % clip_every == 0),
                "worker_loss": wl.tolist(),
                "worker_tokens": [100] * workers,
                "consistency/loss_dispersion": float(wl.std()),
                "consistency/loss_range": float(np.ptp(wl)),
                "consistency/grad_norm_dispersion": float(wn.std()),
                "consistency/grad_direction_consistency": float(cos.mean()),
                "consistency/gradient_diversity": 0.6,
                "consistency/worker_grad_norm": wn.tolist(),
                "consistency/worker_cos_to_mean": cos.tolist(),
                "drift_mismatch": ([1] if t == drift_at else []) if t % 10 == 0 else None,
                "fault": None,
                "gns/b_simple": 1000.0 + t,
                "gns/g2": 1.0,
                "gns/trace": 1000.0 + t,
            }
        )
    return pd.DataFrame(rows)


def test_clean_logs_stay_near_the_target_rate_and_the_method_is_stated():
    total = 0
    for seed in range(4):
        md, flat, alarms = build_report({"sft": _log(seed=seed)}, None, ReportConfig())
        total += flat["sft/alarms"]
        if not alarms["sft"]:
            assert "no worker departed from the others" in md
    # 800 judged iid steps at the default design rate (at most 0.25 per 1,000): Poisson(<= 0.2) exceeds 2 with
    # probability <= 0.001
    assert total <= 2
    cfg = ReportConfig()
    assert f"**{cfg.false_alarms_per_1000:g} per 1,000 steps** at K ≥ 3" in md and "two-sided CUSUM" in md
    assert f"**{cfg.two_worker_false_alarms_per_1000:g}** at K = 2" in md


def test_a_scaled_gradient_on_one_rank_is_a_silent_alarm_naming_it():
    md, flat, alarms = build_report({"sft": _log(scale_rank=3)}, None, ReportConfig())
    first = next(a for a in alarms["sft"] if a.step >= 200)
    assert (first.rank, first.statistic.split("+")[0], first.direction.split("+")[0]) == (3, "grad_norm", "up")
    assert 200 <= first.step <= 205 and not first.visible
    assert flat["sft/alarms_silent"] == flat["sft/alarms"] >= 1
    assert f"| {first.step} | 3 | {first.statistic} | {first.direction} |" in md and "**silent**" in md


def test_two_workers_cannot_name_the_rank():
    _, _, alarms = build_report({"sft": _log(workers=2, scale_rank=1)}, None, ReportConfig())
    assert alarms["sft"] and all(a.rank is None for a in alarms["sft"])


def test_clipping_noise_scale_and_drift_are_reported():
    md, flat, alarms = build_report({"opd": _log(clip_every=2, drift_at=250)}, None, ReportConfig())
    assert flat["opd/clip_fraction"] == 0.5 and "150 of 300 steps clipped" in md
    assert flat["opd/noise_scale_tokens"] == 1299.0 and flat["opd/global_batch_tokens"] == 400
    assert "critical batch size in tokens is about **1,299**" in md and "**400** tokens" in md
    assert flat["opd/drift_checks"] == 30 and flat["opd/drift_mismatches"] == 1
    assert "first at step 250 (ranks [1])" in md
    assert [(a.step, a.rank) for a in alarms["opd"] if a.statistic == "drift"] == [(250, 1)]
    assert np.isnan(noise_scale_summary(pd.DataFrame({"loss": [1.0]}))[0])
    # a non-positive |G|² estimate is no critical batch size: say so instead of printing a negative one
    noisy = _log()
    noisy["gns/b_simple"] = -500.0
    md, _, _ = build_report({"opd": noisy}, None, ReportConfig())
    assert "critical batch size in tokens is about" not in md and "not resolved in this stage" in md
    # one worker logs no estimate (gns/b_simple NaN at every step): null in the metrics, which ars-opd check accepts
    one = _log()
    one["gns/b_simple"] = float("nan")
    _, flat, _ = build_report({"opd": one}, None, ReportConfig())
    assert flat["opd/noise_scale_tokens"] is None


def test_detection_benchmark_summary(tmp_path):
    """The run's own K is quoted: its held-out null with the exact interval, its fault table; at K = 2 the
    fault table counts any alarm (no rank is named) and the text says an alarm cannot name the worker."""
    rows = [
        {
            "null": stage,
            "workers": k,
            "seed": s,
            "steps": 1000,
            "judged_steps": 1000,
            "false_alarms": s * (k // 2),
            "alarms": [],
        }
        for k in (2, 4)
        for s in range(3)
        for stage in ("sft",)
    ]
    rows += [
        {
            "case": "loss_scale",
            "workers": 4,
            "magnitude": 2.0,
            "default": True,
            "seed": s,
            "rank": 2,
            "detected": True,
            "delay_steps": 3 + s,
            "named_rank": 2 if s else 1,
            "false_alarms": 0,
            "judged_steps": 60,
        }
        for s in range(3)
    ]
    rows += [
        {
            "case": "loss_scale",
            "workers": 2,
            "magnitude": 2.0,
            "default": True,
            "seed": s,
            "rank": 1,
            "detected": s > 0,
            "delay_steps": 4 + s if s else None,
            "named_rank": None,
            "false_alarms": 0,
            "judged_steps": 60,
        }
        for s in range(3)
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"summary": "x"}) + "\n")
    lines, flat = detection_benchmark(path, workers=4)
    assert flat["detector/false_alarms_per_1000_measured"] == pytest.approx(1000 * 6 / 3000)
    lo, hi = rate_interval(6, 3000)
    assert (flat["detector/false_alarms_per_1000_ci_low"], flat["detector/false_alarms_per_1000_ci_high"]) == (lo, hi)
    assert "| loss_scale | 2 | yes | 2/3 | 5 | 5 |" in lines  # the run that named rank 1 is not a hit
    assert not any("a third worker" in line for line in lines)
    lines2, flat2 = detection_benchmark(path, workers=2)
    assert flat2["detector/false_alarms_per_1000_measured"] == pytest.approx(1000 * 3 / 3000)
    assert "| loss_scale | 2 | yes | 2/3 | 6 | 6 |" in lines2 and "rank not attributable" in "\n".join(lines2)
    assert any("a third worker" in line and "K ≥ 3" in line for line in lines2)
    unmeasured, none = detection_benchmark(path, workers=8)
    assert none == {} and "K = 8" in unmeasured[0] and "not known" in unmeasured[0]
    missing, none = detection_benchmark(tmp_path / "absent.jsonl", workers=2)
    assert none == {} and "python studies/detection.py" in missing[0]


def test_write_report_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = PathsConfig()
    for stage, df in (("sft", _log()), ("opd", _log(seed=2, scale_rank=1))):
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
        assert list(csv["step"]) == list(range(300)) and "loss_dispersion" in csv and "b_simple" in csv
    metrics = json.loads((tmp_path / "reports/metrics.json").read_text())
    assert metrics == flat and flat["opd/alarms"] >= 1


def test_the_header_states_the_strategy_and_fsdp_has_no_drift_check():
    md, _, _ = build_report({"sft": _log(n=60)}, None, ReportConfig())
    assert "60 steps, 4 workers (ddp), scenario S1-1" in md and "replica-drift check does not apply" not in md
    sharded = _log(n=60).assign(strategy="fsdp", drift_mismatch=None)
    md, _, _ = build_report({"sft": sharded}, None, ReportConfig())
    assert "60 steps, 4 workers (fsdp), scenario S1-1" in md and "replica-drift check does not apply" in md
    assert "**Replica drift:** not applicable" in md and "replicas were identical" not in md
