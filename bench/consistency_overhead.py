"""Step-time overhead of the worker-consistency hook.

Starts ``--workers`` DDP workers (gloo on CPU, NCCL on GPU) through the engine's launcher. Each worker holds
two identical copies of a model: one wrapped in DDP with the consistency hook (and its per-step gather and
metrics), one in plain DDP. Steps alternate A B A B on the same batches (interleaved in one process tree,
so machine noise hits both alike); a step is forward + backward + all-reduce + AdamW. Prints one JSON
line: workers, params, step_s_without, step_s_with (medians), overhead_ratio (with / without).

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
from ars_opd.training.consistency import ConsistencyHook, consistency_metrics  # noqa: E402
from ars_opd.training.distributed import gather_floats, init_worker, launch, shutdown_worker  # noqa: E402
from ars_opd.training.geometry import BatchGeometry  # noqa: E402
from ars_opd.training.loop import accumulate_gradients, wrap_ddp  # noqa: E402
from ars_opd.training.optim import make_optimizer  # noqa: E402
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
                hook = ConsistencyHook(ctx.world_size)
                hook.attach(ddp)
            runs[name] = (model, ddp, hook, make_optimizer(model, cfg))
        task = SFTTask(data, cfg, geometry, sampler_seed=0, rank=ctx.rank, device=ctx.device, pad_id=0)
        times = {"with": [], "without": []}
        params = sum(p.numel() for p in {id(p): p for p in runs["with"][0].parameters()}.values())
        for step in range(job["steps"] + 2):
            order = ("with", "without") if step % 2 == 0 else ("without", "with")
            for name in order:
                model, ddp, hook, opt = runs[name]
                micro = task.micro_batches(step, model)
                if gpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if hook is not None:
                    hook.begin_step(step)
                local_sum, local_tokens, _, _ = accumulate_gradients(ddp, task, micro, ctx, cfg)
                vec = torch.tensor([local_sum, float(local_tokens)], dtype=torch.float64, device=ctx.device)
                if hook is not None:  # the engine's one gather carries the hook's scalars as well
                    vec = torch.cat([vec, hook.local_stats(ctx.device)])
                g = gather_floats(vec, ctx.device)
                norm = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()]).item()  # both runs
                if hook is not None:
                    consistency_metrics(g[:, 0].tolist(), g[:, 2].tolist(), g[:, 3].tolist(), norm * norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
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
    a = p.parse_args()
    job = {"preset": a.preset, "steps": a.steps, "micro": a.micro, "seq": a.seq, "threads": a.threads}
    print(json.dumps(launch(worker, job, a.workers, a.threads)))


if __name__ == "__main__":
    main()
