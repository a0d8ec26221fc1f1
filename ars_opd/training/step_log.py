"""The per-step record of a training run: what a step reports, its log row, and where rank 0 writes it.

``StepRows.row`` lays out one step's columns (their names and order are the log's format: a change of either
is a change of every ``steps.jsonl``), ``StepLogger`` writes them: ``steps.jsonl`` holds one JSON line per
step with the per-worker columns, the rich record pandas reads later; DVCLive gets the scalars that
``dvc plots`` and ``dvc exp show`` read. Columns whose name ends in ``_s`` are wall-clock seconds: they go
to DVCLive but not into ``steps.jsonl``, so an identical retrain writes an identical log and DVC reruns
nothing downstream of it. On resume the checkpoint's log is replayed into both, so neither holds steps
from after the checkpoint of an interrupted run.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from ars_opd.config import ParallelConfig
from ars_opd.training.budget import BudgetTotals
from ars_opd.training.checkpoint import TrainerState
from ars_opd.training.faults import Fault
from ars_opd.training.noise_scale import NoiseScale


@dataclass(kw_only=True)
class StepResult:
    """What one optimiser step reports (``ars_opd.training.loop.Trainer.step``): the source of its log row.
    Built by keyword: its fields are many, and several of the same type."""

    loss: float
    tokens: int
    grad_norm: float
    clip_coef: float
    clipped: bool
    skipped: bool
    worker_loss: list[float]
    worker_tokens: list[int]
    metrics: dict[str, float] = field(default_factory=dict)
    worker_metrics: dict[str, list[float]] = field(default_factory=dict)  # a task column per worker, where asked
    consistency: dict = field(default_factory=dict)
    noise_scale: tuple[float, float] = (float("nan"), float("nan"))  # (|G|², tr Σ) estimates of the step
    drift: list[int] | None = None  # ranks whose replica differs (None: not checked this step)
    budget: dict = field(default_factory=dict)  # this step's flops, tokens_trained/processed/generated
    # host seconds of each part of the monitor this step (hook, stats, metrics, noise_scale; drift and
    # drift_gather on a check step): what bench/consistency_overhead.py breaks the overhead into; not logged
    monitor_s: dict[str, float] = field(default_factory=dict)


@dataclass
class StepRows:
    """Lays out the run's log rows, one per step, and carries what accumulates across them: the noise
    scale's running estimate and the budget totals (both start from the log a resumed run replays)."""

    parallel: ParallelConfig  # the scenario and strategy columns
    fault: Fault | None
    noise_scale: NoiseScale
    totals: BudgetTotals

    def row(self, state: TrainerState, result: StepResult, lr: float, step_s: float) -> dict:
        """The log row of step ``state.step`` (the counters in ``state`` already count it); advances the
        run's noise scale and budget totals by the step's terms."""
        fault = self.fault
        return {
            "step": state.step,
            "loss": result.loss,
            "tokens": result.tokens,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "clip_coef": result.clip_coef,
            "clipped": result.clipped,
            "clipped_total": state.clipped_steps,
            "skipped": result.skipped,
            "skipped_total": state.skipped_steps,
            "step_s": round(step_s, 5),
            "worker_loss": result.worker_loss,
            "worker_tokens": result.worker_tokens,
            "scenario": self.parallel.scenario,
            "strategy": self.parallel.strategy,
            "fault": fault.cfg.kind if fault is not None and fault.active(state.step) else None,
            "drift_mismatch": result.drift,  # null: not checked this step; []: every replica identical
            **{f"task/{k}": v for k, v in result.metrics.items()},
            **{f"worker_task/{k}": v for k, v in result.worker_metrics.items()},
            **{f"consistency/{k}": v for k, v in result.consistency.items()},
            "gns/g2": result.noise_scale[0],
            "gns/trace": result.noise_scale[1],
            "gns/b_simple": self.noise_scale.update(*result.noise_scale),
            **{f"budget/{k}": v for k, v in result.budget.items()},
            **self.totals.update(result.budget),
        }


def run_summary(rows: list[dict], state: TrainerState, totals: BudgetTotals) -> dict:
    """The run's summary (DVCLive's ``metrics.json``, for ``dvc exp show``) from its log and counters."""
    tail = [r["loss"] for r in rows[-10:] if math.isfinite(r["loss"])]
    return {
        "final_loss": rows[-1]["loss"] if rows else float("nan"),
        "final_loss_mean10": sum(tail) / len(tail) if tail else float("nan"),
        "steps": state.step,
        "clipped_steps": state.clipped_steps,
        "skipped_steps": state.skipped_steps,
        "tokens": state.tokens_seen,
        "train_seconds": state.train_seconds,
        "tokens_per_s": state.tokens_seen / state.train_seconds if state.train_seconds else float("nan"),
        **{f"budget_{k}_total": v for k, v in totals.totals.items()},
    }


def is_timing(column: str) -> bool:
    """Wall-clock columns (seconds): logged to DVCLive, kept out of ``steps.jsonl``."""
    return column.endswith("_s")


class StepLogger:
    """Rank 0's per-step record: one JSON line per step (per-worker columns included) and DVCLive scalars."""

    SCALARS = ("loss", "lr", "grad_norm", "clip_coef", "tokens", "step_s")
    SUMMARY_EVERY_S = 5.0  # DVCLive's metrics.json is rewritten at most this often while training

    def __init__(self, steps_path: Path, live_dir: Path, enabled: bool):
        self.enabled = enabled
        self.rows: list[dict] = []
        self._file = None
        self._live = None
        self._next_summary = 0.0
        # True: each step goes through Live.next_step(), DVC Studio's path (why only when Studio is configured: below)
        self.studio = False
        if enabled:
            from dvclive import Live

            steps_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(steps_path, "w")
            self._live = Live(dir=str(live_dir), save_dvc_exp=False, dvcyaml=None, resume=False)
            # Live.next_step() also streams to DVC Studio and, to do so, re-reads every plot file on every
            # step, even with Studio not configured: a cost that grows with the step count. So next_step()
            # runs only when Studio is configured; otherwise each step appends its plot rows and the summary
            # is rewritten every few seconds and at the end. (An unknown DVCLive keeps next_step().)
            skipped = getattr(self._live, "_studio_events_to_skip", None)
            self.studio = skipped is None or "data" not in skipped

    def log(self, row: dict) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        self._file.write(json.dumps({k: v for k, v in row.items() if not is_timing(k)}) + "\n")
        self._file.flush()
        self._live.step = row["step"]
        for k, v in row.items():
            if (
                (k in self.SCALARS or k.startswith(("task/", "consistency/", "gns/")))
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
            ):
                self._live.log_metric(f"train/{k}", v, plot=True)
        if self.studio:
            self._live.next_step()
            return
        self._live.step = row["step"] + 1  # what next_step() leaves: the summary's step counts steps done
        if time.monotonic() >= self._next_summary:
            self._live.make_summary()
            self._next_summary = time.monotonic() + self.SUMMARY_EVERY_S

    def replay(self, rows: list[dict]) -> None:
        for row in rows:
            self.log(row)

    def summary(self, metrics: dict) -> None:
        if self.enabled:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._live.summary[k] = v
            self._live.make_summary()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._live.end()
