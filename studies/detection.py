"""Detection benchmark: the consistency detector's false alarms on healthy runs and its delay on real faults.

Two parts, each at every K of ``--workers`` (default 2, the pipeline's default, and 4):

1. **The null where the report judges**: healthy ``sft`` and ``opd`` stages of the default pipeline
   (``studies/detection_null.py``: the real stages with the committed params, teacher completions from the
   pipeline's cache, only ``ddp.workers`` and ``ddp.seed`` changed). Calibration seeds choose the design
   rate per K (``report.false_alarms_per_1000`` for K >= 3, ``report.two_worker_false_alarms_per_1000`` for
   K = 2): the largest rate on ``DESIGN_RATES`` that, doubled, keeps the calibration alarms at or below
   half the 1-per-1,000 target (``calibrate``). The held-out seeds, never used for tuning, then give the rate
   the report quotes, with its exact 95% Poisson interval.
2. **Faults**: the built-in student trained by SFT on reference answers (global batch 32, micro-batches of
   2), every fault of ``ars_opd.training.faults`` injected on one rank from ``--onset`` on, branched from
   the healthy trajectory's state at the onset (before it a faulty run is the healthy run step for step),
   scored at the calibrated rate. ``drop_microbatch`` cases split the rank's sequences as their magnitude
   needs. At K = 2 an alarm cannot name a rank (one worker's residual is the other's negative): a fault
   counts as detected by any alarm after the onset, "rank not attributable".

Prints JSON lines: ``{"null": ...}`` per (K, stage, held-out seed), ``{"calibration": ...}`` per K,
``{"case": ...}`` per (K, fault, magnitude, seed), then ``{"summary": ...}`` lines (per K and fault; the
false-alarm rate per K with its interval).

    python studies/detection.py --pipeline . --rows /tmp/det_rows > reports/detection.jsonl   # after dvc repro
    python studies/detection.py --pipeline . --rows /tmp/det_rows --from-rows   # re-score kept rows
    python studies/detection.py --workers 4 --fault-seeds 5 --cases loss_scale --null-seeds   # a quick look
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import time
from pathlib import Path

import torch
import yaml
from detection_null import STAGES, run_missing

from ars_opd.config import ArchConfig, InjectConfig, ParallelConfig, ReportConfig, SFTConfig, parse_section
from ars_opd.data import synthetic
from ars_opd.data.prompts import alpaca_messages
from ars_opd.evaluation.detector import detect, rate_interval
from ars_opd.seeding import derive_seed, set_seeds

REPO = Path(__file__).resolve().parents[1]
# each fault: (default magnitude, the sweep from below the default to above it); the defaults are the
# realistic ceilings or less: 10% label noise, one task of five, a factor 2 or 1/2, one micro-batch of a
# rank's two, 1e-4 of each parameter's RMS
GRID = {
    "label_noise": (0.10, (0.03, 0.10, 0.30)),
    "shard_skew": (1.0, (0.25, 0.5, 1.0)),
    "loss_scale": (2.0, (1.25, 2.0, 4.0)),
    "loss_scale_down": (0.5, (0.8, 0.5, 0.25)),
    "drop_microbatch": (0.5, (0.125, 0.25, 0.5, 0.75)),
    "param_desync": (1e-4, (1e-7, 1e-4, 1e-2)),
}
# drop_microbatch's magnitude here is the share of the rank's data dropped per step: (micro-batch size of
# the rank's 8 sequences, micro-batches dropped). The loss normalisation is exact for any split, so the
# healthy run's micro-batches of 2 and a case's own split give the same gradients before the fault.
DROP_SPLITS = {0.125: (1, 1), 0.25: (2, 1), 0.5: (4, 1), 0.75: (2, 3)}  # for a rank's 8 sequences (K = 4)
GLOBAL_BATCH, TARGET_PER_1000 = 32, 1.0
SCHEDULE_STEPS = 1000  # the fault runs' learning-rate schedule is that of a 1,000-step SFT run
DESIGN_RATES = (1.0, 0.5, 0.25, 0.1, 0.05, 0.025, 0.01, 0.005)  # candidate design rates, most sensitive first
CALIBRATION_SEEDS = (1, 2, 3)  # the null's calibration seeds; the held-out ones are the default --null-seeds
HELD_OUT_SEEDS = tuple(range(11, 21))


def fault_rank(workers: int) -> int:
    """The rank a fault is injected on: 2 of 4 as before; the second of two."""
    return 2 if workers >= 3 else workers - 1


def drop_split(magnitude: float, workers: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches dropped) that drop ``magnitude`` of a rank's sequences."""
    micro, dropped = DROP_SPLITS[magnitude]
    return micro * (GLOBAL_BATCH // workers) // 8, dropped


def _rows_for(n: int, seed: int) -> list[dict]:
    return [
        {"messages": alpaca_messages(r["instruction"], r["input"]), "completion": r["output"], "task": r["task"]}
        for r in synthetic.generate(n, seed=seed)
    ]


def run_seed(job: dict) -> list[dict]:
    """One worker, one seed: the healthy run, and every fault case branched from it at the onset.

    Before the onset a faulty run is the healthy run step for step (same initial weights, data order and
    RNG streams; a fault draws from generators of its own), so the healthy trajectory is trained once, its
    state (weights, optimizer, schedule, RNG) saved at the onset, and each case restores it and trains on
    with its fault. The rows of a case are the healthy rows before the onset followed by its own.
    """
    from ars_opd.lm.optim import make_optimizer, make_scheduler
    from ars_opd.models.builtin import build_causal_lm
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.training.batch_plan import BatchGeometry
    from ars_opd.training.checkpoint import TrainerState
    from ars_opd.training.consistency import ConsistencyHook
    from ars_opd.training.distributed import init_worker, shutdown_worker
    from ars_opd.training.faults import Fault
    from ars_opd.training.loop import Trainer
    from ars_opd.training.sft import SFTTask, encode_sft_rows
    from ars_opd.training.sharding import ShardedConsistencyHook
    from ars_opd.training.worker import WorkerSetup
    from ars_opd.training.wrapping import wrap_model

    ctx = init_worker("cpu", "gloo", threads=1)
    try:
        seed, onset = job["seed"], job["onset"]
        tok = build_char_word_tokenizer(synthetic.instruction_words())
        cfg = SFTConfig(**job["sft"])
        data = encode_sft_rows(tok, _rows_for(job["rows"], seed=job["data_seed"]), cfg)
        geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "bench")
        model = build_causal_lm(ArchConfig(**job["arch"]), tok, derive_seed(seed, "bench-init"))
        set_seeds(derive_seed(seed, "bench-rng"))
        task = SFTTask(
            data,
            cfg,
            WorkerSetup(ctx, tok, geometry, sampler_seed=derive_seed(seed, "bench-sampler"), stage_seed=0, fault=None),
            vocab=len(tok),
        )
        strategy = job.get("strategy", "ddp")
        ddp = wrap_model(model, ctx, ParallelConfig(workers=ctx.world_size, strategy=strategy), cfg)
        hook = (ShardedConsistencyHook if strategy == "fsdp" else ConsistencyHook)(ctx.world_size, gram_every=0)
        hook.attach(ddp)
        opt = make_optimizer(model, cfg)
        sched = make_scheduler(opt, cfg, cfg.steps)

        def run(state: TrainerState, until: int, fault: Fault | None) -> list[dict]:
            rows = []
            while state.step < until:
                r = Trainer(
                    model=ddp,
                    task=task,
                    opt=opt,
                    sched=sched,
                    ctx=ctx,
                    cfg=cfg,
                    state=state,
                    monitor=hook,
                    fault=fault,
                    drift_every=0 if strategy == "fsdp" else job["drift_every"],
                ).step()  # no replicas when sharded
                rows.append(
                    {
                        "step": state.step,
                        "loss": r.loss,
                        "grad_norm": r.grad_norm,
                        "worker_loss": r.worker_loss,
                        "worker_tokens": r.worker_tokens,
                        "consistency/worker_grad_norm": r.consistency["worker_grad_norm"],
                        "consistency/worker_cos_to_mean": r.consistency["worker_cos_to_mean"],
                        "drift_mismatch": r.drift,
                        "fault": fault.cfg.kind if fault is not None and fault.active(state.step) else None,
                    }
                )
                state.step += 1
            return rows

        t0 = time.perf_counter()
        state = TrainerState()
        before = run(state, onset, None)
        snapshot = (
            copy.deepcopy(model.state_dict()),
            copy.deepcopy(opt.state_dict()),
            copy.deepcopy(sched.state_dict()),
            torch.get_rng_state(),
            random.getstate(),
        )
        out = []
        if job["healthy"]:
            after = run(state, job["healthy_steps"], None)
            out.append({**job["healthy"], "rows": before + after, "seconds": time.perf_counter() - t0})
        for case in job["cases"]:
            t1 = time.perf_counter()
            model.load_state_dict(snapshot[0])
            opt.load_state_dict(copy.deepcopy(snapshot[1]))
            sched.load_state_dict(snapshot[2])
            torch.set_rng_state(snapshot[3])
            random.setstate(snapshot[4])
            task.fault = Fault(
                parse_section(InjectConfig, case["inject"], "ddp.inject"),
                "sft",
                ctx.rank,
                derive_seed(seed, "bench-fault"),
            )
            task.geometry = BatchGeometry.check(
                cfg.global_batch_size, ctx.world_size, case.get("micro_batch_size", cfg.micro_batch_size), "bench"
            )
            rows = run(TrainerState(step=onset), onset + job["fault_steps"], task.fault)
            task.fault, task.geometry = None, geometry
            out.append({**case, "rows": before + rows, "seconds": time.perf_counter() - t1})
        ddp = None  # the DDP wrapper must be gone before the process group is destroyed
        return out
    finally:
        shutdown_worker()


