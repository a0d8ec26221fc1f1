"""One-worker SFT stage: trained in the stage's own process vs in a spawned worker (JSON lines).

Each run is a fresh ``python`` that trains ``--steps`` SFT steps of the default configuration with
``ddp.workers: 1`` from a finished pipeline's models and teacher completions (``--pipeline``, a directory
where ``dvc repro`` ran), through ``ars_opd.training.distributed.launch(..., in_process=True|False)``: the
whole command's wall time, as a user waits for it, and the peak of the summed resident memory of the
process and its children (sampled every 20 ms; a spawned worker is a second interpreter holding its own
torch). Runs alternate between the two launches, ``--rounds`` of each; the last line is the summary.

    python bench/in_process.py --pipeline /path/to/pipeline --steps 100 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import sys
from ars_opd.config import load_params
from ars_opd.training import distributed
from ars_opd.training.sft import sft_worker
from ars_opd.training.worker import TrainingJob
p = load_params("params.yaml", sections=("paths", "models", "ddp", "sft"))
job = TrainingJob("sft", p.sft, p.ddp, p.paths, progress=False, adapter=p.models.student_adapter)
distributed.launch(sft_worker, job, 1, p.ddp.threads_per_worker, in_process=sys.argv[1] == "here")
"""


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_once(work: Path, how: str) -> dict:
    shutil.rmtree(work / "data/checkpoints", ignore_errors=True)  # never resume: every run trains all steps
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, how],
        cwd=work,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watched, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            peak = max(peak, _tree_rss(watched))
        except psutil.Error:
            pass
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise SystemExit(f"{how} run failed:\n{err[-3000:]}")
    return {"launch": how, "wall_s": round(wall, 3), "peak_rss_mib": round(peak / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pipeline", required=True, help="a directory where the default pipeline ran (dvc repro)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    src = Path(args.pipeline)
    params = yaml.safe_load((src / "params.yaml").read_text())
    params["ddp"]["workers"] = 1
    params["sft"].update(steps=args.steps, snapshot_every=0, checkpoint_every=0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ars-opd-in-process-") as tmp:
        work = Path(tmp)
        (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        for key in ("models_dir", "teacher_dir"):
            rel = params["paths"][key]
            shutil.copytree(src / rel, work / rel)
        for _ in range(args.rounds):
            for how in ("spawned", "here"):  # alternated: drift in the machine's load hits both alike
                row = run_once(work, how)
                rows.append(row)
                print(json.dumps({"bench": "in_process", "steps": args.steps, **row}), flush=True)
    summary = {"bench": "in_process", "summary": True, "steps": args.steps, "rounds": args.rounds}
    for how in ("spawned", "here"):
        mine = [r for r in rows if r["launch"] == how]
        summary[how] = {
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
            "peak_rss_mib_median": statistics.median(r["peak_rss_mib"] for r in mine),
        }
    summary["wall_ratio_here_over_spawned"] = round(
        summary["here"]["wall_s_median"] / summary["spawned"]["wall_s_median"], 3
    )
    summary["rss_ratio_here_over_spawned"] = round(
        summary["here"]["peak_rss_mib_median"] / summary["spawned"]["peak_rss_mib_median"], 3
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
