"""The replicated scenario study: its statistics against known values, and `dvc exp show --json` reading."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from ars_opd.cli import main
from ars_opd.evaluation.scenarios import collect, render
from ars_opd.evaluation.stats import (
    detectable_difference,
    jonckheere,
    mean_ci,
    student_t_cdf,
    student_t_quantile,
    welch_diff,
)


def test_student_t_matches_tables():
    # two-sided 95% critical values: df 1, 4, 10, 30 (standard tables)
    for df, t in ((1, 12.706), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert student_t_quantile(0.975, df) == pytest.approx(t, abs=2e-3)
    assert student_t_quantile(0.8, 4) == pytest.approx(0.941, abs=2e-3)
    assert student_t_cdf(0.0, 7) == 0.5 and student_t_cdf(-2.776, 4) == pytest.approx(0.025, abs=1e-4)


def test_interval_coverage_by_simulation():
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(2000):
        _, lo, hi = mean_ci(rng.normal(3.0, 2.0, 5))
        hits += lo <= 3.0 <= hi
    assert 0.93 < hits / 2000 < 0.97


def test_welch_difference_and_detectable_size():
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [3.0, 4.0, 5.0, 6.0, 7.0]
    d, lo, hi, se, df = welch_diff(a, b)
    assert d == 2.0 and se == pytest.approx(1.0) and df == pytest.approx(8.0)
    assert (lo, hi) == pytest.approx((2 - 2.306, 2 + 2.306), abs=2e-3)
    assert detectable_difference(1.0, 8.0) == pytest.approx(2.306 + 0.889, abs=3e-3)


def test_jonckheere_statistic_and_p_value():
    ordered = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    j, p = jonckheere(ordered, permutations=5000)
    assert j == 27 and p < 0.002  # every cross-group pair in order: the largest statistic of 9!/(3!3!3!) labelings
    j, p = jonckheere([[7, 8, 9], [4, 5, 6], [1, 2, 3]], permutations=5000)
    assert j == 0 and p > 0.99
    assert jonckheere([[1, 1], [1, 1]], permutations=100)[0] == 2.0  # ties count one half
    rng = np.random.default_rng(3)  # no ordering: p-values roughly uniform
    ps = [jonckheere([rng.normal(size=5) for _ in range(3)], permutations=400, seed=s)[1] for s in range(60)]
    assert 0.3 < np.mean(ps) < 0.7


def _exp(name, scenario, seed, ld, gnd, gdc, fault=None):
    metrics = {
        f"{stage}/{k}": v
        for stage in ("sft", "opd")
        for k, v in (
            ("loss_dispersion_mean", ld),
            ("grad_norm_dispersion_mean", gnd),
            ("grad_direction_consistency_mean", gdc),
            ("alarms", 0),
        )
    }
    ddp = {"scenario": scenario, "workers": 4, "seed": seed, "inject": {"kind": fault}}
    return {
        "rev": name,
        "name": name,
        "error": None,
        "experiments": None,
        "data": {
            "rev": name,
            "params": {"params.yaml": {"data": {"ddp": ddp}}},
            "metrics": {
                "reports/metrics.json": {"data": metrics},
                "data/live/sft/metrics.json": {"data": {"steps": 9}},
            },
        },
    }


def _show(runs):
    baseline = _exp("workspace", "S1-1", 0, 9.0, 9.0, 0.0)
    ranges = [{"revs": [_exp(n, *rest)], "executor": None, "name": n} for n, *rest in runs]
    return [{**baseline, "experiments": ranges}]


def _grid(shift: float, seeds=range(1, 6), control=True):
    rng = np.random.default_rng(1)
    runs = []
    for seed in seeds:
        for i, sc in enumerate(("S1-1", "S1-2", "S1-3")):
            runs.append(
                (
                    f"{sc}-{seed}",
                    sc,
                    seed,
                    0.1 + shift * i + rng.normal(0, 0.01),
                    0.5 + rng.normal(0, 0.02),
                    0.8 - shift * i + rng.normal(0, 0.01),
                )
            )
        if control:
            runs.append((f"c-{seed}", "S1-1", seed, 0.3 + rng.normal(0, 0.01), 0.9, 0.4, "shard_skew"))
    return _show(runs)


def test_collect_groups_scenarios_and_controls_by_seed():
    found = collect(_grid(0.0))
    assert sorted(found) == ["S1-1", "S1-2", "S1-3", "shard_skew"]
    assert [r["seed"] for r in found["S1-2"]] == [1, 2, 3, 4, 5]  # the baseline revision does not count


def test_render_reports_ordering_equivalence_and_the_control():
    md = render(collect(_grid(0.05)), "bash studies/scenario_sweep.sh")
    assert "positive control: shard_skew on one rank" in md and "(moved)" in md
    line = next(s for s in md.splitlines() if s.startswith("- **loss dispersion**"))
    assert float(re.search(r"p = ([0-9.e-]+)\. ", line).group(1)) < 0.01  # a clear ordering is found
    null = render(collect(_grid(0.0)), "cmd")
    line = next(s for s in null.splitlines() if s.startswith("- **loss dispersion**"))
    bound = float(line.split("within **±")[1].split("**")[0])
    assert 0 < bound < 0.05  # no effect: a tight equivalence bound around zero


def test_cli_reads_saved_experiments(tmp_path, capsys):
    src = tmp_path / "exp.json"
    src.write_text(json.dumps(_grid(0.0)))
    assert main(["scenarios", "--from", str(src), "--out", str(tmp_path / "s.md")]) == 0
    assert (tmp_path / "s.md").read_text().startswith("# Seed scenarios")
    src.write_text(json.dumps([]))
    assert main(["scenarios", "--from", str(src)]) == 1
    assert "scenario_sweep.sh" in capsys.readouterr().err
    assert math.isnan(mean_ci([1.0])[1])