def settings_at(settings: ReportConfig, workers: int, design_rate: float) -> ReportConfig:
    """The report's settings with the design rate that applies to ``workers`` set to ``design_rate``."""
    key = "two_worker_false_alarms_per_1000" if workers == 2 else "false_alarms_per_1000"
    return dataclasses.replace(settings, **{key: design_rate})


def judged_steps(rows: list[dict], settings: ReportConfig) -> int:
    return max(0, len(rows) - settings.warmup)


def score_case(case: dict, settings: ReportConfig, onset: int, workers: int) -> dict:
    """One fault case (or the healthy run it branched from): detection, delay, named rank, false alarms."""
    rows = case["rows"]
    alarms = detect(rows, settings)
    healthy = case["case"] == "healthy"
    before = [a for a in alarms if healthy or a.step < onset]
    after = [] if healthy else [a for a in alarms if a.step >= onset]
    first = after[0] if after else None
    extra = {}
    if "micro_batch_size" in case:
        extra = {
            "micro_batches_dropped": case["micro_batches_dropped"],
            "micro_batches_per_rank": GLOBAL_BATCH // workers // case["micro_batch_size"],
        }
    return {
        "case": case["case"],
        "workers": workers,
        "strategy": case.get("strategy", "ddp"),
        "magnitude": case["magnitude"],
        "default": case["default"],
        "seed": case["seed"],
        **extra,
        "rank": None if healthy else fault_rank(workers),
        "onset_step": None if healthy else onset,
        "steps": len(rows),
        "detected": first is not None,
        "delay_steps": None if first is None else first.step - onset,
        "named_rank": None if first is None else first.rank,
        "false_alarms": len(before),
        "alarms_after_onset": len(after),
        "first_alarm": None if first is None else first.to_dict(),
        "judged_steps": max(0, (len(rows) if healthy else onset) - settings.warmup),
    }


