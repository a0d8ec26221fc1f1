"""studies/opd_ablation_report.py's arithmetic on a made-up ``dvc exp show --json``: the per-arm changes from the
shared start, OPD − control, and the arm's OPD change against the default's paired by seed, each against a
mean and t-interval computed here from the numbers put in."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from ars_opd.evaluation.stats import student_t_quantile

REPO = Path(__file__).resolve().parents[1]
F0 = 1e15  # FLOPs from scratch at the shared start (the SFT stage's)
START = {"exact_match": 0.48, "reverse_kl": 0.50, "start": True, "steps": 0, "flops": F0}
FLOPS_PER_STEP = {"opd": 3e12, "sft_continued": 1e12}  # an OPD step costs 3 control steps


def _exp(name: str, seed: int, opd_end: float, control_end: float) -> dict:
    def curve(end: float, arm: str) -> list[dict]:
        f = FLOPS_PER_STEP[arm]
        return [
            START,
            {"exact_match": (START["exact_match"] + end) / 2, "reverse_kl": 0.6, "steps": 50, "flops": F0 + 50 * f},
            {"exact_match": end, "reverse_kl": 0.4 + end, "steps": 100, "flops": F0 + 100 * f},
        ]

    metrics = {
        "opd": {"exact_match": opd_end},
        "sft_continued": {"exact_match": control_end},
        "curves": {"opd": curve(opd_end, "opd"), "sft_continued": curve(control_end, "sft_continued")},
    }
    return {
        "rev": f"rev-{name}",
        "name": name,
        "data": {
            "params": {"params.yaml": {"data": {"ddp": {"seed": seed}}}},
            "metrics": {"data/metrics/evaluate.json": {"data": metrics}},
        },
    }


S = START["exact_match"]


def _ci(x: list[float]) -> list[float]:
    n, m = len(x), sum(x) / len(x)
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    h = student_t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return [m, m - h, m + h]


def test_ablation_table_against_hand_computed_means(tmp_path):
    ends = {"default": ([0.12, 0.15, 0.10], [0.25, 0.29, 0.23]), "lr1e-4": ([0.47, 0.52, 0.44], [0.30, 0.28, 0.31])}
    revs = [
        _exp(f"abl-{arm}-seed{s}", s, opd[i], ctl[i])
        for arm, (opd, ctl) in ends.items()
        for i, s in enumerate((1, 2, 3))
    ]
    revs.append(_exp("lh-repeat-seed1", 1, 0.9, 0.9))  # another study's experiment: left out
    data = [{"rev": "workspace", "data": {}, "experiments": [{"name": None, "revs": revs}]}]
    src = tmp_path / "exps.json"
    src.write_text(json.dumps(data))
    out = subprocess.run(
        [sys.executable, str(REPO / "studies" / "opd_ablation_report.py"), str(src), "--out", str(tmp_path / "t.md")],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    lines = {d["arm"]: d for d in map(json.loads, out.stdout.splitlines())}
    assert set(lines) == {"default", "lr1e-4"}
    for arm, (opd, ctl) in ends.items():
        ln = lines[arm]
        assert ln["seeds"] == [1, 2, 3] and ln["start_exact_match"] == START["exact_match"]
        for key, want in (
            ("opd_change_exact_match", [e - START["exact_match"] for e in opd]),
            ("control_change_exact_match", [e - START["exact_match"] for e in ctl]),
            ("opd_minus_control_exact_match", [a - b for a, b in zip(opd, ctl)]),
            ("opd_change_reverse_kl", [0.4 + e - START["reverse_kl"] for e in opd]),
            # at the control's final FLOPs (100 control steps) OPD has taken 100/3 steps: 2/3 of the way from
            # its start to its step-50 point, (start + end) / 2
            (
                "opd_minus_control_equal_flops_exact_match",
                [S + (2 / 3) * ((S + a) / 2 - S) - b for a, b in zip(opd, ctl)],
            ),
        ):
            got = [ln[key]["mean"], *ln[key]["ci95"]]
            assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, _ci(want))), (arm, key)
            assert ln[key]["seeds"] == [1, 2, 3]
            assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(ln[key]["per_seed"], want)), (arm, key)
    paired = [a - b for a, b in zip(ends["lr1e-4"][0], ends["default"][0])]
    vs = lines["lr1e-4"]["opd_change_vs_default_exact_match"]
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip([vs["mean"], *vs["ci95"]], _ci(paired)))
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(vs["per_seed"], paired))
    table = (tmp_path / "t.md").read_text()
    assert "| lr1e-4 | 3 |" in table and "| default | 3 |" in table


def test_keep_carries_over_only_the_arms_measured_nowhere_here(tmp_path):
    opd, ctl = [0.12, 0.15, 0.10], [0.25, 0.29, 0.23]
    revs = [_exp(f"abl-default-seed{s}", s, opd[i], ctl[i]) for i, s in enumerate((1, 2, 3))]
    src = tmp_path / "exps.json"
    src.write_text(json.dumps([{"rev": "workspace", "data": {}, "experiments": [{"name": None, "revs": revs}]}]))
    q = {"mean": 0.1, "ci95": [0.0, 0.2], "per_seed": None, "seeds": [1, 2, 3]}
    old = [
        {"arm": "default", "seeds": [1, 2, 3], "opd_change_exact_match": q, "note": "stale: measured here again"},
        {"arm": "fkl", "seeds": [1, 2, 3], "opd_change_exact_match": q, "control_change_exact_match": q,
         "opd_minus_control_exact_match": q, "opd_change_reverse_kl": q, "note": "an earlier session"},
    ]  # fmt: skip
    keep = tmp_path / "old.jsonl"
    keep.write_text("".join(json.dumps(x) + "\n" for x in old))
    out = subprocess.run(
        [sys.executable, str(REPO / "studies" / "opd_ablation_report.py"), str(src), "--keep", str(keep)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert [x["arm"] for x in lines] == ["default", "fkl"]
    assert "note" not in lines[0] and lines[0]["opd_change_exact_match"]["per_seed"] is not None  # measured here
    assert lines[1] == old[1]  # carried over unchanged
