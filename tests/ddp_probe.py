"""Worker functions for DDP tests (importable by spawned workers: tests/ is on their sys.path)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ars_opd.config import ArchConfig, DDPConfig, SFTConfig
from ars_opd.distributed import init_worker, shutdown_worker
from ars_opd.engine import BatchGeometry, accumulate_gradients, wrap_ddp
from ars_opd.models import build_causal_lm
from ars_opd.sft import EncodedData, SFTTask

ARCH = ArchConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


def tiny_model(tokenizer, seed: int = 0):
    model = build_causal_lm(ARCH, tokenizer, seed=seed)
    # fp32 everywhere; eager attention keeps the reference computation simple
    return model


def grad_probe(job: dict) -> dict:
    """One step's reduced gradient for a fixed global batch split as job['micro'] per micro-batch."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        # the DDP wrapper must be gone before the process group is destroyed (its destructor can block)
        return _grad_probe(job, ctx)
    finally:
        shutdown_worker()


def _grad_probe(job: dict, ctx) -> dict:
    from ars_opd import synthetic
    from ars_opd.tokenizer import build_char_word_tokenizer

    tok = build_char_word_tokenizer(synthetic.instruction_words())
    model = tiny_model(tok)
    data = EncodedData(job["prompts"], job["completions"], {})
    cfg = SFTConfig(steps=1, global_batch_size=len(job["prompts"]), micro_batch_size=job["micro"],
                    packing=job.get("packing", False), pack_length=job.get("pack_length", 512),
                    max_seq_len=job.get("pack_length", 512))
    geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "sft")
    task = SFTTask(data, cfg, geometry, sampler_seed=0, ctx=ctx, pad_id=tok.pad_token_id)
    ddp = wrap_ddp(model, ctx, DDPConfig(workers=ctx.world_size,
                                         gradient_as_bucket_view=job.get("bucket_view", True)))
    micro = task.micro_batches(0, model)
    local_sum, _, global_tokens, _ = accumulate_gradients(ddp, task, micro, ctx, cfg)
    total = torch.tensor([local_sum], dtype=torch.float64)
    dist.all_reduce(total)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": total.item() / global_tokens, "tokens": global_tokens, "grads": grads,
            "n_micro": len(micro)}
