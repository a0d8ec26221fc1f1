"""Worker functions for DDP tests (importable by spawned workers: tests/ is on their sys.path)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ars_opd.config import ArchConfig, ParallelConfig, SFTConfig
from ars_opd.models.builtin import build_causal_lm
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.distributed import init_worker, shutdown_worker
from ars_opd.training.loop import Trainer
from ars_opd.training.sft import EncodedData, SFTTask
from ars_opd.training.worker import WorkerSetup
from ars_opd.training.wrapping import wrap_ddp, wrap_model

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
    from ars_opd.data import synthetic
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    tok = build_char_word_tokenizer(synthetic.instruction_words())
    model = tiny_model(tok)
    if job.get("packing"):
        from ars_opd.lm.attention import use_packed_attention

        use_packed_attention(model, job.get("packed_attention", "auto"))
    data = EncodedData(job["prompts"], job["completions"], {})
    cfg = SFTConfig(
        steps=1,
        warmup_steps=0,
        global_batch_size=len(job["prompts"]),
        micro_batch_size=job["micro"],
        packing=job.get("packing", False),
        pack_length=job.get("pack_length", 512),
        max_seq_len=job.get("pack_length", 512),
    )
    geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, "sft")
    task = SFTTask(data, cfg, WorkerSetup(ctx, tok, geometry, sampler_seed=0, stage_seed=0, fault=None), vocab=len(tok))
    if job.get("per_sequence"):
        task = PerSequence(task)
    ddp_cfg = ParallelConfig(
        workers=ctx.world_size,
        gradient_as_bucket_view=job.get("bucket_view", True),
        strategy=job.get("strategy", "ddp"),
        fsdp_reshard_after_forward=job.get("reshard_after_forward", True),
    )
    ddp = wrap_model(model, ctx, ddp_cfg, cfg)  # DDP, or the model itself sharded in place (fsdp)
    micro = task.micro_batches(0, model)
    acc = Trainer(model=ddp, task=task, ctx=ctx, cfg=cfg).accumulate(micro)
    total = torch.tensor([acc.local_sum], dtype=torch.float64)
    dist.all_reduce(total)
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g  # noqa: E731  (sharded: gathered)
    grads = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
    return {
        "loss": total.item() / acc.global_units,
        "tokens": acc.global_tokens,
        "units": acc.global_units,
        "grads": grads,
        "n_micro": len(micro),
    }


class PerSequence:
    """An SFT task whose loss averages each sequence's token cross-entropy first and the step over sequences
    (``MicroBatch.units``: the engine's normaliser counts sequences), as ``opd.loss_normalisation: sequence``
    does: each token weighs 1 / its sequence's loss tokens (``ars_opd.lm.batching.sequence_weights``)."""

    def __init__(self, task):
        self.task = task

    def metric_names(self):
        return self.task.metric_names()

    def teacher_tokens(self, step):
        return self.task.teacher_tokens(step)

    def micro_batches(self, step, model):
        out = self.task.micro_batches(step, model)
        for b in out:
            b.units = b.n_sequences
        return out

    def loss_sum(self, model, batch):
        from ars_opd.lm.batching import sequence_weights
        from ars_opd.lm.cross_entropy import shifted_targets
        from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows

        t = batch.tensors
        mask, targets = shifted_targets(t["labels"])
        hidden = select_rows(last_hidden_states(model, t["input_ids"], t["attention_mask"]), mask)
        logits = torch.nn.functional.linear(hidden, OutputHead.of(model).weight).float()
        per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        return (per_token * sequence_weights(mask)).sum(), {}


class FixedTask:
    """Per-rank micro-batches given explicitly (for consistency tests): job['batches'][rank][micro]."""

    def __init__(self, batches, ctx, pad_id, identical: bool):
        from ars_opd.lm.batching import count_loss_tokens, pad_right_with_labels
        from ars_opd.training.task import MicroBatch

        mine = batches[0] if identical else batches[ctx.rank]
        self.micro = []
        for p, c in mine:
            t = pad_right_with_labels(p, c, pad_id)
            self.micro.append(MicroBatch(t, count_loss_tokens(t["labels"]), len(p)))

    def metric_names(self):
        return []

    def micro_batches(self, step, model):
        return self.micro

    def teacher_tokens(self, step):
        return 0

    def loss_sum(self, model, batch):
        # the pipeline's loss path: last hidden states through DDP's forward, the head in chunks
        from ars_opd.lm.cross_entropy import causal_lm_loss_from_hidden
        from ars_opd.lm.head import OutputHead, last_hidden_states

        t = batch.tensors
        hidden = last_hidden_states(model, t["input_ids"], t["attention_mask"])
        return causal_lm_loss_from_hidden(hidden, OutputHead.of(model), t["labels"], chunk_size=5)[0], {}


def _brute_force(ddp, task, ctx, cfg):
    """Every statistic from all-gathered flattened local gradients (no_sync: nothing is reduced)."""
    model = ddp.module
    local_tokens = sum(b.n_tokens for b in task.micro)
    n = torch.tensor([float(local_tokens)], dtype=torch.float64)
    dist.all_reduce(n)
    scale = ctx.world_size / n.item()
    loss_sum = 0.0
    with ddp.no_sync():
        for b in task.micro:
            ls, _ = task.loss_sum(ddp, b)
            (ls * scale).backward()
            loss_sum += ls.item()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    parts = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(parts, flat)
    losses = [torch.zeros(1, dtype=torch.float64) for _ in range(ctx.world_size)]
    dist.all_gather(losses, torch.tensor([loss_sum / local_tokens], dtype=torch.float64))
    model.zero_grad(set_to_none=True)
    return brute_force_statistics(torch.stack(parts), [float(x) for x in torch.cat(losses)])


def brute_force_statistics(G: torch.Tensor, wl: list[float]) -> dict:
    """Every consistency statistic from the (K, P) matrix of all workers' flattened local gradients."""
    K, mean, norms = G.shape[0], G.mean(0), G.norm(dim=1)
    cos = [float(torch.dot(G[i], G[j]) / (norms[i] * norms[j])) for i in range(K) for j in range(i + 1, K)]
    return {
        "worker_loss": wl,
        "loss_dispersion": float(torch.tensor(wl).std(unbiased=False)),
        "grad_norm_dispersion": float(norms.std(unbiased=False)),
        "worker_grad_norm": norms.tolist(),
        "worker_cos_to_mean": [float(torch.dot(G[k], mean) / (norms[k] * mean.norm())) for k in range(K)],
        "gradient_diversity": float((norms**2).sum() / G.sum(0).pow(2).sum()),
        "grad_direction_consistency": sum(cos) / len(cos) if cos else float("nan"),
        "mean": mean,
        "abs_mean": G.abs().mean(0),
    }


def consistency_probe(job: dict) -> list:
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        return _consistency_probe(job, ctx)
    finally:
        shutdown_worker()


def _consistency_probe(job: dict, ctx) -> list:
    from ars_opd.data import synthetic
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.training.consistency import ConsistencyHook

    tok = build_char_word_tokenizer(synthetic.instruction_words())
    model = tiny_model(tok)
    cfg = SFTConfig(steps=job["steps"], warmup_steps=0, global_batch_size=8, micro_batch_size=1)
    task = FixedTask(job["batches"], ctx, tok.pad_token_id, job.get("identical", False))
    ddp = wrap_ddp(
        model,
        ctx,
        ParallelConfig(
            workers=ctx.world_size,
            bucket_cap_mb=job.get("bucket_cap_mb", 0.002),
            gradient_as_bucket_view=job.get("bucket_view", True),
        ),
    )
    hook = ConsistencyHook(ctx.world_size, gram_every=job.get("gram_every", 0))
    hook.attach(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for step in range(job["steps"]):
        brute = _brute_force(ddp, task, ctx, cfg)
        hook.begin_step(step)
        out.append(monitored_step(ddp, hook, task, ctx, cfg, brute, lambda: [p.grad for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def monitored_step(wrapped, hook, task, ctx, cfg, brute: dict, reduced_grads) -> dict:
    """One step of a consistency probe (DDP or FSDP): the forward/backward under the hook, the hook's
    statistics from the gathered per-rank values, and the brute force ``brute`` of the same step beside them.
    ``reduced_grads()``: the reduced gradient after the backward, one tensor per parameter (whole, unsharded)."""
    from ars_opd.training.consistency import consistency_metrics
    from ars_opd.training.distributed import gather_floats

    local_sum, local_tokens, *_ = Trainer(model=wrapped, task=task, ctx=ctx, cfg=cfg).accumulate(task.micro)
    g = gather_floats(
        torch.cat([torch.tensor([local_sum / local_tokens], dtype=torch.float64), hook.local_stats(ctx.device)]),
        ctx.device,
    )
    gram = hook.gram()
    reduced = torch.cat([grad.reshape(-1) for grad in reduced_grads()]).double()
    inputs = {
        "worker_loss": g[:, 0].tolist(),
        "sq": g[:, 1].tolist(),
        "dot": g[:, 2].tolist(),
        "mean_sq": float(reduced.pow(2).sum()),
        "gram": None if gram is None else gram.tolist(),
    }
    stats = consistency_metrics(*(inputs[k] for k in ("worker_loss", "sq", "dot", "mean_sq")), gram)
    # the reduced gradient's error relative to Σ_k |g_k| / K, entry by entry (0 where every g_k is 0)
    rel = ((reduced - brute["mean"]).abs() / brute["abs_mean"]).nan_to_num(0.0)
    return {
        "hook": stats,
        "brute": {k: v for k, v in brute.items() if k not in ("mean", "abs_mean")},
        "inputs": inputs,
        "params": reduced.numel(),
        "reduced_rel": float(rel.max()),
        "buckets": hook.reductions,
    }


def bitwise_probe(job: dict) -> bool:
    """Reduced gradients with the consistency hook equal DDP's own all-reduce bit for bit."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        from ars_opd.data import synthetic
        from ars_opd.models.tokenizer import build_char_word_tokenizer
        from ars_opd.training.consistency import ConsistencyHook

        tok = build_char_word_tokenizer(synthetic.instruction_words())
        cfg = SFTConfig(steps=1, warmup_steps=0, global_batch_size=8, micro_batch_size=1)
        grads = []
        for with_hook in (True, False):
            model = tiny_model(tok)
            task = FixedTask(job["batches"], ctx, tok.pad_token_id, False)
            ddp = wrap_ddp(
                model,
                ctx,
                ParallelConfig(workers=ctx.world_size, bucket_cap_mb=0.002, gradient_as_bucket_view=job["bucket_view"]),
            )
            if with_hook:
                hook = ConsistencyHook(ctx.world_size)
                hook.attach(ddp)
                hook.begin_step(0)
            Trainer(model=ddp, task=task, ctx=ctx, cfg=cfg).accumulate(task.micro)
            grads.append([p.grad.clone() for p in model.parameters()])
            del ddp
        return all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        shutdown_worker()


def gkd_probe(job: dict) -> list:
    """Every worker's GKD draws for steps 0..n-1, gathered (they must be identical)."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        from ars_opd.training.opd.task import uses_student_rollouts

        mine = torch.tensor([float(uses_student_rollouts(job["seed"], s, job["lam"])) for s in range(job["steps"])])
        parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(parts, mine)
        return [p.tolist() for p in parts]
    finally:
        shutdown_worker()


def _local_grads_per_micro(ddp, task, ctx, scale):
    """Each micro-batch's local gradient (flattened, fp64, in the engine's K/N scale), nothing reduced."""
    out = []
    for b in task.micro:
        with ddp.no_sync():
            ls, _ = task.loss_sum(ddp, b)
            (ls * scale).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]).double())
        ddp.module.zero_grad(set_to_none=True)
    return out


def fault_probe(job: dict) -> dict:
    """One step with and without an engine-level fault on rank job['rank']: the hook's per-rank squared norms,
    the per-rank losses and tokens, the reduced gradient, and each rank's per-micro-batch local gradients."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        from ars_opd.config import InjectConfig
        from ars_opd.data import synthetic
        from ars_opd.models.tokenizer import build_char_word_tokenizer
        from ars_opd.training.consistency import ConsistencyHook
        from ars_opd.training.distributed import gather_floats
        from ars_opd.training.faults import Fault

        tok = build_char_word_tokenizer(synthetic.instruction_words())
        cfg = SFTConfig(steps=1, warmup_steps=0, global_batch_size=8, micro_batch_size=1)
        out = {}
        for mode in ("healthy", "fault"):
            model = tiny_model(tok)
            task = FixedTask(job["batches"], ctx, tok.pad_token_id, False)
            ddp = wrap_ddp(model, ctx, ParallelConfig(workers=ctx.world_size, bucket_cap_mb=0.002))
            if mode == "healthy":
                n = torch.tensor([float(sum(b.n_tokens for b in task.micro))], dtype=torch.float64)
                dist.all_reduce(n)
                local = _local_grads_per_micro(ddp, task, ctx, ctx.world_size / n.item())
                parts = [torch.empty_like(torch.stack(local)) for _ in range(ctx.world_size)]
                dist.all_gather(parts, torch.stack(local))
                out["micro_grads"] = [p.tolist() for p in parts]  # (K, micro, P)
            hook = ConsistencyHook(ctx.world_size)
            hook.attach(ddp)
            hook.begin_step(0)
            inject = InjectConfig(kind=job["kind"], rank=job["rank"], start_step=0, magnitude=job["magnitude"])
            fault = Fault(inject, "sft", ctx.rank, 0) if mode == "fault" else None
            local_sum, local_tokens, *_ = Trainer(model=ddp, task=task, ctx=ctx, cfg=cfg, fault=fault).accumulate(
                task.micro
            )
            g = gather_floats(
                torch.cat(
                    [torch.tensor([local_sum, float(local_tokens)], dtype=torch.float64), hook.local_stats(ctx.device)]
                ),
                ctx.device,
            )
            reduced = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
            out[mode] = {
                "loss_sum": g[:, 0].tolist(),
                "tokens": g[:, 1].tolist(),
                "sq": g[:, 2].tolist(),
                "reduced": reduced.tolist(),
            }
            del ddp
        return out
    finally:
        shutdown_worker()


def drift_probe(job: dict) -> list:
    """check_drift before and after rank job['rank'] moves one parameter element by one ulp."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        from ars_opd.data import synthetic
        from ars_opd.models.tokenizer import build_char_word_tokenizer
        from ars_opd.training.drift import check_drift

        tok = build_char_word_tokenizer(synthetic.instruction_words())
        model = tiny_model(tok)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
        opt.step()  # the optimizer state exists and is identical everywhere
        found = [check_drift(model, opt, ctx)]
        if ctx.rank == job["rank"]:
            with torch.no_grad():
                p = dict(model.named_parameters())[job["param"]]
                flat = p.view(-1)
                flat[job["index"]] = torch.nextafter(flat[job["index"]], torch.tensor(float("inf")))
        found.append(check_drift(model, opt, ctx))
        return found
    finally:
        shutdown_worker()


def noise_scale_probe(job: dict) -> dict:
    """The hook's per-worker scalars for one step, and every sequence's own gradient (fp64), gathered."""
    ctx = init_worker("cpu", "gloo", threads=1, timeout_s=120)
    try:
        from ars_opd.data import synthetic
        from ars_opd.lm.cross_entropy import causal_lm_token_loss_sum
        from ars_opd.models.tokenizer import build_char_word_tokenizer
        from ars_opd.training.consistency import ConsistencyHook
        from ars_opd.training.distributed import gather_floats

        tok = build_char_word_tokenizer(synthetic.instruction_words())
        model = tiny_model(tok)
        cfg = SFTConfig(steps=1, warmup_steps=0, global_batch_size=8, micro_batch_size=1)
        task = FixedTask(job["batches"], ctx, tok.pad_token_id, False)
        per_seq, counts = [], []
        for b in task.micro:  # one sequence at a time: its summed token-loss gradient
            t = b.tensors
            for i in range(t["input_ids"].shape[0]):
                logits = model(
                    input_ids=t["input_ids"][i : i + 1], attention_mask=t["attention_mask"][i : i + 1]
                ).logits
                ls, n = causal_lm_token_loss_sum(logits, t["labels"][i : i + 1])
                ls.backward()
                per_seq.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
                counts.append(int(n))
                model.zero_grad(set_to_none=True)
        ddp = wrap_ddp(model, ctx, ParallelConfig(workers=ctx.world_size, bucket_cap_mb=0.002))
        hook = ConsistencyHook(ctx.world_size)
        hook.attach(ddp)
        hook.begin_step(0)
        _, local_tokens, *_ = Trainer(model=ddp, task=task, ctx=ctx, cfg=cfg).accumulate(task.micro)
        g = gather_floats(
            torch.cat([torch.tensor([float(local_tokens)], dtype=torch.float64), hook.local_stats(ctx.device)]),
            ctx.device,
        )
        reduced = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        del ddp, hook  # the DDP wrapper must be gone before the process group is destroyed (as in grad_probe)
        mine = torch.stack(per_seq)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(ctx.world_size)]
        dist.all_gather(sizes, torch.tensor([mine.shape[0]]))
        width = max(int(s) for s in sizes)
        padded = torch.zeros(width, mine.shape[1], dtype=torch.float64)
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(ctx.world_size)]
        dist.all_gather(parts, padded)
        cnt = torch.zeros(width, dtype=torch.long)
        cnt[: len(counts)] = torch.tensor(counts)
        cparts = [torch.empty_like(cnt) for _ in range(ctx.world_size)]
        dist.all_gather(cparts, cnt)
        if ctx.rank != 0:  # the launcher returns rank 0's result: the others need not send megabytes back
            return {}
        return {
            "tokens": g[:, 0].tolist(),
            "sq": g[:, 1].tolist(),
            "mean_sq": float(reduced.pow(2).sum()),
            "per_seq": [p[: int(s)].tolist() for p, s in zip(parts, sizes)],
            "counts": [c[: int(s)].tolist() for c, s in zip(cparts, sizes)],
        }
    finally:
        shutdown_worker()


def start_probe(job: dict) -> dict:
    """``grad_probe``, and what the worker's process saw: an environment variable now and one a library read
    once at import (huggingface_hub's offline flag), its thread count and working directory."""
    import os

    import huggingface_hub.constants

    out = grad_probe(job)
    out.update(
        mark=os.environ.get("ARS_OPD_TEST_MARK"),
        hub_offline=huggingface_hub.constants.HF_HUB_OFFLINE,
        threads=torch.get_num_threads(),
        cwd=os.getcwd(),
    )
    return out
