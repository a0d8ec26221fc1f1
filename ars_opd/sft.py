"""Supervised fine-tuning of the student on the teacher's completions, on the shared engine.

Each row becomes prompt ids (chat template with the generation prompt) + completion ids + EOS; labels are
the completion tokens and -100 on the prompt and padding, so the loss is on response tokens only.
Budgets (``sft.max_prompt_tokens``, ``max_completion_tokens``, ``max_seq_len``): a prompt over budget
drops the row (a cut prompt is a different task), a long completion is truncated, and a row left with no
room for any completion token is dropped; all are counted in the stage manifest, never silent.

Batches are right-padded, or with ``packing: true`` padding-free: a worker's micro-batch is packed into
rows of ``pack_length`` tokens, position ids restart at each sequence and a block-diagonal causal mask
stops attention at sequence boundaries (tested: packed logits equal unpacked ones).

The stage starts ``ddp.workers`` processes itself (``ars_opd.distributed.launch``) and writes an
HF-loadable model directory, the per-step log, DVCLive metrics and a manifest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ars_opd.artifacts import file_sha256, provenance, read_jsonl, write_json
from ars_opd.config import DDPConfig, PathsConfig, SFTConfig, to_dict
from ars_opd.distributed import WorkerContext, init_worker, launch, shutdown_worker
from ars_opd.engine import BatchGeometry, MicroBatch, config_fingerprint, fit, scenario_seeds, set_seeds, step_indices
from ars_opd.generation import pad_right_with_labels
from ars_opd.losses import IGNORE_INDEX, causal_lm_token_loss_sum
from ars_opd.models import load_model, load_tokenizer, read_manifest
from ars_opd.prompts import encode_completions, encode_prompts
from ars_opd.seeding import derive_seed


@dataclass
class EncodedData:
    prompts: list[list[int]]
    completions: list[list[int]]
    counts: dict[str, int]


def encode_sft_rows(tokenizer, rows: list[dict], cfg: SFTConfig) -> EncodedData:
    """Encode prompt+completion rows under the budgets; count what was dropped or truncated and why."""
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows]) if rows else []
    completions = encode_completions(tokenizer, [r["completion"] for r in rows]) if rows else []
    counts = {"rows": len(rows), "kept": 0, "dropped_prompt_over_budget": 0, "dropped_no_room_for_completion": 0,
              "completion_truncated": 0}
    keep_p, keep_c = [], []
    for p, c in zip(prompts, completions):
        if len(p) > cfg.max_prompt_tokens:
            counts["dropped_prompt_over_budget"] += 1
            continue
        room = min(cfg.max_completion_tokens, cfg.max_seq_len - len(p))
        if room <= 0:
            counts["dropped_no_room_for_completion"] += 1
            continue
        if len(c) > room:
            counts["completion_truncated"] += 1
            c = c[:room]
        keep_p.append(p)
        keep_c.append(c)
    counts["kept"] = len(keep_p)
    return EncodedData(keep_p, keep_c, counts)


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to the shifted next-token loss (labels aligned with inputs)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def pack_sequences(prompts: list[list[int]], completions: list[list[int]], pack_length: int,
                   pad_id: int) -> dict[str, torch.Tensor]:
    """Pack sequences in order into rows of ``pack_length``; each sequence stays whole within one row.

    Returns input_ids, labels, position_ids (restart at 0 per sequence) of shape (R, L) and a float
    attention mask (R, 1, L, L): 0 where a token may attend (same sequence, not later), -inf elsewhere.
    """
    rows: list[list[tuple[list[int], list[int]]]] = [[]]
    used = 0
    for p, c in zip(prompts, completions):
        n = len(p) + len(c)
        if n > pack_length:
            raise ValueError(f"a sequence of {n} tokens does not fit pack_length {pack_length}")
        if used + n > pack_length:
            rows.append([])
            used = 0
        rows[-1].append((p, c))
        used += n
    R, L = len(rows), max(sum(len(p) + len(c) for p, c in row) for row in rows)
    ids = torch.full((R, L), pad_id, dtype=torch.long)
    labels = torch.full((R, L), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((R, L), dtype=torch.long)
    seq_id = torch.full((R, L), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        t = 0
        for s, (p, c) in enumerate(row):
            n = len(p) + len(c)
            ids[r, t:t + n] = torch.as_tensor(p + c)
            labels[r, t + len(p):t + n] = torch.as_tensor(c)
            pos[r, t:t + n] = torch.arange(n)
            seq_id[r, t:t + n] = s
            t += n
        seq_id[r, t:] = torch.arange(L - t) + 10**6  # each padding token alone: no NaN rows, no leakage
    same = seq_id[:, :, None] == seq_id[:, None, :]  # (R, L, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    allowed = same & causal
    mask = torch.zeros((R, 1, L, L), dtype=torch.float32)
    mask.masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask}


class SFTTask:
    """Micro-batches of teacher completions for one worker; loss = summed token cross-entropy."""

    def __init__(self, data: EncodedData, cfg: SFTConfig, geometry: BatchGeometry, sampler_seed: int,
                 ctx: WorkerContext, pad_id: int):
        self.data, self.cfg, self.geometry = data, cfg, geometry
        self.sampler_seed, self.ctx, self.pad_id = sampler_seed, ctx, pad_id

    def metric_names(self) -> list[str]:
        return ["padding_fraction"]

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        idx = step_indices(step, len(self.data.prompts), self.geometry, self.sampler_seed, self.ctx.rank)
        out = []
        for i in range(0, len(idx), self.geometry.micro_batch):
            chunk = idx[i:i + self.geometry.micro_batch]
            p = [self.data.prompts[j] for j in chunk]
            c = [self.data.completions[j] for j in chunk]
            if self.cfg.packing:
                t = pack_sequences(p, c, self.cfg.pack_length, self.pad_id)
            else:
                t = pad_right_with_labels(p, c, self.pad_id)
            t = {k: v.to(self.ctx.device) for k, v in t.items()}
            real = sum(len(x) + len(y) for x, y in zip(p, c))
            out.append(MicroBatch(t, count_loss_tokens(t["labels"]), len(chunk), real))
        return out

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict]:
        t = batch.tensors
        kwargs = {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}
        if "position_ids" in t:
            kwargs["position_ids"] = t["position_ids"]
        logits = model(**kwargs).logits  # (B, T, V)
        loss_sum, _ = causal_lm_token_loss_sum(logits, t["labels"])
        total = t["input_ids"].numel()
        return loss_sum, {"padding_fraction": (float(total - batch.n_real_tokens), float(total))}


@dataclass(frozen=True)
class SFTJob:
    """Everything a worker needs (picklable: crosses into spawned processes)."""

    cfg: SFTConfig
    ddp: DDPConfig
    paths: PathsConfig
    seed: int
    progress: bool = True


def _fingerprint(job: SFTJob, init_revision: str, n_rows: int) -> str:
    return config_fingerprint({"sft": to_dict(job.cfg), "workers": job.ddp.workers, "scenario": job.ddp.scenario,
                               "seed": job.seed, "init": init_revision, "rows": n_rows,
                               "data": file_sha256(Path(job.paths.teacher_dir) / "train.jsonl")})


def sft_worker(job: SFTJob) -> dict:
    ctx = init_worker(job.ddp.device, job.ddp.backend, job.ddp.threads_per_worker, job.ddp.timeout_s)
    try:
        base_seed = derive_seed(job.seed, "sft")
        sampler_seed, rng_seed = scenario_seeds(job.ddp.scenario, base_seed, ctx.rank)
        set_seeds(rng_seed)
        tokenizer = load_tokenizer(job.paths.models_dir)
        rows = read_jsonl(Path(job.paths.teacher_dir) / "train.jsonl")
        data = encode_sft_rows(tokenizer, rows, job.cfg)
        if not data.prompts:
            raise ValueError(f"no SFT rows left after the budgets: {data.counts}")
        geometry = BatchGeometry.check(job.cfg.global_batch_size, ctx.world_size, job.cfg.micro_batch_size, "sft")
        model = load_model(job.paths.models_dir, "student").to(ctx.device)
        model.train()
        init_revision = read_manifest(job.paths.models_dir)["student"]["revision"]
        task = SFTTask(data, job.cfg, geometry, sampler_seed, ctx, tokenizer.pad_token_id)
        out_dir = Path(job.paths.sft_dir)
        state, rows_log = fit(ctx, model, task, job.cfg, job.ddp, _fingerprint(job, init_revision, len(rows)),
                              Path(job.paths.sft_checkpoints), out_dir, Path(job.paths.sft_live), job.progress)
        if ctx.is_main:
            model.save_pretrained(out_dir / "model", safe_serialization=True)
            tokenizer.save_pretrained(out_dir / "model")
            write_json(out_dir / "manifest.json", {
                "data": data.counts, "workers": ctx.world_size, "geometry": dataclasses.asdict(geometry),
                "resumed_from": state.resumed_from, "steps": state.step,
                **provenance({"sft": to_dict(job.cfg), "ddp": to_dict(job.ddp), "seed": job.seed}),
            })
        return {"steps": state.step, "data": data.counts, "resumed_from": state.resumed_from,
                "final_loss": rows_log[-1]["loss"] if rows_log else None}
    finally:
        shutdown_worker()


def run_sft(cfg: SFTConfig, ddp: DDPConfig, paths: PathsConfig, seed: int, progress: bool = True) -> dict:
    """The sft stage: start the workers, train, write outputs. Returns rank 0's summary."""
    job = SFTJob(cfg, ddp, paths, seed, progress)
    return launch(sft_worker, job, ddp.workers, ddp.threads_per_worker)
