"""Learning-curve snapshots: the student's weights every ``snapshot_every`` steps, with the budget spent.

Rank 0 writes each snapshot under the run's checkpoint directory, keyed on the run's fingerprint
(``snapshot_dir``): kept with the checkpoints, a resumed run still has the snapshots it wrote before the
interruption, and another run's are never mixed into its curve. The worker publishes them with the model
(``<model>/snapshots/step_N``, ``ars_opd.training.budget.SNAPSHOTS``). Each is a plain (merged) model
directory with its ``budget.json``, so evaluation reads it as any model; it is written under a temporary
name and renamed, so an interrupted write leaves no partial snapshot.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ars_opd.models.adapters import save_trained
from ars_opd.training.budget import write_budget


def snapshot_dir(ckpt_dir: Path, run_fingerprint: str) -> Path:
    """Where a run's learning-curve snapshots wait until the run publishes them with its model."""
    return ckpt_dir / "snapshots" / run_fingerprint


def run_snapshot_dir(
    ckpt_dir: Path, run_fingerprint: str, resumed_fingerprint: str | None, is_main: bool, snapshot_every: int
) -> Path:
    """This run's snapshot directory, set up by rank 0: a resume from a checkpoint of another fingerprint
    (resharded) carries that run's snapshots over, and, when this run keeps snapshots, other runs' are
    removed."""
    snapshots = snapshot_dir(ckpt_dir, run_fingerprint)
    earlier = snapshot_dir(ckpt_dir, resumed_fingerprint) if resumed_fingerprint else snapshots
    if is_main and earlier != snapshots and earlier.is_dir() and not snapshots.exists():
        os.replace(earlier, snapshots)  # a resharded resume continues the same learning curve
    if is_main and snapshot_every:
        for old in ckpt_dir.glob("snapshots/*"):  # another run's learning curve
            if old.name != snapshots.name:
                shutil.rmtree(old, ignore_errors=True)
    return snapshots


def save_snapshot(snapshot_dir: Path, model: torch.nn.Module, step: int, totals: dict) -> None:
    """Rank 0: the weights after ``step`` steps and the budget spent to reach them (a learning-curve point)."""
    final = snapshot_dir / f"step_{step:07d}"
    tmp = snapshot_dir / f".step_{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_trained(model, tmp)  # a plain (merged) model, adapter or not: evaluation reads it as one
    write_budget(tmp, totals)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
