"""The pruned-recovery study's page (ars_opd.evaluation.recovery) and its runner (studies/pruned_recovery.py).

The page's numbers are checked against an independent computation: per-seed differences taken by hand from the
evaluations, their mean and a t-interval from the closed form of Student's t at 2 degrees of freedom, not from
the module's own mean_ci.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from ars_opd.evaluation import recovery
from micro import committed_params, load_study

REPO = Path(__file__).resolve().parents[1]


def _curve(steps, flops, rkl, em):
    return [
        {"steps": s, "flops": f, "reverse_kl": r, "exact_match": e, "teacher_nll": 1.0}
        for s, f, r, e in zip(steps, flops, rkl, em)
    ]


def _evaluation(arm_rkl: float, ctl_rkl: float, arm_em: float, ctl_em: float) -> dict:
    """An evaluate stage's metrics: the arm as ``opd``, the seed's control as ``sft_continued``."""
    return {
        "opd": {"reverse_kl": arm_rkl, "exact_match": arm_em, "teacher_nll": 0.5, "budget": {"steps": 120}},
        "sft_continued": {"reverse_kl": ctl_rkl, "exact_match": ctl_em, "teacher_nll": 0.4, "budget": {"steps": 120}},
        "teacher": {"matmul_parameters": 1e8},
        "curves": {
            "opd": _curve([80, 140, 200], [1e12, 3e12, 5e12], [2.0, 1.6, arm_rkl], [0.3, 0.35, arm_em]),
            "sft_continued": _curve([80, 140, 200], [1e12, 2e12, 3e12], [2.0, 1.7, ctl_rkl], [0.3, 0.36, ctl_em]),
        },
    }


def _t_interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of three values, independent of ars_opd.evaluation.stats: Student's t with 2
    degrees of freedom has the closed-form CDF 1/2 + t / (2 sqrt(2 + t^2)), so its 0.975 quantile is
    a sqrt(2 / (1 - a^2)) with a = 0.95 (4.3027)."""
    assert len(xs) == 3
    x = torch.tensor(xs, dtype=torch.float64)
    q = 0.95 * math.sqrt(2 / (1 - 0.95**2))
    half = q * x.std(unbiased=True).item() / math.sqrt(3)
    m = x.mean().item()
    return m, m - half, m + half


ARM_RKL = {"opd": [1.10, 1.20, 1.15], "kd": [1.60, 1.66, 1.70]}
CTL_RKL = [1.40, 1.45, 1.50]
EM = {"opd": [0.40, 0.42, 0.38], "kd": [0.40, 0.43, 0.41]}
CTL_EM = [0.40, 0.41, 0.42]


@pytest.fixture
def by_arm():
    return {
        arm: [
            {"name": f"{arm}-{s}", "seed": s, "evaluate": _evaluation(ARM_RKL[arm][i], CTL_RKL[i], EM[arm][i], c)}
            for i, (s, c) in enumerate(zip((1, 2, 3), CTL_EM))
        ]
        for arm in ("opd", "kd")
    }


def _cells(text: str, section: str, arm_label: str) -> list[str]:
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in body.splitlines() if line.startswith(f"| {arm_label} |"))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def _cells_by_column(text: str, section: str, arm_label: str) -> dict[str, str]:
    """{column header: the arm's cell} of the first table in ``section``."""
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in body.splitlines() if line.startswith("| arm |"))
    return dict(zip([c.strip() for c in header.strip("|").split("|")][1:], _cells(text, section, arm_label)))


def _numbers(cell: str) -> list[float]:
    cell = re.sub(r"\(n = \d+\)", "", cell)  # the seed count is not a value
    return [float(x) for x in re.findall(r"-?\d+\.?\d*(?:e-?\d+)?", cell)]