def build_jobs(
    names: list[str], seeds: list[int], workers: int, fault_steps: int, onset: int, all_magnitudes: bool
) -> list[dict]:
    """One job per seed: the healthy trajectory up to the onset and its fault cases."""
    jobs = []
    rank = fault_rank(workers)
    for seed in seeds:
        cases = []
        for name, (default, sweep) in GRID.items():
            if name not in names:
                continue
            kind = "loss_scale" if name.startswith("loss_scale") else name
            for m in sweep if all_magnitudes else (default,):
                case = {
                    "case": kind,
                    "magnitude": m,
                    "default": m == default,
                    "seed": seed,
                    "inject": {"kind": kind, "stages": ["sft"], "rank": rank, "start_step": onset, "magnitude": m},
                }
                if kind == "drop_microbatch":
                    micro, dropped = drop_split(m, workers)
                    case.update(micro_batch_size=micro, micro_batches_dropped=dropped)
                    case["inject"]["magnitude"] = dropped
                cases.append(case)
        jobs.append(
            {
                "seed": seed,
                "healthy": None,
                "cases": cases,
                "onset": onset,
                "healthy_steps": onset,
                "fault_steps": fault_steps,
            }
        )
    return jobs


def null_rows(rows_dir: Path, workers: int, seeds: list[int]) -> dict[tuple[int, str], list[dict]]:
    """The kept step logs of the pipeline null, by (seed, stage); a seed's sft log is required, its opd log is
    read where that stage ran (a sweep cut short names the seeds each stage covers in its summary)."""
    out = {}
    for seed in seeds:
        for stage in STAGES:
            path = rows_dir / f"k{workers}" / f"seed{seed}_{stage}.jsonl"
            if stage != "sft" and not path.exists():
                continue
            out[(seed, stage)] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def count_alarms(runs: dict[tuple[int, str], list[dict]], settings: ReportConfig) -> tuple[int, int]:
    """(alarms, judged steps) over healthy runs: every alarm on a healthy run is a false one."""
    return (
        sum(len(detect(rows, settings)) for rows in runs.values()),
        sum(judged_steps(rows, settings) for rows in runs.values()),
    )


