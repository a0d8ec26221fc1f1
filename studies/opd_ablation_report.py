"""The OPD ablation's table (studies/opd_ablation.sh): which factor explains OPD falling below its own start.

Reads ``dvc exp show --json`` output of the ablation (experiments named ``abl-<arm>-seed<seed>``; the whole
metrics of each are read from its commit, since ``exp show`` drops the learning curves) and, per arm, from
the learning curves on the curve prompts (the same prompts at every point; the first point is the pinned SFT
start, the same model for every arm and seed):

- OPD's change from the start at its last point (exact match, reverse KL to the teacher), and the control's
  (continued SFT at the arm's settings), each a mean over seeds with a 95% t-interval;
- OPD − control at equal steps (the last points), paired by seed;
- OPD − control at equal FLOPs, paired by seed: both at the cheaper arm's final FLOPs (the control's: an OPD
  step also samples and runs the teacher), each read off its learning curve (``ars_opd.evaluation.equal_budget``,
  the evaluate stage's own comparison);
- the arm's OPD change − the default arm's, paired by seed: a factor explains the drop when this is positive
  (exact match) and its interval excludes 0.

Prints one JSON line per arm, and with ``--out`` writes the markdown table. Each quantity in a line is
``{"mean", "ci95": [lower, upper], "per_seed": [one value per seed], "seeds"}``, so that a later arm can be
paired with this one by seed.

    python studies/opd_ablation_report.py /tmp/opd_ablation_exps.json --out reports/opd_ablation.md

``--keep reports/opd_ablation.jsonl`` carries over an earlier run's arms that have no experiments in this
repository (a study spread over clones), each line unchanged.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from ars_opd.config import PathsConfig
from ars_opd.evaluation.distillation import has_curves, param, with_curves
from ars_opd.evaluation.equal_budget import compare
from ars_opd.evaluation.experiments import walk_experiments
from ars_opd.evaluation.stats import mean_ci

NAME = re.compile(r"^abl-(?P<arm>.+)-seed(?P<seed>\d+)$")
METRICS = ("exact_match", "reverse_kl")


def runs_by_arm(data) -> dict[str, list[dict]]:
    """{arm: [run, ...]}: the ablation's experiments (by name) with both arms evaluated, their curves read whole
    from each experiment's commit."""
    arms = defaultdict(list)
    for name, params, metrics, is_experiment, rev in walk_experiments(data):
        m = NAME.match(str(name))
        if not (is_experiment and m and "opd" in metrics and "sft_continued" in metrics):
            continue
        if rev == "workspace":  # a running experiment: exp show lists it with the workspace's (another run's) files
            continue
        arms[m["arm"]].append(
            {
                "name": name,
                "seed": int(m["seed"]),
                "evaluate": metrics,
                "rev": rev,
                "metrics_path": param(params, "paths.eval_metrics") or PathsConfig().eval_metrics,
            }
        )
    out = {}
    for arm, runs in arms.items():
        whole = with_curves(runs)
        missing = [r["name"] for r in whole if not has_curves(r["evaluate"])]
        if missing:  # their commits could not be read here: run this inside the repository that holds them
            print(f"no learning curves for {', '.join(missing)}: left out", file=sys.stderr)
        out[arm] = [r for r in whole if has_curves(r["evaluate"])]
    return out


def points(run: dict, arm: str) -> tuple[dict, dict]:
    """(start, last) curve points of ``arm`` (``opd`` or ``sft_continued``) in one run."""
    curve = run["evaluate"]["curves"][arm]
    if not curve[0].get("start"):
        raise ValueError(f"{run['name']}: the {arm} curve does not begin at the shared start")
    return curve[0], curve[-1]


def summary(values: list[float], seeds: list[int]) -> dict:
    """A quantity over seeds: each seed's value (in ``seeds``' order), the mean and its 95% t-interval."""
    m, lo, hi = mean_ci(values)
    return {"mean": m, "ci95": [lo, hi], "per_seed": list(values), "seeds": list(seeds)}


