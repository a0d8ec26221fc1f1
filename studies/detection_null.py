"""The detector's null in the default pipeline's own setting: healthy sft and opd stages at K workers.

Runs the real training stages (``run_sft``, then ``run_opd`` from that seed's SFT student) with the
committed ``params.yaml`` sections — teacher completions from the pipeline's cache, the stages' micro-batches,
learning rates, schedules and clipping — in a scratch workspace that links the pipeline's ``data/models``
and ``data/teacher``; only ``ddp.workers``, ``ddp.seed`` and (where K workers need it) the micro-batch
size change, and checkpoints and snapshots are off (they do not touch the trajectory). Each stage's
``steps.jsonl`` is kept under ``--rows``; ``studies/detection.py`` scores them (calibration and held-out
seeds apart) and runs the fault grid.

    python studies/detection_null.py --pipeline . --workers 2 --seeds 1 2 3 --stages sft --rows /tmp/null_rows
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ars_opd.config import OPDConfig, ParallelConfig, PathsConfig, SFTConfig, parse_section

REPO = Path(__file__).resolve().parents[1]
STAGES = ("sft", "opd")


def stage_configs(params: dict, workers: int, seed: int) -> tuple[ParallelConfig, SFTConfig, OPDConfig]:
    """The committed sections with K workers and a training seed; a micro-batch larger than a worker's share
    of the global batch is cut to that share (a K = 4 run of the default needs micro-batches of 8)."""
    ddp = parse_section(ParallelConfig, {**params["ddp"], "workers": workers, "seed": seed}, "ddp")
    out = []
    for name, cls in (("sft", SFTConfig), ("opd", OPDConfig)):
        sec = dict(params[name])
        share = sec["global_batch_size"] // workers
        sec.update(micro_batch_size=min(sec["micro_batch_size"], share), checkpoint_every=0, snapshot_every=0)
        out.append(parse_section(cls, sec, name))
    return ddp, out[0], out[1]


def run_null(pipeline: Path, params: dict, workers: int, seed: int, rows_dir: Path, stage: str) -> dict:
    """One healthy stage of one seed in a scratch workspace; its step log is copied to ``rows_dir``. The sft
    stage's student is kept there too: that seed's opd starts from it (``paths.distill_init``)."""
    from ars_opd.training.opd.stage import run_opd
    from ars_opd.training.sft import run_sft
    from ars_opd.training.worker import TrainingJob

    paths = parse_section(PathsConfig, params["paths"], "paths")
    ddp, sft, opd = stage_configs(params, workers, seed)
    out = rows_dir / f"k{workers}"
    student = out / f"seed{seed}_sft_model"
    work = Path(tempfile.mkdtemp(prefix=f"null-k{workers}-s{seed}-"))
    cwd = os.getcwd()
    try:
        for rel in (paths.models_dir, paths.teacher_dir):
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).symlink_to((pipeline / rel).resolve())
        if stage == "opd":
            (work / paths.sft_model).parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(student, work / paths.sft_model)
        paths = dataclasses.replace(paths, distill_init=paths.sft_model)
        os.chdir(work)
        t0 = time.perf_counter()
        if stage == "sft":
            run_sft(TrainingJob("sft", sft, ddp, paths, progress=False))
        else:
            run_opd(TrainingJob("opd", opd, ddp, paths, progress=False))
        seconds = round(time.perf_counter() - t0, 1)
        out.mkdir(parents=True, exist_ok=True)
        if stage == "sft":
            shutil.rmtree(student, ignore_errors=True)
            shutil.copytree(paths.sft_model, student)
        shutil.copyfile(Path(getattr(paths, f"{stage}_log")) / "steps.jsonl", out / f"seed{seed}_{stage}.jsonl")
        cfg = sft if stage == "sft" else opd
        return {
            "workers": workers,
            "seed": seed,
            "stage": stage,
            "seconds": seconds,
            "micro_batch_size": cfg.micro_batch_size,
        }
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)


def run_missing(
    pipeline: Path, workers: list[int], seeds: list[int], rows_dir: Path, stages: tuple[str, ...] = STAGES
) -> None:
    """Every (stage, K, seed) whose step log is not kept yet, stage by stage (each opd needs its sft)."""
    params = yaml.safe_load((pipeline / "params.yaml").read_text())
    for stage in stages:
        for k in workers:
            for seed in seeds:
                if not (rows_dir / f"k{k}" / f"seed{seed}_{stage}.jsonl").exists():
                    print(
                        json.dumps(run_null(pipeline.resolve(), params, k, seed, rows_dir, stage)),
                        file=sys.stderr,
                        flush=True,
                    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", type=Path, default=REPO, help="a workspace whose models and teacher_gen ran")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--rows", type=Path, required=True, help="where each stage's steps.jsonl is kept")
    a = p.parse_args()
    run_missing(a.pipeline, a.workers, a.seeds, a.rows, tuple(a.stages))


if __name__ == "__main__":
    main()