def test_every_arm_against_the_control_with_paired_seed_differences(by_arm):
    text = recovery.render(
        by_arm, {}, {"command": "python studies/pruned_recovery.py", "seconds": 60, "steps": 120}, {}
    )
    for arm in ("opd", "kd"):
        rkl, em, *_ = _cells(text, "At equal steps", recovery.label(arm))
        arm_mean, arm_lo, arm_hi, d_mean, d_lo, d_hi = _numbers(rkl.replace("− control:", ""))
        assert (arm_mean, arm_lo, arm_hi) == pytest.approx(_t_interval(ARM_RKL[arm]), abs=6e-4)
        diffs = [a - c for a, c in zip(ARM_RKL[arm], CTL_RKL)]
        assert (d_mean, d_lo, d_hi) == pytest.approx(_t_interval(diffs), abs=6e-4)
    control = _cells(text, "At equal steps", recovery.label(recovery.CONTROL))
    assert _numbers(control[0]) == pytest.approx(_t_interval(CTL_RKL), abs=6e-4)
    verdict = text.split("## Verdict\n", 1)[1].split("\n## ", 1)[0]
    opd_line = next(line for line in verdict.splitlines() if recovery.label("opd") in line)
    kd_line = next(line for line in verdict.splitlines() if recovery.label("kd") in line)
    # OPD's reverse KL is below the control's on every seed, KD's above: both resolved, opposite ways
    assert "at equal steps, reverse KL to the teacher (per token): better than the control" in opd_line
    assert "at equal steps, reverse KL to the teacher (per token): worse than the control" in kd_line
    # exact match differences straddle 0 for OPD: nothing resolved
    assert "at equal steps, exact match: no difference resolved" in opd_line


def test_equal_flops_reads_each_arm_off_its_curve_at_the_cheaper_total(by_arm):
    text = recovery.render(by_arm, {}, {"seconds": 1}, {})
    # the control's curve ends at 3e12 FLOPs, cheaper than the arm's 5e12: the arm is read at 3e12, i.e. half
    # way between its 1e12 and 5e12 points... (1.6 at 3e12, its middle point); the control at its end
    rkl = _cells(text, "At equal FLOPs", recovery.label("opd"))[0]
    assert _numbers(rkl)[0] == pytest.approx(1.6)
    assert _numbers(rkl)[3] == pytest.approx(1.6 - sum(CTL_RKL) / 3)


def test_the_figures_length_cannot_game_are_tabled_and_judged_per_seed_pair(by_arm):
    """Reverse KL at the teacher's prefixes (whole and first sentence), the own samples' reverse KL per sequence
    and sampled exact match get their own columns and paired intervals, and verdict clauses where the page judges
    them; the own samples' EOS rate and length a table of their own (t-intervals: the closed form)."""
    fixed = {"opd": [0.50, 0.55, 0.52], "kd": [0.90, 0.95, 0.93]}
    ctl_fixed, sampled, ctl_sampled = [0.70, 0.72, 0.71], [0.30, 0.33, 0.31], [0.20, 0.22, 0.21]
    first, ctl_first = [0.61, 0.64, 0.60], [0.80, 0.79, 0.83]
    per_seq, ctl_per_seq = [31.0, 35.5, 30.2], [22.0, 24.5, 23.1]
    eos, ctl_eos = [0.1, 0.0, 0.2], [0.9, 0.8, 0.85]
    for arm, runs in by_arm.items():
        for i, r in enumerate(runs):
            opd, ctl = r["evaluate"]["opd"], r["evaluate"]["sft_continued"]
            opd.update(
                reverse_kl_fixed_prefix=fixed[arm][i],
                reverse_kl_first_sentence=first[i],
                reverse_kl_per_sequence=per_seq[i],
                exact_match_sampled=sampled[i],
                own_eos_rate=eos[i],
            )
            ctl.update(
                reverse_kl_fixed_prefix=ctl_fixed[i],
                reverse_kl_first_sentence=ctl_first[i],
                reverse_kl_per_sequence=ctl_per_seq[i],
                exact_match_sampled=ctl_sampled[i],
                own_eos_rate=ctl_eos[i],
            )
    text = recovery.render(by_arm, {}, {"seconds": 1}, {})
    cells = _cells_by_column(text, "At equal steps", recovery.label("opd"))
    prefix = cells["reverse KL at the teacher's prefixes (per token)"]
    sampled_cell = cells["exact match, sampled at temperature 1"]
    assert _numbers(prefix.replace("− control:", "")) == pytest.approx(
        [*_t_interval(fixed["opd"]), *_t_interval([a - c for a, c in zip(fixed["opd"], ctl_fixed)])], abs=6e-4
    )
    for column, arm_values, ctl_values, tol in (
        ("the same, their first sentence", first, ctl_first, 6e-4),
        ("reverse KL on own samples (per sequence)", per_seq, ctl_per_seq, 0.006),  # 4 digits of ~30
    ):
        assert _numbers(cells[column].replace("− control:", "")) == pytest.approx(
            [*_t_interval(arm_values), *_t_interval([a - c for a, c in zip(arm_values, ctl_values)])], abs=tol
        )
    # percentages: exact match is shown in points
    assert _numbers(sampled_cell.replace("− control:", ""))[3:] == pytest.approx(
        [100 * x for x in _t_interval([a - c for a, c in zip(sampled, ctl_sampled)])], abs=0.06
    )
    verdict = text.split("## Verdict\n", 1)[1].split("\n## ", 1)[0]
    opd_line = next(line for line in verdict.splitlines() if recovery.label("opd") in line)
    kd_line = next(line for line in verdict.splitlines() if recovery.label("kd") in line)
    assert "at equal steps, reverse KL at the teacher's prefixes (per token): better than the control" in opd_line
    assert "at equal steps, reverse KL at the teacher's prefixes (per token): worse than the control" in kd_line
    assert "at equal steps, exact match, sampled at temperature 1: better than the control" in opd_line
    own = text.split("How the models' own samples", 1)[1].split("\n## ", 1)[0]
    row = {line.split("|")[1].strip(): line.split("|")[2] for line in own.splitlines() if line.startswith("| ")}
    assert _numbers(row[recovery.label("opd")]) == pytest.approx([100 * x for x in _t_interval(eos)], abs=0.06)
    assert _numbers(row[recovery.label(recovery.CONTROL)]) == pytest.approx(
        [100 * x for x in _t_interval(ctl_eos)], abs=0.06
    )


