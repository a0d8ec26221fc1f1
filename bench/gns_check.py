"""Gradient noise scale: the engine's estimate from per-worker norms against a brute-force one.

K = 4 gloo workers train the built-in student (``params.yaml``'s ``models.student_arch``) by SFT on the
synthetic tasks for ``--train-steps`` steps, then freeze it (no optimiser steps, i.e. lr 0) and run
``--steps`` more steps of the engine's gradient accumulation with the consistency hook over the same
data. The estimate is what the engine logs (``ars_opd.training.consistency.noise_scale_terms``): per step
|G|² and tr Σ from the workers' ‖g_k‖², ‖ḡ‖² and token counts, averaged over the frozen steps
(numerator and denominator separately), B_simple = mean tr Σ / mean |G|² in tokens.

The brute force takes every training row's own gradient (the summed token-loss gradient ĝ_i of row i,
with n_i loss tokens) at the frozen weights: G = Σ ĝ_i / Σ n_i is the full-data gradient, and a batch of
b random rows (B = b·n̄ tokens) has a token-mean gradient with covariance trace E‖ĝ_i − n_i G‖² / (n̄·B),
so tr Σ (per token) = mean_i ‖ĝ_i − n_i G‖² / n̄ and B_simple = tr Σ / ‖G‖². The engine draws a step's
rows without replacement, which shrinks a batch's variance by 1 − b/M; with b = 32 of M = 4,096 rows that is
0.8%, and the 120 frozen steps (3,840 rows) stay within one epoch. |G|² is a small difference of two large
terms when the batch is far below B_simple, so the check runs early in training (where the gradient is larger against
the noise) and averages over many steps.

Prints one JSON line: {"estimate", "brute_force", "ratio", "frozen_steps", "rows", "tokens_per_step", ...}.

    python bench/gns_check.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ars_opd.config import ArchConfig, SFTConfig

REPO = Path(__file__).resolve().parents[1]


def worker(job: dict) -> dict:
    from ars_opd.config import ParallelConfig
    from ars_opd.data import synthetic
    from ars_opd.data.prompts import alpaca_messages
    from ars_opd.lm.batching import pad_right_with_labels
    from ars_opd.lm.cross_entropy import causal_lm_token_loss_sum
    from ars_opd.lm.optim import make_optimizer, make_scheduler
    from ars_opd.models.builtin import build_causal_lm
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.seeding import set_seeds
    from ars_opd.training.batch_plan import BatchGeometry
    from ars_opd.training.checkpoint import TrainerState
    from ars_opd.training.consistency import ConsistencyHook, noise_scale_terms
    from ars_opd.training.distributed import gather_floats, init_worker, shutdown_worker
    from ars_opd.training.loop import Trainer
    from ars_opd.training.sft import SFTTask, encode_sft_rows
    from ars_opd.training.worker import WorkerSetup
    from ars_opd.training.wrapping import wrap_ddp

    ctx = init_worker("cpu", "gloo", threads=1)
    try:
        tok = build_char_word_tokenizer(synthetic.instruction_words())
        rows = [
            {"messages": alpaca_messages(r["instruction"], r["input"]), "completion": r["output"], "task": r["task"]}
            for r in synthetic.generate(job["rows"], seed=11)
        ]
        cfg = SFTConfig(**job["sft"])
        data = encode_sft_rows(tok, rows, cfg)
        geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "bench")
        set_seeds(3)
        model = build_causal_lm(ArchConfig(**job["arch"]), tok, seed=5)
        task = SFTTask(data, cfg, WorkerSetup(ctx, tok, geometry, sampler_seed=17, stage_seed=0, fault=None))
        ddp = wrap_ddp(model, ctx, ParallelConfig(workers=ctx.world_size))
        hook = ConsistencyHook(ctx.world_size)
        hook.attach(ddp)
        opt = make_optimizer(model, cfg)
        sched = make_scheduler(opt, cfg, cfg.steps)
        state = TrainerState()
        while state.step < job["train_steps"]:  # bring the student to a mid-training checkpoint
            Trainer(model=ddp, task=task, opt=opt, sched=sched, ctx=ctx, cfg=cfg, state=state, monitor=hook).step()
            state.step += 1
        model.zero_grad(set_to_none=True)
        g2_sum = trace_sum = tokens = 0.0
        for step in range(job["train_steps"], job["train_steps"] + job["steps"]):  # frozen: no optimiser step
            micro = task.micro_batches(step, model)
            hook.begin_step(step)
            _, local_tokens, global_tokens, *_ = Trainer(model=ddp, task=task, ctx=ctx, cfg=cfg).accumulate(micro)
            g = gather_floats(
                torch.cat([torch.tensor([float(local_tokens)], dtype=torch.float64), hook.local_stats(ctx.device)]),
                ctx.device,
            )
            mean_sq = float(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
            g2, trace = noise_scale_terms(g[:, 1].tolist(), [int(t) for t in g[:, 0].tolist()], mean_sq)
            g2_sum, trace_sum, tokens = g2_sum + g2, trace_sum + trace, tokens + global_tokens
            model.zero_grad(set_to_none=True)
        # brute force: every row's own gradient ĝ_i, rows split over the ranks; streamed sums (memory O(P), not
        # O(rows·P)): S1 = Σ ĝ_i, S2 = Σ n_i ĝ_i, Q = Σ ‖ĝ_i‖², then Σ ‖ĝ_i − n_i G‖² = Q − 2 G·S2 + Σn_i² ‖G‖²
        n_params = sum(p.numel() for p in model.parameters())
        s1 = torch.zeros(n_params, dtype=torch.float64)
        s2 = torch.zeros(n_params, dtype=torch.float64)
        scalars = torch.zeros(4, dtype=torch.float64)  # Q, Σ n_i, Σ n_i², rows
        for i in range(ctx.rank, len(data.prompts), ctx.world_size):
            b = pad_right_with_labels([data.prompts[i]], [data.completions[i]], tok.pad_token_id)
            with ddp.no_sync():  # a local gradient: nothing is all-reduced
                logits = ddp(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                ls, n = causal_lm_token_loss_sum(logits, b["labels"])
                ls.backward()
            g_i = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])  # (P,)
            n_i = float(n)
            s1 += g_i
            s2 += n_i * g_i
            scalars += torch.tensor([float(g_i.pow(2).sum()), n_i, n_i * n_i, 1.0], dtype=torch.float64)
            model.zero_grad(set_to_none=True)
        for t in (s1, s2, scalars):
            dist.all_reduce(t)
        q, n_sum, n2_sum, n_rows = scalars.tolist()
        G = s1 / n_sum
        n_bar = n_sum / n_rows
        dev = q - 2 * float(G @ s2) + n2_sum * float(G.pow(2).sum())
        trace_bf = dev / n_rows / n_bar
        brute = trace_bf / float(G.pow(2).sum())
        estimate = trace_sum / g2_sum
        del ddp
        return {
            "estimate": round(estimate, 1),
            "brute_force": round(brute, 1),
            "ratio": round(estimate / brute, 4),
            "frozen_steps": job["steps"],
            "rows": len(data.prompts),
            "tokens_per_step": round(tokens / job["steps"], 1),
            "g2_estimate": g2_sum / job["steps"],
            "g2_brute_force": float(G.pow(2).sum()),
            "trace_estimate": trace_sum / job["steps"],
            "trace_brute_force": trace_bf,
            "workers": ctx.world_size,
            "train_steps": job["train_steps"],
        }
    finally:
        shutdown_worker()


def main() -> None:
    from ars_opd.training.distributed import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--steps", type=int, default=120, help="frozen steps the estimate averages over")
    a = p.parse_args()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    sft = {
        **params["sft"],
        "global_batch_size": 32,
        "micro_batch_size": 8,
        "checkpoint_every": 0,
        "steps": a.train_steps,
    }
    SFTConfig(**sft)  # validate early
    job = {
        "rows": a.rows,
        "sft": sft,
        "arch": params["models"]["student_arch"],
        "train_steps": a.train_steps,
        "steps": a.steps,
    }
    ArchConfig(**job["arch"])
    print(json.dumps(launch(worker, job, a.workers, 1)))


if __name__ == "__main__":
    main()