def calibrate(runs: dict[tuple[int, str], list[dict]], settings: ReportConfig, workers: int) -> dict:
    """The largest design rate r of ``DESIGN_RATES`` at which twice that rate (a factor-2 margin for the
    seed-to-seed spread: single healthy runs alarmed from 0 to 3 times at one threshold) keeps the
    calibration runs at or below half the target; the smallest rate if none does."""
    tried = []
    chosen = DESIGN_RATES[-1]
    for rate in DESIGN_RATES:
        alarms, judged = count_alarms(runs, settings_at(settings, workers, 2 * rate))
        tried.append(
            {
                "design_rate": rate,
                "alarms_at_twice": alarms,
                "judged_steps": judged,
                "per_1000_at_twice": round(1000 * alarms / judged, 3) if judged else None,
            }
        )
        if judged and 1000 * alarms / judged <= TARGET_PER_1000 / 2:
            chosen = rate
            break
    return {"calibration": workers, "seeds": sorted({s for s, _ in runs}), "chosen_design_rate": chosen, "tried": tried}


def null_summary(
    runs: dict[tuple[int, str], list[dict]], settings: ReportConfig, workers: int, design_rate: float
) -> tuple[list[dict], dict]:
    """Per (stage, seed) lines on the held-out null, and the rate with its exact 95% interval."""
    lines = []
    for (seed, stage), rows in sorted(runs.items()):
        alarms = detect(rows, settings)
        lines.append(
            {
                "null": stage,
                "workers": workers,
                "seed": seed,
                "steps": len(rows),
                "judged_steps": judged_steps(rows, settings),
                "false_alarms": len(alarms),
                "alarms": [a.to_dict() for a in alarms],
            }
        )
    alarms = sum(r["false_alarms"] for r in lines)
    judged = sum(r["judged_steps"] for r in lines)
    lo, hi = rate_interval(alarms, judged)
    by_stage = {
        s: {
            "seeds": [r["seed"] for r in lines if r["null"] == s],
            "false_alarms": sum(r["false_alarms"] for r in lines if r["null"] == s),
            "judged_steps": sum(r["judged_steps"] for r in lines if r["null"] == s),
        }
        for s in STAGES
    }
    return lines, {
        "summary": "false_alarm_rate",
        "workers": workers,
        "setting": "pipeline",
        "design_rate": design_rate,
        "healthy_runs": len(lines),
        "seeds": sorted({s for s, _ in runs}),
        "judged_steps": judged,
        "false_alarms": alarms,
        "per_1000_steps": round(1000 * alarms / judged, 3) if judged else None,
        "ci95_per_1000": [round(lo, 3), round(hi, 3)],
        "by_stage": by_stage,
    }


