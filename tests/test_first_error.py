"""A long-horizon study's report: where each model first goes wrong over seeds, and one section per family."""

from __future__ import annotations

import json

import numpy as np

from ars_opd.evaluation.distillation import as_family_section, merge_family_section, refresh_regime, render_study
from ars_opd.evaluation.first_error import step_table
from test_arms import _evaluate


def _with_steps(ev: dict, prefix: dict[str, list[float]]) -> dict:
    # 100 answers each; the share right at every step is the last step's share less 0.1 (some long answers
    # are wrong at a step that shorter references do not have)
    for model, p in prefix.items():
        ev.setdefault(model, {})["steps"] = {
            "answers": 100,
            "step_accuracy": float(np.mean(p)),
            "prefix_accuracy": p,
            "first_error": {"0": round(100 * (1 - p[0])), "none": round(100 * (p[-1] - 0.1))},
        }
    return ev


def _runs():
    runs = []
    for seed, (o, c) in enumerate([(0.9, 0.7), (0.8, 0.7), (0.85, 0.6)]):
        ev = _evaluate(1.0, 1.3)
        ev = _with_steps(ev, {"opd": [o, o - 0.2], "sft_continued": [c, c - 0.3], "teacher": [1.0, 0.98]})
        runs.append({"seed": seed, "evaluate": ev, "name": f"s{seed}"})
    return runs


def test_the_step_table_pairs_opd_and_the_control_by_seed():
    lines = step_table(_runs())
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ") and "---" not in line}
    assert "teacher" in rows and "SFT" not in rows  # a model without step metrics has no row
    # OPD − control, step accuracy: per seed mean(o, o-0.2) - mean(c, c-0.3) = o - c + 0.05
    diffs = [0.9 - 0.7 + 0.05, 0.8 - 0.7 + 0.05, 0.85 - 0.6 + 0.05]
    assert f"{np.mean(diffs):.1%}" in rows["OPD − control (paired)"]
    # right at every step: (o - 0.2 - 0.1) - (c - 0.3 - 0.1), the same as at the last step here
    assert f"{np.mean([d + 0.05 for d in diffs]):.1%}" in rows["OPD − control (paired)"]
    # the teacher's shares: right through step 1 is 100% in every seed, right at every step 88%; a share's
    # interval stays within [0, 100%]
    assert "| teacher | 99.0% [99.0%, 99.0%] | 100.0% [100.0%, 100.0%] | 88.0% [88.0%, 88.0%] |" in rows["teacher"]
    opd_first = [0.9, 0.8, 0.85]  # right through step 1: mean 85%, the t-interval's top (97.4%) is kept
    assert f"{np.mean(opd_first):.1%}" in rows["OPD"] and "[" in rows["OPD"]
    wide = step_table(
        [{"seed": s, "evaluate": _with_steps(_evaluate(1.0, 1.3), {"opd": [x, x]})} for s, x in enumerate([1.0, 0.4])]
    )
    row = next(line for line in wide if line.startswith("| OPD |"))
    assert row.count("[0.0%, 100.0%]") == 3  # clipped at both ends (unclipped: [-311%, 451%] for the first)


def test_the_sft_stage_has_no_row_when_the_arms_start_from_a_pinned_student():
    runs = _runs()
    for r in runs:
        _with_steps(r["evaluate"], {"sft": [0.1, 0.0]})
    assert any(line.startswith("| SFT |") for line in step_table(runs))
    pinned = [{**r, "start_is_sft": False} for r in runs]
    assert not any(line.startswith("| SFT |") for line in step_table(pinned))
    text, _ = render_study(pinned, "cmds", {})
    assert "pinned student" in text


def test_a_long_horizon_study_has_its_first_error_section_and_families_keep_their_own_sections(tmp_path):
    runs = _runs()
    text, _ = render_study(runs, "cmds", {"steps": "d/x.png", "first_error": "d/long/first_error.png"})
    assert "## Where each model first goes wrong" in text and "![answers right through each step]" in text
    plain, _ = render_study([{**r, "evaluate": _evaluate(1.0, 1.3)} for r in runs], "cmds", {})
    assert "first goes wrong" not in plain  # the default tasks have no steps
    text = text.replace("cmds", "cmds\n# a shell comment, not a heading")
    long = as_family_section(text, "long-horizon")
    assert "\n# a shell comment, not a heading" in long
    assert long.startswith("## Task family: long-horizon\n") and "### Where each model first goes wrong" in long
    doc = merge_family_section("", "default", as_family_section(plain, "default"))
    doc = merge_family_section(doc, "long-horizon", long)
    assert doc.startswith("# Did on-policy distillation beat more SFT at equal budget?")
    assert doc.count("## Task family: ") == 2 and doc.index("family: default") < doc.index("family: long-horizon")
    again = merge_family_section(doc, "default", as_family_section(plain.replace("cmds", "other"), "default"))
    # the long-horizon section kept, its paragraph on the regime quoting its own tables (rendered alone, it
    # had no study to quote)
    assert again.count("## Task family: default") == 1 and "other" in again and refresh_regime(long).strip() in again
    assert refresh_regime(long) != long


def test_the_command_writes_a_family_section_with_its_figure(tmp_path):
    from ars_opd.cli import main

    runs = _runs()

    def rev(name, seed, ev):
        return {
            "rev": name,
            "name": name,
            "data": {
                "params": {"params.yaml": {"data": {"ddp": {"seed": seed}}}},
                "metrics": {"data/metrics/evaluate.json": {"data": ev}},
            },
        }

    base = rev("workspace", 0, runs[0]["evaluate"])
    base["experiments"] = [
        {"name": f"s{r['seed']}", "revs": [rev(f"s{r['seed']}", r["seed"], r["evaluate"])]} for r in runs[1:]
    ]
    src, out = tmp_path / "exps.json", tmp_path / "reports" / "distillation.md"
    src.write_text(json.dumps([base]))
    out.parent.mkdir()
    out.write_text("# Did on-policy distillation beat more SFT at equal budget?\n\n## Task family: default\n\nold\n")
    assert main(["distillation", "--from", str(src), "--out", str(out), "--family", "long-horizon"]) == 0
    text = out.read_text()
    assert "## Task family: default\n\nold" in text and "## Task family: long-horizon" in text
    assert (tmp_path / "reports/distillation/long_horizon/first_error.png").stat().st_size > 0
    assert "(distillation/long_horizon/first_error.png)" in text
