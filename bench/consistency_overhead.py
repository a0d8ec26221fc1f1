"""Step-time overhead of everything the consistency monitor adds to a training step, and of each part.

Starts ``--workers`` DDP workers (gloo on CPU, NCCL on GPU) through the engine's launcher. Each worker holds
two identical copies of a model and runs the engine's own ``Trainer.step`` on both: "with" has the
consistency hook (per-worker norms and cross terms, per-rank statistics, the gradient noise scale) and the
replica-drift fingerprint check every ``--drift-every`` steps; "without" has neither. A step is forward +
backward + all-reduce + clipping + AdamW + the log's gather.

Robust to a loaded machine: steps alternate A B / B A on the same batches (interleaved in one process
tree, so machine noise hits both alike), in ``--rounds`` rounds of ``--round-steps`` steps after a warm-up.
A round's ratio is its total time with over its total time without: a mean over a whole number of drift
periods, so the periodic fingerprint counts at its real rate (a median over steps would skip it). The
result is the median round ratio with its min and max; a quiet machine shows a narrow spread, and
``step_s_without`` far above ``cpu_step_s_without`` shows a machine busy with other work.

Per part (``parts``: ms per step and % of the step without the monitor, on rank 0, from the engine's own
timers, ``StepResult.monitor_s``): ``hook`` the comm hook's norms (and for K > 2 its clones and cross terms),
not the all-reduce DDP does anyway (host time: on a GPU, its kernel launches only); ``stats`` the per-rank
statistics (bucket sums; the Gram matrix on Gram steps), whose gather is the engine's own per-step gather, 16
bytes more per rank; ``metrics`` and ``noise_scale`` the per-step formulas; ``drift`` this rank's fingerprint
and ``drift_gather`` its all-gather (which also waits for the slower rank), both averaged over all steps.
``unattributed_ms`` is the measured overhead less the parts: calling a Python comm hook instead of DDP's
built-in all-reduce, and noise. ``cpu_overhead_ratio`` is the same median in process CPU time. Both models'
weights are compared at the end (``weights_identical``: the monitor only observes). Rank 0 prints a line per
round on stderr and one JSON line on stdout.

    python bench/consistency_overhead.py        # CPU: 2 workers, 7.3M parameters, ~2.5 min on a quiet machine
    python bench/consistency_overhead.py --workers 1 --preset qwen3-0.6b   # GPU, world size 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from workload import PRESETS, BenchRun, preset_model, random_sft_task

from ars_opd.config import ParallelConfig
from ars_opd.training.distributed import init_worker, launch, shutdown_worker

PARTS = ("hook", "stats", "metrics", "noise_scale", "drift", "drift_gather")


def _summary(rounds: list[dict], parts: dict[str, float], timed: int) -> dict:
    """The JSON figures from per-round totals (seconds) and per-part seconds summed over ``timed`` steps."""
    ratios = [r["with"] / r["without"] for r in rounds]
    cpu = [r["cpu_with"] / r["cpu_without"] for r in rounds]
    per_step = [r["without"] / r["steps"] for r in rounds]
    cpu_step = statistics.median(r["cpu_without"] / r["steps"] for r in rounds)
    step_without = statistics.median(per_step)
    step_with = statistics.median(r["with"] / r["steps"] for r in rounds)
    part_ms = {k: parts[k] / timed * 1e3 for k in PARTS}
    ratio = statistics.median(ratios)
    overhead_ms = (ratio - 1) * step_without * 1e3  # the overhead the reported ratio stands for
    return {
        "step_s_without": round(step_without, 5),
        "step_s_with": round(step_with, 5),
        "step_s_without_min": round(min(per_step), 5),
        "step_s_without_max": round(max(per_step), 5),
        "cpu_step_s_without": round(cpu_step, 5),
        "overhead_ratio": round(ratio, 4),
        "overhead_ratio_min": round(min(ratios), 4),
        "overhead_ratio_max": round(max(ratios), 4),
        "round_ratios": [round(x, 4) for x in ratios],
        "cpu_overhead_ratio": round(statistics.median(cpu), 4),
        "parts": {
            k: {"ms_per_step": round(v, 3), "pct_of_step": round(100 * v / (step_without * 1e3), 3)}
            for k, v in part_ms.items()
        },
        "parts_ms_per_step": round(sum(part_ms.values()), 3),
        "unattributed_ms": round(overhead_ms - sum(part_ms.values()), 3),
    }


def worker(job: dict) -> dict:
    ctx = init_worker("auto", "auto", threads=job["threads"])
    try:
        gpu = ctx.device.type == "cuda"
        total = job["warmup"] + job["rounds"] * job["round_steps"]
        vocab = PRESETS[job["preset"]]["vocab_size"]
        cfg, task = random_sft_task(ctx, vocab, total, job["micro"], job["seq"], precision="auto")
        ddp_cfg = ParallelConfig(workers=ctx.world_size)
        runs = {
            name: BenchRun.start(
                preset_model(job["preset"], ctx.device), ctx, cfg, ddp_cfg, name == "with", gram_every=50
            )
            for name in ("with", "without")
        }
        params = sum(p.numel() for p in {id(p): p for p in runs["with"].model.parameters()}.values())
        load_before = os.getloadavg()[0]
        rounds, parts = [], dict.fromkeys(PARTS, 0.0)
        for step in range(total):
            r = (step - job["warmup"]) // job["round_steps"]
            if r >= 0 and r == len(rounds):
                rounds.append({"steps": 0, "with": 0.0, "without": 0.0, "cpu_with": 0.0, "cpu_without": 0.0})
            order = ("with", "without") if step % 2 == 0 else ("without", "with")
            for name in order:
                run = runs[name]
                if gpu:
                    torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.process_time()
                result = run.step(task, ctx, cfg, job["drift_every"] if run.hook is not None else 0)
                if gpu:
                    torch.cuda.synchronize()
                if r >= 0:
                    rounds[r][name] += time.perf_counter() - t0
                    rounds[r][f"cpu_{name}"] += time.process_time() - c0
                    if name == "with":
                        for k, v in result.monitor_s.items():
                            parts[k] += v
            if r >= 0:
                rounds[r]["steps"] += 1
                if ctx.is_main and rounds[r]["steps"] == job["round_steps"]:
                    x = rounds[r]
                    print(
                        f"round {r + 1}/{job['rounds']}: step {x['without'] / x['steps']:.4f} s without, "
                        f"{x['with'] / x['steps']:.4f} s with, ratio {x['with'] / x['without']:.4f}",
                        file=sys.stderr,
                        flush=True,
                    )
        identical = all(
            torch.equal(a, b) for a, b in zip(runs["with"].model.parameters(), runs["without"].model.parameters())
        )
        for name in list(runs):
            del runs[name]
        return {
            "workers": ctx.world_size,
            "device": str(ctx.device),
            "params": params,
            "rounds": job["rounds"],
            "round_steps": job["round_steps"],
            "drift_every": job["drift_every"],
            **_summary(rounds, parts, job["rounds"] * job["round_steps"]),
            "weights_identical": identical,
            "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        }
    finally:
        shutdown_worker()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-6m")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (the ratio is their median)")
    p.add_argument(
        "--round-steps",
        type=int,
        default=None,
        help="steps per round; a multiple of --drift-every (default: --drift-every, or 10)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocations, bucket rebuild)")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drift-every", type=int, default=10, help="replica fingerprint check interval (as ddp)")
    a = p.parse_args()
    round_steps = a.round_steps or a.drift_every or 10
    if a.rounds < 1 or round_steps < 1 or (a.drift_every and round_steps % a.drift_every):
        p.error("--rounds >= 1, and --round-steps a positive multiple of --drift-every")
    job = {
        "preset": a.preset,
        "rounds": a.rounds,
        "round_steps": round_steps,
        "warmup": a.warmup,
        "micro": a.micro,
        "seq": a.seq,
        "threads": a.threads,
        "drift_every": a.drift_every,
    }
    print(json.dumps(launch(worker, job, a.workers, a.threads)))


if __name__ == "__main__":
    main()
