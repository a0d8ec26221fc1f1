"""The scenario comparison reads `dvc exp show --json` (its serialised ExpState/ExpRange shape)."""

from __future__ import annotations

import json

from ars_opd.cli import main
from ars_opd.evaluation.scenarios import collect, render


def _exp(name, scenario, ld, gnd, gdc, rev="abc"):
    metrics = {f"{stage}/{k}": v for stage in ("sft", "opd") for k, v in (
        ("loss_dispersion_mean", ld), ("grad_norm_dispersion_mean", gnd), ("grad_direction_consistency_mean", gdc),
        ("silent_steps", 0), ("loss_spikes", 1))}
    return {"rev": rev, "name": None, "error": None, "experiments": None, "data": {
        "rev": rev, "params": {"params.yaml": {"data": {"ddp": {"scenario": scenario, "workers": 2}}}},
        "metrics": {"reports/metrics.json": {"data": metrics}, "data/live/sft/metrics.json": {"data": {"steps": 9}}}}}


def _show(values):
    baseline = _exp(None, "S1-1", 9.0, 9.0, 0.0, rev="workspace")
    baseline["data"]["metrics"] = {}  # a baseline without report metrics is skipped
    ranges = [{"revs": [_exp(None, s, *v, rev=f"r{i}")], "executor": None, "name": f"exp-{s}"}
              for i, (s, v) in enumerate(values.items())]
    return [{**baseline, "experiments": ranges}]


def test_ordering_that_holds_and_one_that_does_not():
    found = collect(_show({"S1-1": (0.01, 0.1, 0.9), "S1-2": (0.02, 0.2, 0.8), "S1-3": (0.03, 0.3, 0.7)}))
    assert [found[s]["name"] for s in ("S1-1", "S1-2", "S1-3")] == ["exp-S1-1", "exp-S1-2", "exp-S1-3"]
    md = render(found, "dvc exp run ...")
    assert md.count("**holds**") == 6 and "does not hold" not in md
    found = collect(_show({"S1-1": (0.02, 0.1, 0.9), "S1-2": (0.01, 0.2, 0.95), "S1-3": (0.03, 0.3, 0.7)}))
    md = render(found, "cmd")
    assert "loss dispersion: paper's ordering S1-1 < S1-2 < S1-3 **does not hold** here (0.02, 0.01, 0.03)" in md
    assert "direction consistency: paper's ordering S1-1 > S1-2 > S1-3 **does not hold**" in md


def test_named_experiments_win_over_the_baseline_revision():
    data = _show({"S1-1": (0.5, 0.5, 0.5)})
    data[0]["data"]["metrics"] = {"reports/metrics.json": {"data": {"sft/loss_dispersion_mean": 9.0}}}
    assert collect(data)["S1-1"]["name"] == "exp-S1-1"
    data[0]["experiments"] = []
    assert collect(data)["S1-1"]["name"] == "workspace"  # no experiment: the baseline revision stands in


def test_missing_scenarios_are_named(tmp_path, capsys):
    data = _show({"S1-1": (0.01, 0.1, 0.9)})
    assert "Missing scenarios in the experiments found: ['S1-2', 'S1-3']" in render(collect(data), "cmd")
    src = tmp_path / "exp.json"
    src.write_text(json.dumps(data))
    assert main(["scenarios", "--from", str(src), "--out", str(tmp_path / "s.md")]) == 0
    assert (tmp_path / "s.md").read_text().startswith("# Seed scenarios")
    src.write_text(json.dumps([]))
    assert main(["scenarios", "--from", str(src)]) == 1
    assert "dvc exp run --queue" in capsys.readouterr().err