def fault_summary(results: list[dict], workers: int) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["case"], r["magnitude"]), []).append(r)
    out = []
    for (case, m), rs in groups.items():
        # with two workers no alarm names a rank: any alarm after the onset is the detection
        hits = [r for r in rs if r["detected"] and (workers == 2 or r["named_rank"] == r["rank"])]
        delays = sorted(r["delay_steps"] for r in hits)
        out.append(
            {
                "summary": case,
                "workers": workers,
                "magnitude": m,
                "default": rs[0]["default"],
                "seeds": len(rs),
                "detected": len(hits),
                "rank": "not attributable" if workers == 2 else "right rank",
                "max_delay": delays[-1] if delays else None,
                "median_delay": delays[len(delays) // 2] if delays else None,
            }
        )
    return out


def fault_runs(a, workers: int, params: dict) -> list[dict]:
    """Train (or read back) the fault cases at ``workers``."""
    from ars_opd.training.distributed import launch

    sft = {
        **params["sft"],
        "global_batch_size": GLOBAL_BATCH,
        "micro_batch_size": 2,
        "checkpoint_every": 0,
        "snapshot_every": 0,
        "steps": SCHEDULE_STEPS,
    }
    done = []
    for job in build_jobs(a.cases, a.fault_seeds, workers, a.fault_steps, a.onset, a.all_magnitudes):
        sub = f"k{workers}" if a.strategy == "ddp" else f"k{workers}_{a.strategy}"
        path = a.rows / sub / f"faults_seed{job['seed']}.jsonl"
        if a.from_rows or path.exists():
            done += [json.loads(line) for line in path.read_text().splitlines() if line]
            continue
        job.update(
            sft=sft,
            arch=params["models"]["student_arch"],
            rows=2000,
            data_seed=7,
            strategy=a.strategy,
            drift_every=params["ddp"]["drift_check_every"],
        )
        out = [{**d, "strategy": a.strategy} for d in launch(run_seed, job, workers, 1)]
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for d in out:
                f.write(json.dumps(d) + "\n")
        done += out
    return done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--pipeline", type=Path, default=REPO, help="a workspace whose models and teacher_gen ran")
    p.add_argument("--rows", type=Path, required=True, help="kept step logs (reused when present)")
    p.add_argument("--calibration-seeds", type=int, nargs="*", default=list(CALIBRATION_SEEDS))
    p.add_argument(
        "--null-seeds",
        type=int,
        nargs="*",
        default=list(HELD_OUT_SEEDS),
        help="held-out healthy seeds of the pipeline null (never used for calibration)",
    )
    p.add_argument("--design-rate", type=float, default=None, help="skip calibration: score at this rate")
    # seeds 0-4 chose the detector's settings (window, k); the committed fault runs use fresh ones
    p.add_argument("--fault-seeds", type=int, nargs="*", default=[5, 6, 7, 8, 9])
    p.add_argument("--cases", nargs="+", default=list(GRID))
    p.add_argument("--all-magnitudes", action="store_true", help="every magnitude of the sweep, not the defaults")
    p.add_argument("--fault-steps", type=int, default=60, help="steps a fault runs after its onset")
    p.add_argument("--onset", type=int, default=150)
    p.add_argument("--from-rows", action="store_true", help="only re-score kept rows; train nothing")
    p.add_argument(
        "--strategy",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="the fault runs' strategy (fsdp: statistics from the reduce-scatter, no drift check)",
    )
    a = p.parse_args()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    settings = parse_section(ReportConfig, params["report"], "report")
    summaries = []
    if not a.from_rows:
        run_missing(a.pipeline, a.workers, [*a.calibration_seeds, *a.null_seeds], a.rows)
    for k in a.workers:
        rate = a.design_rate
        if rate is None:
            cal = calibrate(null_rows(a.rows, k, a.calibration_seeds), settings, k)
            print(json.dumps(cal), flush=True)
            rate = cal["chosen_design_rate"]
        at = settings_at(settings, k, rate)
        if a.null_seeds:
            lines, summary = null_summary(null_rows(a.rows, k, a.null_seeds), at, k, rate)
            for line in lines:
                print(json.dumps(line), flush=True)
            summaries.append(summary)
        results = [score_case(d, at, a.onset, k) for d in fault_runs(a, k, params)]
        for r in results:
            print(json.dumps(r), flush=True)
        summaries += fault_summary(results, k)
    for s in summaries:
        print(json.dumps(s))


if __name__ == "__main__":
    main()
