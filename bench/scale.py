"""Per-rank memory, step time and consistency overhead of ddp, fsdp and ddp + LoRA (JSON lines).

Starts ``--workers`` workers (gloo on CPU) through the engine's launcher; each runs the engine's own
``Trainer.step`` on a Llama-shaped student (``--preset``; ``cpu-50m``: 48.5M parameters, vocabulary 32,000,
10 layers of width 512, tied head) for each strategy in turn:

- ``ddp``: the whole student on every worker (DDP);
- ``fsdp``: sharded with FSDP2 (``ars_opd.training.sharding``);
- ``fsdp-kept``: the same with ``ddp.fsdp_reshard_after_forward: false`` (each layer's gathered weights kept
  from its forward to its backward: one all-gather per layer per step instead of two);
- ``ddp+lora``: a LoRA adapter (r = ``--lora-r``, every linear layer of the blocks) on the frozen student, DDP.

Memory, per rank, in bytes:

- ``state``: weights (this rank's storage: its shards under fsdp) + gradients (one per trainable element
  held by this rank) + AdamW state (``exp_avg``, ``exp_avg_sq``), counted exactly from the tensors;
- ``step_extra_peak``: from the allocator's events (``torch.profiler`` with ``profile_memory``: every
  allocation and free, in order): the highest live total reached during the first two steps above what was
  live when they began (the gradients, the optimizer state as AdamW creates it, activations and
  communication buffers). Not RSS.

Time: ``step_s``, the median step of the run without the monitor; ``overhead_ratio``: the consistency
monitor (hook, statistics, noise scale) on against off, two identical copies stepping alternately on the same
batches in ``--rounds`` rounds, the median of the rounds' time ratios. Rank 0 prints one JSON line per
strategy and a summary line with the ratios the README quotes.

    python bench/scale.py                      # CPU, 2 workers, ~48.5M parameters
    python bench/scale.py --preset tiny        # seconds (tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from loss_memory import cpu_extra_peak
from workload import PRESETS, BenchRun, preset_model, random_sft_task

from ars_opd.config import AdapterConfig, ParallelConfig
from ars_opd.models.adapters import attach
from ars_opd.training.distributed import init_worker, launch, shutdown_worker

STRATEGIES = ("ddp", "fsdp", "fsdp-kept", "ddp+lora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(preset: str, strategy: str, lora_r: int):
    model = preset_model(preset)
    if strategy == "ddp+lora":
        model = attach(model, AdapterConfig(kind="lora", r=lora_r, alpha=2.0 * lora_r, target_modules=TARGETS))
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = _local(t)
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _state_bytes(model, opt) -> dict:
    params = list({id(p): p for p in model.parameters()}.values())
    weights = _storage_bytes(params)
    grads = sum(_local(p).numel() * _local(p).element_size() for p in params if p.requires_grad)
    optim = _storage_bytes(
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    )
    return {"weights": weights, "grads": grads, "optimizer": optim, "state": weights + grads + optim}


def _run_strategy(job: dict, strategy: str, ctx) -> dict:
    vocab = PRESETS[job["preset"]]["vocab_size"]
    total = 2 + job["rounds"] * job["round_steps"]
    cfg, task = random_sft_task(ctx, vocab, total, job["micro"], job["seq"], max_grad_norm=1.0)
    sharded = strategy.startswith("fsdp")
    ddp_cfg = ParallelConfig(
        workers=ctx.world_size,
        strategy="fsdp" if sharded else "ddp",
        fsdp_reshard_after_forward=strategy != "fsdp-kept",
    )
    runs = {
        name: BenchRun.start(_model(job["preset"], strategy, job["lora_r"]), ctx, cfg, ddp_cfg, name == "with")
        for name in ("without", "with")
    }
    total_params = sum(p.numel() for p in {id(p): p for p in runs["with"].model.parameters()}.values())
    trainable = sum(p.numel() for p in runs["with"].model.parameters() if p.requires_grad)

    def step(name):
        t0 = time.perf_counter()
        runs[name].step(task, ctx, cfg)
        return time.perf_counter() - t0

    # the first two steps: gradients, AdamW's state and buffers appear here
    peak = cpu_extra_peak(lambda: [step("without") for _ in range(2)])
    for _ in range(2):
        step("with")
    model_wo, opt_wo = runs["without"].model, runs["without"].opt
    memory = _state_bytes(model_wo, opt_wo)
    rounds, times = [], []
    for r in range(job["rounds"]):
        spent = {"with": 0.0, "without": 0.0}
        for i in range(job["round_steps"]):
            for name in ("with", "without") if i % 2 == 0 else ("without", "with"):
                s = step(name)
                spent[name] += s
                if name == "without":
                    times.append(s)
        rounds.append(spent["with"] / spent["without"])
    return {
        "strategy": strategy,
        "workers": ctx.world_size,
        "parameters": total_params,
        "trainable": trainable,
        **{f"{k}_bytes": v for k, v in memory.items()},
        "step_extra_peak_bytes": peak,
        "step_s": round(statistics.median(times), 4),
        "overhead_ratio": round(statistics.median(rounds), 4),
        "overhead_ratio_rounds": [round(x, 4) for x in rounds],
    }


def worker(job: dict) -> list[dict]:
    ctx = init_worker("cpu", "gloo", threads=job["threads"])
    try:
        return [_run_strategy(job, s, ctx) for s in job["strategies"]]
    finally:
        shutdown_worker()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="cpu-50m", choices=sorted(PRESETS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--round-steps", type=int, default=4)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    args = ap.parse_args()
    job = {**vars(args), "strategies": args.strategies.split(",")}
    rows = launch(worker, job, args.workers, args.threads, in_process=False)
    for row in rows:
        print(json.dumps({"bench": "scale", "preset": args.preset, **row}), flush=True)
    by = {r["strategy"]: r for r in rows}
    summary = {"bench": "scale", "summary": True, "preset": args.preset, "workers": args.workers}
    if "ddp" in by and "fsdp" in by:
        summary["fsdp_over_ddp_state"] = round(by["fsdp"]["state_bytes"] / by["ddp"]["state_bytes"], 4)
        summary["fsdp_over_ddp_step_extra_peak"] = round(
            by["fsdp"]["step_extra_peak_bytes"] / by["ddp"]["step_extra_peak_bytes"], 4
        )
        summary["fsdp_over_ddp_step_s"] = round(by["fsdp"]["step_s"] / by["ddp"]["step_s"], 4)
    if "ddp" in by and "fsdp-kept" in by:
        kept = by["fsdp-kept"]
        summary["fsdp_kept_over_ddp_state"] = round(kept["state_bytes"] / by["ddp"]["state_bytes"], 4)
        summary["fsdp_kept_over_ddp_step_extra_peak"] = round(
            kept["step_extra_peak_bytes"] / by["ddp"]["step_extra_peak_bytes"], 4
        )
        summary["fsdp_kept_over_ddp_step_s"] = round(kept["step_s"] / by["ddp"]["step_s"], 4)
    if "ddp" in by and "ddp+lora" in by:
        summary["lora_over_full_optimizer"] = round(by["ddp+lora"]["optimizer_bytes"] / by["ddp"]["optimizer_bytes"], 5)
        summary["lora_over_full_state"] = round(by["ddp+lora"]["state_bytes"] / by["ddp"]["state_bytes"], 4)
    summary["overhead_ratio"] = {r["strategy"]: r["overhead_ratio"] for r in rows}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
