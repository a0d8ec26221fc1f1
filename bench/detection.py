"""Detection benchmark: the consistency detector's false alarms on healthy runs and its delay on real faults.

Trains the built-in tiny student (``params.yaml``'s ``models.student_arch``) by SFT on the synthetic tasks
(reference answers as completions, so no teacher is needed) on K = 4 gloo workers (global batch 32,
micro-batches of 2: four per rank and step; ``drop_microbatch`` cases split the rank's 8 sequences as their
magnitude needs), through the engine's own ``train_step`` with the consistency
hook and the replica-drift check. Per seed: one healthy run of ``--healthy-steps``, and every fault of
``ars_opd.training.faults`` injected on rank 2 from ``--onset`` on, branched from the healthy run's state
at the onset (before it a faulty run is the healthy run step for step). The per-step rows go through
``ars_opd.evaluation.detector.detect`` with the report's settings (``params.yaml``'s ``report`` section).
Prints one JSON line per (case, magnitude, seed):

    {"case", "magnitude", "default", "seed", "rank", "onset_step", "steps", "detected", "delay_steps",
     "named_rank", "false_alarms", "alarms_after_onset", "first_alarm", "judged_steps"}

``detected``: an alarm at or after the onset (``delay_steps`` = its step − onset); ``named_rank``: the rank
of that first alarm; ``false_alarms``: alarms before the onset (healthy runs: all of them);
``judged_steps``: steps the detector judged in that stretch. Then one summary line per case and magnitude,
and the false-alarm rate per 1,000 judged steps over every healthy stretch.

    python bench/detection.py > reports/detection.jsonl   # the full grid (5 seeds not used for tuning)
    python bench/detection.py --seeds 0 --cases loss_scale --defaults-only   # a quick look
    python bench/detection.py --save-rows /tmp/rows    # keep the per-step rows (re-score with --from-rows)
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import yaml  # noqa: E402

from ars_opd.config import ArchConfig, DDPConfig, InjectConfig, ReportConfig, SFTConfig, parse_section  # noqa: E402
from ars_opd.data import synthetic  # noqa: E402
from ars_opd.data.prompts import alpaca_messages  # noqa: E402
from ars_opd.evaluation.detector import detect  # noqa: E402
from ars_opd.seeding import derive_seed, set_seeds  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKERS, FAULT_RANK = 4, 2
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
DROP_SPLITS = {0.125: (1, 1), 0.25: (2, 1), 0.5: (4, 1), 0.75: (2, 3)}


def _rows_for(n: int, seed: int) -> list[dict]:
    return [{"messages": alpaca_messages(r["instruction"], r["input"]), "completion": r["output"],
             "task": r["task"]} for r in synthetic.generate(n, seed=seed)]


def run_seed(job: dict) -> list[dict]:
    """One worker, one seed: the healthy run, and every fault case branched from it at the onset.

    Before the onset a faulty run is the healthy run step for step (same initial weights, data order and
    RNG streams; a fault draws from generators of its own), so the healthy trajectory is trained once, its
    state (weights, optimizer, schedule, RNG) saved at the onset, and each case restores it and trains on
    with its fault. The rows of a case are the healthy rows before the onset followed by its own.
    """
    from ars_opd.models.builtin import build_causal_lm
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.training.checkpoint import TrainerState
    from ars_opd.training.consistency import ConsistencyHook
    from ars_opd.training.distributed import init_worker, shutdown_worker
    from ars_opd.training.faults import Fault
    from ars_opd.training.geometry import BatchGeometry
    from ars_opd.training.loop import train_step, wrap_ddp
    from ars_opd.training.optim import make_optimizer, make_scheduler
    from ars_opd.training.sft import SFTTask, encode_sft_rows

    ctx = init_worker("cpu", "gloo", threads=1)
    try:
        seed, onset = job["seed"], job["onset"]
        tok = build_char_word_tokenizer(synthetic.instruction_words())
        cfg = SFTConfig(**job["sft"])
        data = encode_sft_rows(tok, _rows_for(job["rows"], seed=job["data_seed"]), cfg)
        geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "bench")
        model = build_causal_lm(ArchConfig(**job["arch"]), tok, derive_seed(seed, "bench-init"))
        set_seeds(derive_seed(seed, "bench-rng"))
        task = SFTTask(data, cfg, geometry, derive_seed(seed, "bench-sampler"), ctx.rank, ctx.device,
                       tok.pad_token_id, None, len(tok))
        ddp = wrap_ddp(model, ctx, DDPConfig(workers=ctx.world_size))
        hook = ConsistencyHook(ctx.world_size, gram_every=0)
        hook.attach(ddp)
        opt = make_optimizer(model, cfg)
        sched = make_scheduler(opt, cfg, cfg.steps)

        def run(state: TrainerState, until: int, fault: Fault | None) -> list[dict]:
            rows = []
            while state.step < until:
                r = train_step(ddp, task, opt, sched, ctx, cfg, state, hook, fault, job["drift_every"])
                rows.append({"step": state.step, "loss": r.loss, "grad_norm": r.grad_norm,
                             "worker_loss": r.worker_loss, "worker_tokens": r.worker_tokens,
                             "consistency/worker_grad_norm": r.consistency["worker_grad_norm"],
                             "consistency/worker_cos_to_mean": r.consistency["worker_cos_to_mean"],
                             "drift_mismatch": r.drift,
                             "fault": fault.cfg.kind if fault is not None and fault.active(state.step) else None})
                state.step += 1
            return rows

        t0 = time.perf_counter()
        state = TrainerState()
        before = run(state, onset, None)
        snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                    copy.deepcopy(sched.state_dict()), torch.get_rng_state(), random.getstate())
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
            task.fault = Fault(parse_section(InjectConfig, case["inject"], "ddp.inject"), "sft", ctx.rank,
                               derive_seed(seed, "bench-fault"))
            task.geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size,
                                                case.get("micro_batch_size", cfg.micro_batch_size), "bench")
            rows = run(TrainerState(step=onset), onset + job["fault_steps"], task.fault)
            task.fault, task.geometry = None, geometry
            out.append({**case, "rows": before + rows, "seconds": time.perf_counter() - t1})
        ddp = None  # the DDP wrapper must be gone before the process group is destroyed
        return out
    finally:
        shutdown_worker()


def score(case: dict, settings: ReportConfig, onset: int) -> dict:
    rows = case["rows"]
    alarms = detect(rows, settings)
    healthy = case["case"] == "healthy"
    before = [a for a in alarms if healthy or a.step < onset]
    after = [] if healthy else [a for a in alarms if a.step >= onset]
    first = after[0] if after else None
    return {"case": case["case"], "magnitude": case["magnitude"], "default": case["default"], "seed": case["seed"],
            **({"micro_batches_dropped": case["micro_batches_dropped"],
                "micro_batches_per_rank": 8 // case["micro_batch_size"]} if "micro_batch_size" in case else {}),
            "rank": None if healthy else FAULT_RANK, "onset_step": None if healthy else onset, "steps": len(rows),
            "detected": first is not None, "delay_steps": None if first is None else first.step - onset,
            "named_rank": None if first is None else first.rank, "false_alarms": len(before),
            "alarms_after_onset": len(after), "first_alarm": None if first is None else first.to_dict(),
            "judged_steps": max(0, (len(rows) if healthy else onset) - settings.warmup)}


def build_jobs(names: list[str], seeds: list[int], healthy_steps: int, fault_steps: int, onset: int,
               all_magnitudes: bool) -> list[dict]:
    """One job per seed: its healthy run (if asked for) and its fault cases."""
    jobs = []
    for seed in seeds:
        healthy = ({"case": "healthy", "magnitude": None, "default": True, "seed": seed}
                   if "healthy" in names else None)
        cases = []
        for name, (default, sweep) in GRID.items():
            if name not in names:
                continue
            kind = "loss_scale" if name.startswith("loss_scale") else name
            for m in (sweep if all_magnitudes else (default,)):
                case = {"case": kind, "magnitude": m, "default": m == default, "seed": seed,
                        "inject": {"kind": kind, "stages": ["sft"], "rank": FAULT_RANK, "start_step": onset,
                                   "magnitude": m}}
                if kind == "drop_microbatch":
                    micro, dropped = DROP_SPLITS[m]
                    case.update(micro_batch_size=micro, micro_batches_dropped=dropped)
                    case["inject"]["magnitude"] = dropped
                cases.append(case)
        jobs.append({"seed": seed, "healthy": healthy, "cases": cases, "onset": onset,
                     "healthy_steps": healthy_steps if healthy else onset, "fault_steps": fault_steps})
    return jobs


def summarise(results: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["case"], r["magnitude"]), []).append(r)
    for (case, m), rs in groups.items():
        if case == "healthy":
            continue
        hits = [r for r in rs if r["detected"] and r["named_rank"] == FAULT_RANK]
        delays = sorted(r["delay_steps"] for r in hits)
        print(json.dumps({"summary": case, "magnitude": m, "default": rs[0]["default"], "seeds": len(rs),
                          "detected_right_rank": len(hits), "max_delay": delays[-1] if delays else None,
                          "median_delay": delays[len(delays) // 2] if delays else None}))
    judged = sum(r["judged_steps"] for r in results if r["case"] == "healthy")
    false_alarms = sum(r["false_alarms"] for r in results if r["case"] == "healthy")
    print(json.dumps({"summary": "false_alarm_rate", "healthy_runs": sum(r["case"] == "healthy" for r in results),
                      "judged_steps": judged, "false_alarms": false_alarms,
                      "per_1000_steps": round(1000 * false_alarms / judged, 3) if judged else None}))


def main() -> None:
    from ars_opd.training.distributed import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # seeds 0-4 chose the detector's settings (window, k, design rate); the committed run uses fresh ones
    p.add_argument("--seeds", type=int, nargs="+", default=[5, 6, 7, 8, 9])
    p.add_argument("--cases", nargs="+", default=["healthy", *GRID])
    p.add_argument("--defaults-only", action="store_true", help="only each fault's default magnitude")
    p.add_argument("--fault-steps", type=int, default=60, help="steps a fault runs after its onset")
    p.add_argument("--healthy-steps", type=int, default=1000)
    p.add_argument("--onset", type=int, default=150)
    p.add_argument("--save-rows", type=Path, default=None)
    p.add_argument("--from-rows", type=Path, default=None, help="re-score saved rows instead of training")
    a = p.parse_args()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    settings = parse_section(ReportConfig, params["report"], "report")
    sft = {**params["sft"], "global_batch_size": 32, "micro_batch_size": 2, "checkpoint_every": 0,
           "steps": a.healthy_steps}
    results = []
    for job in build_jobs(a.cases, a.seeds, a.healthy_steps, a.fault_steps, a.onset, not a.defaults_only):
        if a.from_rows:
            lines = (a.from_rows / f"seed{job['seed']}.jsonl").read_text().splitlines()
            done = [json.loads(line) for line in lines]
        else:
            job.update(sft=sft, arch=params["models"]["student_arch"], rows=2000, data_seed=7,
                       drift_every=params["ddp"]["drift_check_every"])
            done = launch(run_seed, job, WORKERS, 1)
            if a.save_rows:
                a.save_rows.mkdir(parents=True, exist_ok=True)
                with open(a.save_rows / f"seed{job['seed']}.jsonl", "w") as f:
                    for d in done:
                        f.write(json.dumps(d) + "\n")
        for d in done:
            line = score(d, settings, a.onset)
            results.append(line)
            print(json.dumps(line), flush=True)
    summarise(results)


if __name__ == "__main__":
    main()
