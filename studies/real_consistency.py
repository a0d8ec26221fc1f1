"""The consistency detector on a healthy real-model SFT: its alarms per 1,000 judged steps against the rate
calibrated on the default pipeline's healthy runs.

The detector's thresholds were calibrated on the built-in toys (``studies/detection.py``). Whether it stays quiet
on a real model is a separate question: the per-worker losses and gradients of SmolLM2 on natural prompts are
distributed otherwise. This runs the workspace's sft stage (the real profile applied, as ``make repro-real``
leaves it) for ``--steps`` optimizer steps at the params' ``ddp.workers``, in a scratch directory under
``build/`` that links the workspace's models, subset and teacher completions (so nothing of the workspace's
outputs changes), then scores its per-step log with the report stage's own detector and settings. One JSON
line::

    {"kind": "real_consistency", "steps", "workers", "judged", "alarms", "silent", "per_1000", "ci_low",
     "ci_high", "calibrated_per_1000", "calibrated_ci_low", "calibrated_ci_high", "seconds", ...}

The intervals are exact 95% Poisson intervals (``rate_interval``), as the report's.

    python studies/real_consistency.py --steps 1000 > reports/real_consistency.jsonl   # ~45 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ars_opd.artifacts import read_jsonl  # noqa: E402
from ars_opd.config import load_params, read_params_file  # noqa: E402
from ars_opd.evaluation.consistency_report import detection_benchmark  # noqa: E402
from ars_opd.evaluation.detector import detect, rate_interval  # noqa: E402

# what the sft stage reads: linked from the workspace, read-only
INPUTS = ("models_dir", "subset_train", "subset_eval", "teacher_dir")


def scratch_params(params: dict, steps: int) -> dict:
    """The workspace's params with sft run for ``steps`` steps (checkpoints rare, no learning-curve snapshots:
    only the per-step log is wanted)."""
    out = json.loads(json.dumps(params))
    out["sft"].update(steps=steps, checkpoint_every=max(50, steps // 10), snapshot_every=0)
    return out


def link_inputs(root: Path, paths) -> None:
    (root / "inputs").symlink_to(REPO / "inputs", target_is_directory=True)  # the params' local sources
    for name in INPUTS:
        rel = Path(getattr(paths, name))
        src = (REPO / rel).resolve()
        if not src.exists():
            raise SystemExit(f"{rel} is missing: run the real profile first (make repro-real)")
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).symlink_to(src, target_is_directory=src.is_dir())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (build/real-consistency-PID)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    params = read_params_file(REPO / "params.yaml")
    root = REPO / "build" / f"real-consistency-{os.getpid()}"
    root.mkdir(parents=True)
    try:
        (root / "params.yaml").write_text(yaml.safe_dump(scratch_params(params, args.steps), sort_keys=False))
        link_inputs(root, load_params(root / "params.yaml", base=root, sections=("paths",)).paths)
        p = load_params(root / "params.yaml", base=root)
        from stages import sft

        cwd = os.getcwd()
        t0 = time.perf_counter()
        os.chdir(root)
        try:
            sft.main()
        finally:
            os.chdir(cwd)
        seconds = time.perf_counter() - t0
        rows = read_jsonl(root / p.paths.sft_log / "steps.jsonl")
        alarms = detect(rows, p.report)
        judged = max(0, len(rows) - p.report.warmup)
        lo, hi = rate_interval(len(alarms), judged)
        _, calibrated = detection_benchmark(REPO / p.paths.detection_benchmark, p.ddp.workers)
        line = {
            "kind": "real_consistency",
            "model": str(params["models"]["teacher"]),
            "student": params["models"]["student"],
            "stage": "sft",
            "steps": len(rows),
            "workers": p.ddp.workers,
            "global_batch_size": p.sft.global_batch_size,
            "judged": judged,
            "alarms": len(alarms),
            "silent": sum(1 for a in alarms if not a.visible),
            "alarm_steps": [a.step for a in alarms],
            "per_1000": 1000 * len(alarms) / judged if judged else float("nan"),
            "ci_low": lo,
            "ci_high": hi,
            "calibrated_per_1000": calibrated.get("detector/false_alarms_per_1000_measured"),
            "calibrated_ci_low": calibrated.get("detector/false_alarms_per_1000_ci_low"),
            "calibrated_ci_high": calibrated.get("detector/false_alarms_per_1000_ci_high"),
            "final_loss": rows[-1].get("loss") if rows else None,
            "seconds": seconds,
        }
        print(json.dumps(line), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