def arm_line(arm: str, runs: list[dict], default: dict[int, float]) -> dict:
    runs = sorted(runs, key=lambda r: r["seed"])
    seeds = [r["seed"] for r in runs]
    line = {"arm": arm, "seeds": seeds}
    at_flops = [compare(r["evaluate"])["equal_flops"] for r in runs]  # each run's both arms, every metric
    for metric in METRICS:
        opd_change, control_change, gap, gap_flops = [], [], [], []
        for r, flops in zip(runs, at_flops):
            s, e = points(r, "opd")
            cs, ce = points(r, "sft_continued")
            opd_change.append(e[metric] - s[metric])
            control_change.append(ce[metric] - cs[metric])
            gap.append(e[metric] - ce[metric])
            gap_flops.append(flops["opd"][metric] - flops["sft_continued"][metric])
        line[f"opd_change_{metric}"] = summary(opd_change, seeds)
        line[f"control_change_{metric}"] = summary(control_change, seeds)
        line[f"opd_minus_control_{metric}"] = summary(gap, seeds)
        line[f"opd_minus_control_equal_flops_{metric}"] = summary(gap_flops, seeds)
        if metric == "exact_match" and default:
            both = [(c - default[r["seed"]], r["seed"]) for c, r in zip(opd_change, runs) if r["seed"] in default]
            paired = summary([d for d, _ in both], [s for _, s in both]) if len(both) >= 2 else None
            line["opd_change_vs_default_exact_match"] = paired
        line["start_" + metric] = points(runs[0], "opd")[0][metric]
    return line


def _fmt(q: dict | None, pct: bool) -> str:
    if q is None:
        return "n/a"
    m, (lo, hi) = q["mean"], q["ci95"]
    f = (lambda v: f"{100 * v:+.1f}") if pct else (lambda v: f"{v:+.3f}")
    return f"{f(m)} [{f(lo)}, {f(hi)}]"


def table(lines: list[dict]) -> str:
    rows = [
        "| arm | seeds | OPD: end − start, exact match (points) | control: end − start | OPD − control at equal "
        "steps | OPD − control at equal FLOPs | OPD change − default's (paired) | OPD: end − start, reverse KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ln in lines:
        rows.append(
            f"| {ln['arm']} | {len(ln['seeds'])} | {_fmt(ln['opd_change_exact_match'], True)} | "
            f"{_fmt(ln['control_change_exact_match'], True)} | {_fmt(ln['opd_minus_control_exact_match'], True)} | "
            f"{_fmt(ln.get('opd_minus_control_equal_flops_exact_match'), True)} | "
            f"{_fmt(ln.get('opd_change_vs_default_exact_match'), True)} | {_fmt(ln['opd_change_reverse_kl'], False)} |"
        )
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("exps", type=Path, help="dvc exp show --json --all-commits output")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    p.add_argument(
        "--keep",
        type=Path,
        help="an earlier run's JSON lines: its arms that have no experiments here are carried over as they are",
    )
    a = p.parse_args(argv)
    by_arm = runs_by_arm(json.loads(a.exps.read_text()))
    if "default" not in by_arm:
        print("no default arm (abl-default-seed<N>) among the experiments", file=sys.stderr)
        return 1
    default = {}
    for r in by_arm["default"]:
        start, end = points(r, "opd")
        default[r["seed"]] = end["exact_match"] - start["exact_match"]
    lines = []
    for arm in ["default", *sorted(k for k in by_arm if k != "default")]:
        if len(by_arm[arm]) < 2:
            print(f"arm {arm}: {len(by_arm[arm])} seed(s), at least 2 are needed for an interval", file=sys.stderr)
            continue
        ln = arm_line(arm, by_arm[arm], {} if arm == "default" else default)
        print(json.dumps(ln), flush=True)
        lines.append(ln)
    if a.keep:  # arms measured before whose experiments are gone (their lines say when they were run)
        for old in (json.loads(x) for x in a.keep.read_text().splitlines() if x.strip()):
            if old["arm"] not in by_arm:
                print(json.dumps(old), flush=True)
                lines.append(old)
    if a.out:
        a.out.write_text(table(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
