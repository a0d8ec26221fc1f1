"""Does the rollout-health detector catch the collapse, and how often does it cry wolf? Its false-alarm rate on
healthy OPD runs and its delay on the runs whose rollouts stopped ending, over a grid of its settings.

The runs are step logs (``steps.jsonl``) found under the roots given:

- ``--healthy ROOT``: runs known healthy before the detector looked at them: the committed cross-tokenizer study's
  arms (``reports/cross_tokenizer/runs``: their rollouts end throughout), the default pipeline's OPD at several
  seeds (``--default-runs``), a real-profile study's arms that a human judged healthy;
- ``--collapsed ROOT``: runs whose rollouts stopped ending (the committed GPU pruned-recovery study's OPD and GKD
  arms, ``reports/pruned_recovery_gpu/runs``);
- ``--runs ROOT``: runs labelled by their own step log, not by a person: collapsed if they have a collapse step
  (below), healthy otherwise. Every committed study's runs can go here, the GKD-style ones (λ < 1) included,
  whose baseline step may follow teacher-text steps.

For a collapsed run the collapse step is the first on-policy step from which no rollout ended for at least
``--collapse-span`` on-policy steps in a row; the delay is the alarm's step minus it (negative: the alarm came
while the EOS rate was still falling). A run is judged with the batch its params give where its log predates the
``task/rollouts`` column. Every alarm on a healthy run is a false alarm; the rate is per 1,000 judged steps (steps
after the baseline) with an exact Poisson 95% interval. One JSON line per setting of the grid and a summary;
``--out`` writes them (``reports/rollout_health.jsonl``).

    python studies/rollout_health.py --healthy reports/cross_tokenizer/runs build/health-default \
        --collapsed reports/pruned_recovery_gpu/runs
    python studies/rollout_health.py --default-runs build/health-default --seeds 1 2 3 4 5   # make the default runs
    python studies/rollout_health.py --runs reports/*/runs --out reports/rollout_health.jsonl   # every committed run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ars_opd.artifacts import read_jsonl  # noqa: E402
from ars_opd.config import read_params_file  # noqa: E402
from ars_opd.training.opd.rollout_health import HealthConfig, detect, rollouts_of  # noqa: E402

GRID = [(b, w, a) for b in (1, 2, 3) for w in (4, 6, 8) for a in (1e-3, 1e-4, 1e-5)]


def step_logs(root: Path) -> list[tuple[str, list[dict], int | None]]:
    """(name, rows, batch) of every OPD step log under ``root`` with rollout columns; batch from the run's params."""
    out = []
    for steps in sorted(root.rglob("steps.jsonl")):
        rows = read_jsonl(steps)
        if not any("task/eos_rate" in r and float(r.get("task/on_policy", 1.0) or 0.0) >= 1.0 for r in rows):
            continue  # no step on the student's own rollouts (an SFT log, or GKD at λ = 0)
        batch = None
        for parent in steps.parents:
            if (parent / "params.yaml").is_file():
                batch = (read_params_file(parent / "params.yaml").get("opd") or {}).get("global_batch_size")
                break
            if parent == root:
                break
        out.append((str(steps.relative_to(root)), rows, batch))
    return out


def collapse_step(rows: list[dict], batch: int | None, span: int) -> int | None:
    """The first on-policy step from which no rollout ended for ``span`` on-policy steps in a row."""
    steps = rollouts_of(rows, batch)
    for i in range(len(steps) - span + 1):
        if all(s.ended == 0 for s in steps[i : i + span]):
            return steps[i].step
    return None


def poisson_interval(k: int, exposure: float) -> tuple[float, float]:
    """Exact (Garwood) 95% interval of a Poisson rate: k events in ``exposure`` units, by bisection on the tails."""

    def cdf(x: int, lam: float) -> float:
        term = total = math.exp(-lam)
        for i in range(1, x + 1):
            term *= lam / i
            total += term
        return total

    def solve(f, lo: float, hi: float) -> float:
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > 0 else (lo, mid)
        return (lo + hi) / 2

    upper = solve(lambda lam: cdf(k, lam) - 0.025, 0.0, 10.0 * (k + 5))
    lower = 0.0 if k == 0 else solve(lambda lam: cdf(k - 1, lam) - 0.975, 0.0, 10.0 * (k + 5))
    return lower / exposure, upper / exposure


