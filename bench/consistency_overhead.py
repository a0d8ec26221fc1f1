"""Step-time overhead of everything the consistency monitor adds to a training step.

Starts ``--workers`` DDP workers (gloo on CPU, NCCL on GPU) through the engine's launcher. Each worker holds
two identical copies of a model and runs the engine's own ``train_step`` on both: "with" has the
consistency hook (per-worker norms and cross terms, per-rank statistics, the gradient noise scale) and the
replica-drift fingerprint check every ``--drift-every`` steps; "without" has neither. Steps alternate A B
A B on the same batches (interleaved in one process tree, so machine noise hits both alike); a step is
forward + backward + all-reduce + clipping + AdamW + the log's gather. Prints one JSON line: workers,
params, step_s_without, step_s_with (medians), overhead_ratio (with / without).

    python bench/consistency_overhead.py                          # CPU: 2 workers, ~6M parameters
    python bench/consistency_overhead.py --workers 1 --preset qwen3-0.6b   # GPU, world size 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ars_opd.config import DDPConfig, SFTConfig  # noqa: E402
from ars_opd.training.checkpoint import TrainerState  # noqa: E402
from ars_opd.training.consistency import ConsistencyHook  # noqa: E402
from ars_opd.training.distributed import init_worker, launch, shutdown_worker  # noqa: E402
from ars_opd.training.geometry import BatchGeometry  # noqa: E402
from ars_opd.training.loop import train_step, wrap_ddp  # noqa: E402
from ars_opd.training.optim import make_optimizer, make_scheduler  # noqa: E402
from ars_opd.training.sft import EncodedData, SFTTask  # noqa: E402

PRESETS = {
    "cpu-6m": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=4, head_dim=64, family="llama"),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, family="qwen3"),
}


def _model(preset: str, device):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    spec = dict(PRESETS[preset])
    cls = Qwen3Config if spec.pop("family") == "qwen3" else LlamaConfig
    torch.manual_seed(0)
    attn = "sdpa" if device.type == "cuda" else "eager"
    return AutoModelForCausalLM.from_config(cls(tie_word_embeddings=True, **spec), dtype=torch.float32,
                                            attn_implementation=attn).to(device)


def worker(job: dict) -> dict:
    ctx = init_worker("auto", "auto", threads=job["threads"])
    try:
        gpu = ctx.device.type == "cuda"
        rng = random.Random(ctx.rank)
        vocab = PRESETS[job["preset"]]["vocab_size"]
        n = job["micro"] * (job["steps"] + 2)
        data = EncodedData([[rng.randrange(10, vocab) for _ in range(job["seq"] // 2)] for _ in range(n)],
                           [[rng.randrange(10, vocab) for _ in range(job["seq"] // 2)] for _ in range(n)], {})
        cfg = SFTConfig(steps=job["steps"], warmup_steps=0, global_batch_size=job["micro"] * ctx.world_size,
                        micro_batch_size=job["micro"], precision="auto", max_seq_len=job["seq"])
        geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "bench")
        runs = {}
        for name in ("with", "without"):
            model = _model(job["preset"], ctx.device)
            ddp = wrap_ddp(model, ctx, DDPConfig(workers=ctx.world_size))
            hook = None
            if name == "with":
                hook = ConsistencyHook(ctx.world_size, gram_every=50)
                hook.attach(ddp)
            opt = make_optimizer(model, cfg)
            runs[name] = (model, ddp, hook, opt, make_scheduler(opt, cfg, cfg.steps), TrainerState())
        task = SFTTask(data, cfg, geometry, sampler_seed=0, rank=ctx.rank, device=ctx.device, pad_id=0)
        times = {"with": [], "without": []}
        params = sum(p.numel() for p in {id(p): p for p in runs["with"][0].parameters()}.values())
        for step in range(job["steps"] + 2):
            order = ("with", "without") if step % 2 == 0 else ("without", "with")
            for name in order:
                model, ddp, hook, opt, sched, state = runs[name]
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                train_step(ddp, task, opt, sched, ctx, cfg, state, hook, None,
                           job["drift_every"] if hook is not None else 0)
                state.step += 1
                if gpu:
                    torch.cuda.synchronize()
                if step >= 2:
                    times[name].append(time.perf_counter() - t0)
        a, b = statistics.median(times["with"]), statistics.median(times["without"])
        for name in list(runs):
            del runs[name]
        return {"workers": ctx.world_size, "device": str(ctx.device), "params": params,
                "step_s_without": round(b, 5), "step_s_with": round(a, 5), "overhead_ratio": round(a / b, 4),
                "steps": job["steps"]}
    finally:
        shutdown_worker()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-6m")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--drift-every", type=int, default=10, help="replica fingerprint check interval (as ddp)")
    a = p.parse_args()
    job = {"preset": a.preset, "steps": a.steps, "micro": a.micro, "seq": a.seq, "threads": a.threads,
           "drift_every": a.drift_every}
    print(json.dumps(launch(worker, job, a.workers, a.threads)))


if __name__ == "__main__":
    main()
