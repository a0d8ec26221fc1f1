"""SFT training throughput: padded vs padding-free packed batches on an Alpaca-like length mix.

Runs the engine's real SFT path (``SFTTask`` micro-batches, ``Trainer.accumulate`` with the global
token normalisation, clipping, AdamW) in one worker and prints one JSON line per configuration:
device, params, attention (packed rows: ``ars_opd.lm.attention``'s choice), tokens_per_s (real, non-padding
tokens), mfu (6 * params * tokens/s over the device's bf16 dense peak; null on CPU), padding_fraction.
``bench/gpu.py`` is the fuller GPU measurement (compiled, exact FLOP count, rollouts, OPD).

    python bench/sft_throughput.py                        # CPU: a ~5M-parameter Llama-shaped model
    python bench/sft_throughput.py --preset qwen3-0.6b    # GPU: Qwen3-0.6B shape built from config, bf16

Imports neither dvc, datasets nor openai (the GPU test machine lacks them).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from types import SimpleNamespace

import torch
from workload import PRESETS, preset_model

from ars_opd.config import ParallelConfig, SFTConfig
from ars_opd.lm.attention import use_packed_attention
from ars_opd.lm.optim import make_optimizer
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.checkpoint import TrainerState
from ars_opd.training.distributed import init_worker, shutdown_worker
from ars_opd.training.loop import Trainer
from ars_opd.training.sft import EncodedData, SFTTask
from ars_opd.training.worker import WorkerSetup
from ars_opd.training.wrapping import wrap_ddp

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def alpaca_like_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, completion) lengths, log-uniform between lo and hi in total, prompt ~40% of it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        total = int(round(lo * (hi / lo) ** rng.random()))
        p = max(4, int(total * rng.uniform(0.2, 0.6)))
        out.append((p, max(2, total - p)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--lengths", type=int, nargs=2, default=None, help="min and max sequence length")
    args = p.parse_args()
    ctx = init_worker("auto", "auto", threads=0)
    gpu = ctx.device.type == "cuda"
    preset = args.preset or ("qwen3-0.6b" if gpu else "cpu-small")
    steps = args.steps or (20 if gpu else 6)
    micro = args.micro_batch or (16 if gpu else 8)
    lo, hi = args.lengths or ((64, 1024) if gpu else (32, 256))
    model, vocab = preset_model(preset, ctx.device, max_position_embeddings=4096), PRESETS[preset]["vocab_size"]
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if gpu and k in torch.cuda.get_device_name()), None)
    rng = random.Random(1)
    lengths = alpaca_like_lengths(micro * (steps + 2), lo, hi)
    prompts = [[rng.randrange(10, vocab) for _ in range(a)] for a, _ in lengths]
    completions = [[rng.randrange(10, vocab) for _ in range(b)] for _, b in lengths]
    data = EncodedData(prompts, completions, {})
    plain = model.config._attn_implementation
    for packing in (False, True):
        attention = use_packed_attention(model, "auto") if packing else plain
        if not packing:
            model.set_attn_implementation(plain)
        cfg = SFTConfig(
            steps=steps + 2,
            warmup_steps=0,
            global_batch_size=micro,
            micro_batch_size=micro,
            packing=packing,
            pack_length=max(hi, 2048 if gpu else 512),
            max_seq_len=hi,
            max_grad_norm=1.0,
            precision="auto",
        )
        geometry = BatchGeometry.check(micro, ctx.world_size, micro, "sft")
        task = SFTTask(
            data,
            cfg,
            WorkerSetup(ctx, SimpleNamespace(pad_token_id=0), geometry, sampler_seed=0, stage_seed=0, fault=None),
            vocab=vocab,
        )
        ddp = wrap_ddp(model, ctx, ParallelConfig(workers=1))
        opt = make_optimizer(model, cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        state, real, total, elapsed = TrainerState(), 0, 0, 0.0
        trainer = Trainer(ctx=ctx, model=ddp, task=task, cfg=cfg, opt=opt, sched=sched, state=state)
        for step in range(steps + 2):
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            mb = task.micro_batches(step, model)
            trainer.accumulate(mb)
            trainer.optimizer_step(1.0)
            if gpu:
                torch.cuda.synchronize()
            if step >= 2:  # warm-up steps not counted
                elapsed += time.perf_counter() - t0
                real += sum(b.n_real_tokens for b in mb)
                total += sum(b.tensors["input_ids"].numel() for b in mb)
        tps = real / elapsed
        print(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name() if gpu else "cpu",
                    "preset": preset,
                    "params": n_params,
                    "batching": "packed" if packing else "padded",
                    "attention": attention,
                    "lengths": [lo, hi],
                    "micro_batch": micro,
                    "tokens_per_s": round(tps, 1),
                    "mfu": round(6 * n_params * tps / peak, 4) if peak else None,
                    "padding_fraction": round(1 - real / total, 4),
                }
            ),
            flush=True,
        )
        del ddp
    shutdown_worker()


if __name__ == "__main__":
    main()