def judge(healthy, collapsed, cfg: HealthConfig, span: int) -> dict:
    false_alarms, judged, fa_runs = 0, 0, []
    for name, rows, batch in healthy:
        m = detect(rows, cfg, batch)
        judged += max(0, len(m.steps) - cfg.baseline_steps)
        if m.alarm is not None:
            false_alarms += 1
            fa_runs.append(f"{name}@{m.alarm.step}:{m.alarm.kind}")
    delays, missed = [], []
    for name, rows, batch in collapsed:
        at = collapse_step(rows, batch, span)
        m = detect(rows, cfg, batch)
        if m.alarm is None or at is None:
            missed.append(name)
        else:
            delays.append({"run": name, "collapse_step": at, "alarm_step": m.alarm.step, "delay": m.alarm.step - at})
    lo, hi = poisson_interval(false_alarms, judged / 1000) if judged else (float("nan"), float("nan"))
    return {
        "baseline_steps": cfg.baseline_steps,
        "window": cfg.window,
        "alpha": cfg.alpha,
        "healthy_runs": len(healthy),
        "judged_steps": judged,
        "false_alarms": false_alarms,
        "false_alarms_per_1000": 1000 * false_alarms / judged if judged else None,
        "false_alarms_per_1000_ci": [lo, hi],
        "false_alarm_runs": fa_runs,
        "collapsed_runs": len(collapsed),
        "detected": len(delays),
        "missed": missed,
        "delays": delays,
        "median_delay": sorted(d["delay"] for d in delays)[len(delays) // 2] if delays else None,
    }


def make_default_runs(root: Path, seeds: list[int]) -> None:
    """The default pipeline (params.yaml as committed) in ``root``: models, subset, teacher_gen and sft once, then
    the opd stage at each training seed, its step log kept as ``seed-<s>/steps.jsonl``."""
    import shutil

    import yaml

    root.mkdir(parents=True, exist_ok=True)
    params = read_params_file(REPO / "params.yaml")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for seed in seeds:
        out = root / f"seed-{seed}" / "steps.jsonl"
        if out.is_file():
            continue
        params.setdefault("ddp", {})["seed"] = seed
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        for stage in ("models", "subset", "teacher_gen", "sft", "opd"):
            done = root / f".done-{stage}"
            if stage != "opd" and done.is_file():
                continue
            subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=root, env=env, check=True)
            done.write_text("")
        paths = read_params_file(root / "params.yaml")["paths"]
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / paths["opd_log"] / "steps.jsonl", out)
        (out.parent / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--healthy", nargs="*", default=[], help="roots of healthy runs' step logs")
    ap.add_argument("--collapsed", nargs="*", default=[], help="roots of runs whose rollouts stopped ending")
    ap.add_argument("--runs", nargs="*", default=[], help="roots of runs labelled by their collapse step")
    ap.add_argument("--collapse-span", type=int, default=5)
    ap.add_argument("--default-runs", help="make the default pipeline's OPD runs here first (--seeds)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--out", help="write the JSON lines here too (e.g. reports/rollout_health.jsonl)")
    args = ap.parse_args(argv)
    if args.default_runs:
        make_default_runs(Path(args.default_runs), args.seeds)
    healthy = [(f"{r}/{n}", rows, b) for r in args.healthy for n, rows, b in step_logs(Path(r))]
    collapsed = [(f"{r}/{n}", rows, b) for r in args.collapsed for n, rows, b in step_logs(Path(r))]
    for r in args.runs:
        for n, rows, b in step_logs(Path(r)):
            (healthy if collapse_step(rows, b, args.collapse_span) is None else collapsed).append((f"{r}/{n}", rows, b))
    lines = [judge(healthy, collapsed, HealthConfig(b, w, a), args.collapse_span) for b, w, a in GRID]
    default = HealthConfig()
    chosen = next(
        x
        for x in lines
        if (x["baseline_steps"], x["window"], x["alpha"]) == (default.baseline_steps, default.window, default.alpha)
    )
    lines.append({"kind": "summary", "default": [default.baseline_steps, default.window, default.alpha], **chosen})
    text = "".join(json.dumps(x) + "\n" for x in lines)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