def test_rollout_dashboards_use_only_the_steps_on_the_students_own_samples():
    seed_a = pd.DataFrame(
        {
            "step": [1, 2],
            "task/on_policy": [1.0, 1.0],
            "task/response_length": [10.0, 20.0],
            "task/divergence_first_half": [1.0, 3.0],
        }
    )
    # seed b trained on the teacher's completions at step 2 (GKD): that row describes the teacher's text
    seed_b = pd.DataFrame(
        {
            "step": [1, 2],
            "task/on_policy": [1.0, 0.0],
            "task/response_length": [30.0, 99.0],
            "task/divergence_first_half": [2.0, 9.0],
        }
    )
    teacher_text = [f.assign(**{"task/on_policy": 0.0}) for f in (seed_a, seed_b)]
    md = "\n".join(recovery.rollout_sections({"gkd": [seed_a, seed_b], "kd": teacher_text}, label=recovery.label))
    assert recovery.label("kd") + " (" not in md  # an arm with no rollouts (λ = 0) has no dashboard
    rows = [line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert _numbers(rows[0].split("|")[2])[0] == 20.0 and _numbers(rows[0].split("|")[3])[0] == 1.5  # both seeds
    assert _numbers(rows[1].split("|")[2])[0] == 20.0 and _numbers(rows[1].split("|")[3])[0] == 3.0  # seed a only
    assert "mean length (tokens) 20 → 20" in md


def test_run_params_set_the_arm_the_seed_and_the_studys_keys():
    sys.path.insert(0, str(REPO / "studies"))
    try:
        import pruned_recovery as pr
    finally:
        sys.path.remove(str(REPO / "studies"))
    base = committed_params()
    params = pr.run_params(base, [("opd.steps", 7), ("ddp.workers", 1)], seed=3, arm="gkd")
    assert params["opd"]["steps"] == 7 and params["ddp"]["workers"] == 1 and params["ddp"]["seed"] == 3
    assert params["opd"]["beta"] == 0.5 and params["opd"]["on_policy_fraction"] == 0.5
    control = pr.run_params(base, [], seed=3, arm="sft")
    assert control["opd"] == base["opd"]  # the control's loop is the opd section, unchanged
    assert json.dumps(base) == json.dumps(committed_params())
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        pr.parse_set(["opd.steps"])


def test_every_cross_tokenizer_arm_is_valid_over_the_larger_teacher_profile():
    """profiles/larger_teacher.yaml turns the span baseline on; each cross-tokenizer arm sets it as its name says
    (the span sampled-token arm without, the leave-one-out arm with, cross_vocab without: it has no credit), so the
    study runs every arm over that profile."""
    from ars_opd.config import OPDConfig, check_objective, parse_section
    from ars_opd.profiles import merged, read_profile

    sys.path.insert(0, str(REPO / "studies"))
    try:
        import pruned_recovery as pr
    finally:
        sys.path.remove(str(REPO / "studies"))
    base = merged(committed_params(), read_profile(REPO / "profiles/larger_teacher.yaml"))
    want = {"xtok_sampled": "none", "xtok_sampled_loo": "leave_one_out", "xtok_vocab": "none"}
    assert set(want) == set(recovery.CROSS_TOKENIZER_ARMS) - {recovery.CONTROL}
    for arm, baseline in want.items():
        opd = parse_section(OPDConfig, pr.run_params(base, [], seed=1, arm=arm)["opd"], "opd")
        assert opd.span_baseline == baseline and opd.cross_tokenizer
        check_objective(opd)


def test_the_trainer_side_runs_without_the_endpoint_client():
    """The training and evaluation stages import no HTTP client unless a run talks to an endpoint: a machine with
    torch and transformers alone (a GPU node) runs them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('openai', 'datasets'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import stages.models, stages.sft, stages.opd, stages.sft_continued, stages.evaluate\n"
        "import ars_opd.training.opd.stage, ars_opd.training.sft, ars_opd.evaluation.evaluate, ars_opd.models.prepare\n"
        "import ars_opd.rollouts.schedule, ars_opd.training.opd.teacher_setup\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _bench():
    return load_study("pruned_recovery")


def test_a_stage_is_done_only_with_the_params_it_ran_with(tmp_path):
    pr = _bench()
    (tmp_path / "params.yaml").write_text("opd:\n  steps: 60\n")
    marker = tmp_path / f"{pr.DONE}-opd"
    marker.write_text(json.dumps({"seconds": 1.0, "params_sha256": pr.params_sha(tmp_path)}))
    assert pr.finished(tmp_path, "opd")
    (tmp_path / "params.yaml").write_text("opd:\n  steps: 90\n")  # a rerun with other steps
    assert not pr.finished(tmp_path, "opd")
    marker.write_text("12.5")  # a marker without the params' hash proves nothing
    assert not pr.finished(tmp_path, "opd")


def test_keep_params_leaves_a_runs_params_and_so_its_finished_stages(tmp_path):
    """A study begun by older code is finished by newer code without retraining: with keep_params a run that has
    a params.yaml keeps its bytes (its stages' markers still match), a new run gets the study's params; without
    it the params are rewritten as the code now writes them (here: a key added since), and the run is not done."""
    pr = _bench()
    base = committed_params()
    source = tmp_path / "start"
    source.mkdir()
    (source / "params.yaml").write_text(pr.yaml.safe_dump(base, sort_keys=False))
    source_paths = pr.load_params(source / "params.yaml", base=source, sections=("paths",)).paths
    for name in pr.SHARED:  # the start's outputs the runs link to
        (source / getattr(source_paths, name)).mkdir(parents=True, exist_ok=True)
    run = tmp_path / "study" / "seed-1" / "opd"
    older = {k: v for k, v in pr.run_params(base, [], 1, "opd").items() if k != "teachers"}
    run.mkdir(parents=True)
    (run / "params.yaml").write_text(pr.yaml.safe_dump(older, sort_keys=False))
    (run / f"{pr.DONE}-opd").write_text(json.dumps({"seconds": 1.0, "params_sha256": pr.params_sha(run)}))
    before = (run / "params.yaml").read_bytes()
    assert pr.prepare_run(run, pr.run_params(base, [], 1, "opd"), source, None, keep_params=True)
    assert (run / "params.yaml").read_bytes() == before and pr.finished(run, "opd")
    fresh = tmp_path / "study" / "seed-2" / "opd"
    assert not pr.prepare_run(fresh, pr.run_params(base, [], 2, "opd"), source, None, keep_params=True)
    assert pr.yaml.safe_load((fresh / "params.yaml").read_text())["ddp"]["seed"] == 2
    # a kept run that disagrees with the command on the study's own keys stops the study, naming them
    sharp = tmp_path / "study" / "seed-1" / "opd_sharp"
    sharp.mkdir(parents=True)
    (sharp / "params.yaml").write_text(pr.yaml.safe_dump(pr.run_params(base, [("opd.steps", 60)], 1, "opd_sharp")))
    keys = pr.study_keys([("opd.steps", 40)], "opd_sharp")
    assert keys[:2] == ["opd.steps", "ddp.seed"] and "opd.teacher_temperature" in keys
    # a key the kept run lacks differs from one the command sets to null
    assert pr.param({"opd": {"x": None}}, "opd.x", pr.ABSENT) is None and pr.param({}, "opd.x", pr.ABSENT) is pr.ABSENT
    # the control only trains (each arm's evaluate scores it), so a change of evaluation settings keeps it
    evals = [("opd.steps", 60), ("evaluate.max_examples", 100)]
    assert pr.study_keys(evals, pr.CONTROL) == ["opd.steps", "ddp.seed"]
    assert "evaluate.max_examples" in pr.study_keys(evals, "opd")
    control = tmp_path / "study" / "seed-1" / pr.CONTROL
    control.mkdir(parents=True)
    (control / "params.yaml").write_text(pr.yaml.safe_dump(pr.run_params(base, [("opd.steps", 60)], 1, pr.CONTROL)))
    assert pr.prepare_run(
        control, pr.run_params(base, evals, 1, pr.CONTROL), source, None, True, pr.study_keys(evals, pr.CONTROL)
    )
    with pytest.raises(SystemExit, match=r"opd\.steps \(60 there, 40 here\)"):
        pr.prepare_run(sharp, pr.run_params(base, [("opd.steps", 40)], 1, "opd_sharp"), source, None, True, keys)
    assert not pr.prepare_run(run, pr.run_params(base, [], 1, "opd"), source, None)
    assert (run / "params.yaml").read_bytes() != before and not pr.finished(run, "opd")
    # the page names the kept runs
    text = recovery.render({}, {}, {"seconds": 1, "kept_params": ["seed-1/opd"]}, {})
    assert "1 run(s) kept the params they were trained with" in text and "`seed-1/opd`" in text


def test_a_failed_stage_is_counted_and_leaves_no_marker(tmp_path):
    pr = _bench()
    run = tmp_path / "study" / "seed-1" / "opd"
    run.mkdir(parents=True)
    (run / "params.yaml").write_text("{}\n")
    runner = pr.Runner(jobs=1, threads=None)
    runner.stage(run, "no_such_stage", runner.env(tmp_path / "cache"))
    assert runner.failed == ["seed-1/opd:no_such_stage"]
    assert not (run / f"{pr.DONE}-no_such_stage").exists() and not runner.ran


def test_the_page_names_runs_that_did_not_finish(by_arm):
    text = recovery.render(by_arm, {}, {"seconds": 1, "missing": ["seed-3/gkd"]}, {})
    assert "1 run(s) did not finish" in text and "`seed-3/gkd`" in text
    two = {"opd": by_arm["opd"][:2]}
    cell = _cells(recovery.render(two, {}, {"seconds": 1}, {}), "At equal steps", recovery.label("opd"))[0]
    assert "(n = 2)" in cell


def test_the_diagnosis_section_shows_each_measurement():
    """studies/opd_collapse.py's lines rendered: the EOS rates, the push per divergence, the bf16 teacher, and each
    short run's change against the old OPD (found by its arm name) with its alarm."""
    lines = [
        {
            "kind": "eos_rates",
            "teacher/greedy/48": 0.5,
            "teacher/sampled/48": 0.25,
            "teacher/greedy/128": 0.75,
            "teacher/sampled/128": 0.625,
            "start/greedy/48": 0.9,
            "start/sampled/48": 0.6,
            "start/greedy/128": 1.0,
            "start/sampled/128": 0.7,
        },
        {
            "kind": "eos_gradient",
            "rollouts": 64,
            "student_eos_rate": 0.6,
            "beta=1.0": {
                "ends_teacher_would_not": {"positions": 7, "mean_push": -0.125},
                "teacher_would_end": {"positions": 3, "mean_push": 0.0625},
                "per_rollout_mean_push": -0.5,
            },
        },
        {"kind": "bf16_teacher", "rows": 10, "tokens": 200, "nll_fp32": 0.6, "nll_bf16": 0.7, "kl_fp32_bf16": 0.03},
        {
            "kind": "short_run",
            "arm": "opd",
            "steps": 12,
            "opd": {"lr": 1e-4, "beta": 1.0},
            "eos_rate_start": 0.5,
            "eos_rate_end": 0.0,
            "alarm": {"step": 7, "kind": "stopped_ending", "p": 1e-5},
        },
        {
            "kind": "short_run",
            "arm": "opd_fkl",
            "steps": 9,
            "opd": {"lr": 1e-4, "beta": 0.0},
            "eos_rate_start": 0.5,
            "eos_rate_end": 0.75,
            "alarm": None,
        },
    ]
    md = "\n".join(recovery.diagnosis_section(lines))
    assert "| teacher | 50.0% | 25.0% | 75.0% | 62.5% |" in md
    assert "| reverse KL (β = 1) | -0.125 (n = 7) | 0.0625 (n = 3) | -0.5 |" in md
    assert "0.6 (fp32) against 0.7 (bf16)" in md and "0.03 per token" in md
    assert "| opd | none (old OPD) | 12 | 50.0% → 0.0% |" in md and "step 7 (stopped ending)" in md
    assert "| opd_fkl | beta = 0.0 | 9 | 50.0% → 75.0% |" in md


def test_the_diagnosis_section_shows_each_precision_run_seed_by_seed():
    """studies/opd_collapse.py's precision runs rendered: one row per run and seed, with its group, precision,
    first EOS rates, collapse step, steps that ended nothing, its end and its alarm; no table without them."""
    lines = [
        {
            "kind": "precision_run",
            "group": "H200, bf16",
            "seed": "seed-2",
            "steps": 60,
            "opd": {"precision": "auto", "teacher_dtype": "auto"},
            "eos_first": [0.75, 0.25, 0.0, 0.0],
            "collapse_step": 3,
            "steps_none_ended": 57,
            "eos_rate_end": 0.0,
            "entropy_start": None,
            "entropy_end": None,
            "teacher_logprob_start": -3.5,
            "teacher_logprob_end": -5.25,
            "alarm": {"step": 6, "kind": "stopped_ending", "p": 1e-6},
        },
        {
            "kind": "precision_run",
            "group": "CPU, bf16",
            "seed": "seed-1",
            "steps": 60,
            "opd": {"precision": "bf16", "teacher_dtype": "bf16"},
            "eos_first": [0.5, 0.625],
            "collapse_step": None,
            "steps_none_ended": 1,
            "eos_rate_end": 0.25,
            "entropy_start": 2.5,
            "entropy_end": 3.0,
            "teacher_logprob_start": -3.5,
            "teacher_logprob_end": -4.0,
            "alarm": None,
        },
    ]
    md = "\n".join(recovery.diagnosis_section(lines))
    assert "### The GPU's precision path on this CPU" in md and "first 4 on-policy steps" in md
    assert "for 5 steps in a row" in md
    assert "| H200, bf16 | seed-2 | auto, auto | 0.75 0.25 0.00 0.00 | 3 | 57 of 60 | 0.0% | n/a → n/a " in md
    assert "| -3.5 → -5.25 | step 6 (stopped ending) |" in md
    assert "| CPU, bf16 | seed-1 | bf16, bf16 | 0.50 0.62 | none | 1 of 60 | 25.0% | 2.5 → 3 | -3.5 → -4 | none |" in md
    assert "precision path" not in "\n".join(recovery.diagnosis_section(lines[:0]))


def test_every_arm_sets_opd_keys_and_every_committed_run_has_its_arms_settings():
    """An arm's name labels its runs on the page: each arm's overrides are keys of the opd section, and every run
    committed under reports/{pruned_recovery,pruned_recovery_start2,larger_teacher}/runs trained with the settings
    its arm's name stands for (a run made as an ``--extra-arm`` and registered later under a name keeps its label
    honest only if the two agree)."""
    import dataclasses

    import yaml

    from ars_opd.config import OPDConfig

    fields = {f.name for f in dataclasses.fields(OPDConfig)}
    for name, (_, _, overrides) in recovery.ARMS.items():
        assert set(overrides or {}) <= fields, (name, set(overrides or {}) - fields)
    reports = Path(__file__).resolve().parents[1] / "reports"
    checked = {}
    for study in ("pruned_recovery", "pruned_recovery_start2", "larger_teacher"):
        checked[study] = 0
        for params_file in sorted((reports / study / "runs").glob("seed-*/*/params.yaml")):
            arm = params_file.parent.name
            opd = yaml.safe_load(params_file.read_text())["opd"]
            for key, value in (recovery.ARMS[arm][2] or {}).items():
                assert opd.get(key) == value, (str(params_file), key, opd.get(key), value)
                checked[study] += 1
    assert checked["pruned_recovery"] >= 3 * 3 * 4  # three seeds of the old OPD, sharpened teacher, GKD, λ = 0.5
    assert checked["larger_teacher"] >= 3 * 2 * 5  # three seeds of the baselined span arm and of cross_vocab
    # three seeds of the anchored sharp arm, of λ = 0.25, of the anchor alone, of the sharpened teacher alone, of
    # λ = 0.1 and of the anchor at weight 1
    assert checked["pruned_recovery_start2"] >= 3 * (6 + 3 + 5 + 4 + 3 + 5)


def test_a_cross_tokenizer_study_says_its_fixed_prefix_figures_cannot_be_taken(by_arm):
    """Runs across tokenizers have no fixed-prefix reverse KL (no shared vocabulary): the page says so, and keeps
    "predates" for what an older evaluation did not take; a same-tokenizer study's missing figures predate it."""
    fixed = [
        lbl for k, lbl, _ in recovery.STUDY_METRICS if k in ("reverse_kl_fixed_prefix", "reverse_kl_first_sentence")
    ]
    assert len(fixed) == 2

    def missing_lines(text: str) -> tuple[str, str]:
        across = next((line for line in text.splitlines() if line.startswith("Not measurable across")), "")
        older = next((line for line in text.splitlines() if "predates them" in line), "")
        return across, older

    for runs in by_arm.values():
        for r in runs:
            for entry in (r["evaluate"]["opd"], r["evaluate"]["sft_continued"]):
                entry.update(reverse_kl_per_sequence=7.0, exact_match_sampled=0.4, own_eos_rate=0.8)
    across, older = missing_lines(recovery.render(by_arm, {}, {"seconds": 1}, {}))
    assert across == "" and all(lbl in older for lbl in fixed)  # same-tokenizer runs: an older evaluation

    for runs in by_arm.values():
        for r in runs:
            r["evaluate"]["reverse_kl_kind"] = "sampled_cross_tokenizer"
    across, older = missing_lines(recovery.render(by_arm, {}, {"seconds": 1}, {}))
    assert all(lbl in across for lbl in fixed) and "share none" in across
    assert "own samples" not in older and not any(lbl in older for lbl in fixed)
    assert "their mean length (tokens)" in older  # own_length: not taken by these runs, so it still predates them

    by_arm["opd"][0]["evaluate"]["reverse_kl_kind"] = "exact"  # one same-tokenizer run: no claim about tokenizers
    across, older = missing_lines(recovery.render(by_arm, {}, {"seconds": 1}, {}))
    assert across == "" and all(lbl in older for lbl in fixed)


def test_teacher_cache_seeds_a_new_start_and_never_replaces_one(tmp_path):
    """--teacher-cache puts an earlier start's answers where this start's teacher_gen reads them, byte for byte;
    a start that has its own cache keeps it; a missing file is refused in one line."""
    pr = _bench()
    start = tmp_path / "start"
    start.mkdir()
    (start / "params.yaml").write_text(pr.yaml.safe_dump(committed_params(), sort_keys=False))
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text('{"key": "a", "request": {}, "response": {"content": "x"}}\n')
    target = start / pr.load_params(start / "params.yaml", base=start, sections=("paths",)).paths.teacher_cache
    assert pr.seed_teacher_cache(start, earlier) and target.read_bytes() == earlier.read_bytes()
    target.write_text("its own\n")
    assert not pr.seed_teacher_cache(start, earlier) and target.read_text() == "its own\n"
    with pytest.raises(SystemExit, match="no such file"):
        pr.seed_teacher_cache(start, tmp_path / "absent.jsonl")


def test_the_committed_teacher_answers_are_the_pinned_teachers_on_every_prompt():
    """reports/larger_teacher/runs/start/teacher_answers.jsonl, which --teacher-cache seeds a new start with: one
    greedy answer of the pinned 0.5B file for each natural prompt, each under the sha256 of its own request
    (recomputed here from canonical JSON, not by the cache's code), so teacher_gen reads back exactly these."""
    from ars_opd.models.split_file import QWEN_CODER

    runs = REPO / "reports" / "larger_teacher" / "runs"
    lines = [json.loads(line) for line in (runs / "start" / "teacher_answers.jsonl").read_text().splitlines()]
    profile = yaml.safe_load((REPO / "profiles" / "larger_teacher.yaml").read_text())
    prompts = {json.loads(line)["prompt"] for line in (REPO / "inputs" / "natural_prompts.jsonl").open()}
    held_out = {json.loads(line)["messages"][-1]["content"] for line in (runs / "start" / "eval.jsonl").open()}
    asked = []
    for entry in lines:
        request = entry["request"]
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert entry["key"] == hashlib.sha256(canonical.encode()).hexdigest()
        assert request["model_revision"] == QWEN_CODER["qwen-0.5b"].sha256
        assert request["sampling"]["temperature"] == 0.0
        assert request["sampling"]["max_tokens"] == profile["teacher_gen"]["max_tokens"]
        assert entry["response"]["content"] and entry["response"]["finish_reason"] in ("stop", "length")
        asked.append(request["messages"][-1]["content"])
    assert len(asked) == len(set(asked)) and set(asked) == prompts and held_out <= prompts


def test_the_shared_models_table_names_a_complete_student_as_such(by_arm):
    """The first row of the shared-models table is the base student: "pruned base" for the real profile's pruned
    copy of the teacher, not for the cross-family study's complete SmolLM2 (read from each committed run's params)."""
    pr = _bench()
    runs = REPO / "reports"
    assert pr.base_label(runs / "pruned_recovery/runs/seed-1/opd/params.yaml") == "pruned base"
    complete = pr.base_label(runs / "larger_teacher/runs/seed-1/xtok_sampled_loo/params.yaml")
    assert "pruned" not in complete
    for runs_ in by_arm.values():
        for r in runs_:
            r["evaluate"]["base"] = {"reverse_kl": 1.2, "exact_match": 0.5}
    for name in ("pruned base", complete):
        table = recovery.render(by_arm, {}, {"seconds": 1, "base": name}, {}).split("The shared models", 1)[1]
        first_row = next(line for line in table.splitlines() if line.startswith("| ") and "model |" not in line)
        assert first_row.startswith(f"| {name} | ")


def test_precision_runs_finds_the_collapse_step_and_the_steps_that_ended_nothing(tmp_path):
    """studies/opd_collapse.py's precision runs on a made-up step log: the collapse step is the first on-policy step
    of five in a row that ended nothing (a four-step stall before it is not one), steps on the teacher's text are
    not rollouts, and the end rate is over the last 12 on-policy steps; each figure recounted here by hand."""
    import importlib.util

    import yaml

    path = Path(__file__).resolve().parents[1] / "studies" / "opd_collapse.py"
    spec = importlib.util.spec_from_file_location("opd_collapse_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    ended = [4, 3, 0, 0, 0, 0, 5, 2, 0, 0, 0, 0, 0, 0, 1, 2, 0, 3, 1, 1]  # of 8 rollouts, on-policy steps only
    rows, step = [], 0
    for i, k in enumerate(ended):
        if i == 10:  # one step on the teacher's text: no rollouts, not counted
            rows.append({"step": step, "task/on_policy": 0.0, "loss": 1.0})
            step += 1
        rows.append({"step": step, "task/on_policy": 1.0, "task/eos_rate": k / 8, "task/rollouts": 8, "loss": 1.0})
        rows[-1].update({"task/response_length": 48.0 - 2 * k, "task/truncation_rate": 1 - k / 8})
        rows[-1].update({"task/teacher_logprob": -3.0 - i / 10})
        step += 1
    run = tmp_path / "seed-1" / "opd_bf16"
    (run / "data" / "opd" / "log").mkdir(parents=True)
    (run / "data" / "opd" / "log" / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opd = {"precision": "bf16", "teacher_dtype": "bf16", "global_batch_size": 8}
    (run / "params.yaml").write_text(yaml.safe_dump({"opd": opd}))
    (line,) = study.precision_runs([("CPU, bf16", tmp_path, "opd_bf16")], span=5, first=4, ends=12)
    assert line["group"] == "CPU, bf16" and line["seed"] == "seed-1" and line["steps"] == len(ended)
    assert line["collapse_span"] == 5
    assert line["eos_first"] == [0.5, 0.375, 0.0, 0.0]
    first_run_of_five = next(i for i in range(len(ended) - 4) if not any(ended[i : i + 5]))
    assert first_run_of_five == 8
    on_policy_steps = [r["step"] for r in rows if r["task/on_policy"] == 1.0]
    assert line["collapse_step"] == on_policy_steps[8] == 8
    assert line["steps_none_ended"] == sum(k == 0 for k in ended) == 11
    assert line["eos_rate_end"] == sum(ended[-12:]) / 96
    assert line["entropy_start"] is None and line["teacher_logprob_start"] == (-3.0 - 3.1 - 3.2) / 3
    assert line["opd"] == {"precision": "bf16", "teacher_dtype": "bf16"}
    with pytest.raises(SystemExit, match="LABEL=ROOT:ARM"):
        study.parse_groups(["no label"])
