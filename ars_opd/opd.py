"""On-policy distillation: the student samples, the frozen teacher scores, a token-level divergence trains.

Each step, on each worker: take this worker's share of the training prompts; with probability λ
(``opd.on_policy_fraction``, GKD mixing) sample completions from the current student (no grad, KV cache,
left-padded prompts), else take the teacher's cached completions; rebuild right-padded sequences that keep
each completion up to and including its first EOS; run the frozen teacher (eval mode, no grad) and the
student over them; train on ``token_divergence`` (β, τ) over the full vocabulary, or on the sampled-token
estimator. The λ draw depends only on (seed, step), so every worker makes the same choice, and the log
records it (``gkd_source``). It runs on the shared engine (exact token normalisation, clipping, resume)
with the consistency hook.

White-box rule: teacher and student must share the tokenizer (checked at start, clear error otherwise).
Vocabulary rule: logits are compared over the tokenizer's ids 0..len(tokenizer)-1 only; embedding rows
beyond it (e.g. 151,936 vs 152,064) are padding and are sliced off both sides.

Per-step task columns: divergence (the loss), teacher_logprob (mean log p_T of the trained tokens at τ = 1),
response_length, eos_rate, gen_s, teacher_s (seconds spent sampling and in the teacher forward; the rest of
``step_s`` is student training).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ars_opd.artifacts import file_sha256, provenance, read_jsonl, write_json
from ars_opd.config import DDPConfig, OPDConfig, PathsConfig, to_dict
from ars_opd.distributed import WorkerContext, init_worker, launch, shutdown_worker
from ars_opd.divergences import sampled_token_loss, token_divergence
from ars_opd.engine import BatchGeometry, MicroBatch, config_fingerprint, fit, scenario_seeds, set_seeds, step_indices
from ars_opd.generation import generate_token_ids
from ars_opd.losses import IGNORE_INDEX
from ars_opd.models import load_model, load_tokenizer, model_path, read_manifest, sha256_of_files
from ars_opd.prompts import encode_completions, encode_prompts
from ars_opd.seeding import derive_seed
from ars_opd.tokenizer import check_shared_tokenizer


def uses_student_rollouts(seed: int, step: int, on_policy_fraction: float) -> bool:
    """GKD draw for a step: a pure function of (seed, step), identical on every worker."""
    return random.Random(derive_seed(seed, f"gkd-step-{step}")).random() < on_policy_fraction


def cut_at_first_eos(ids: list[int], eos_id: int | None) -> tuple[list[int], bool]:
    """Tokens up to and including the first EOS, and whether there was one."""
    if eos_id is not None and eos_id in ids:
        return ids[: ids.index(eos_id) + 1], True
    return list(ids), False


def build_rollout_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int,
                        eos_id: int | None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows for scoring, the completion cut after its first EOS.

    Returns input_ids, attention_mask (B, T); loss_mask (B, T) True at the positions whose next token is a
    completion token (EOS included); targets (B, T) those next tokens (-100 elsewhere); lengths and has_eos
    (B,). Masks come from lengths, never from comparing ids with ``pad_id``: correct when pad == eos.
    """
    if not prompts or len(prompts) != len(completions):
        raise ValueError("need equal, non-zero numbers of prompts and completions")
    cut = [cut_at_first_eos(c, eos_id) for c in completions]
    width = max(len(p) + len(c) for p, (c, _) in zip(prompts, cut))
    B = len(prompts)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    loss_mask = torch.zeros((B, width), dtype=torch.bool)
    targets = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
    for i, (p, (c, _)) in enumerate(zip(prompts, cut)):
        if not p:
            raise ValueError("empty prompt")
        n = len(p) + len(c)
        ids[i, :n] = torch.as_tensor(p + c, dtype=torch.long)
        attn[i, :n] = 1
        if c:
            loss_mask[i, len(p) - 1:n - 1] = True
            targets[i, len(p) - 1:n - 1] = torch.as_tensor(c, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "targets": targets,
            "lengths": torch.tensor([len(c) for c, _ in cut]), "has_eos": torch.tensor([e for _, e in cut])}


class OPDTask:
    """Rollouts (or cached teacher completions) for this worker, scored by the teacher."""

    def __init__(self, prompts: list[list[int]], teacher_completions: list[list[int]], teacher: torch.nn.Module,
                 tokenizer, cfg: OPDConfig, geometry: BatchGeometry, sampler_seed: int, seed: int,
                 ctx: WorkerContext, vocab: int):
        self.prompts, self.teacher_completions, self.teacher = prompts, teacher_completions, teacher
        self.tokenizer, self.cfg, self.geometry = tokenizer, cfg, geometry
        self.sampler_seed, self.seed, self.ctx, self.vocab = sampler_seed, seed, ctx, vocab
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def metric_names(self) -> list[str]:
        return ["teacher_logprob", "response_length", "eos_rate", "gen_s", "teacher_s", "on_policy"]

    def source(self, step: int) -> str:
        return "student" if uses_student_rollouts(self.seed, step, self.cfg.on_policy_fraction) else "teacher"

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        idx = step_indices(step, len(self.prompts), self.geometry, self.sampler_seed, self.ctx.rank)
        prompts = [self.prompts[i] for i in idx]
        on_policy = self.source(step) == "student"
        t0 = time.perf_counter()
        if on_policy:
            sample = self.cfg.sample_temperature > 0
            completions = generate_token_ids(
                model, self.tokenizer, prompts, self.cfg.max_new_tokens, batch_size=len(prompts),
                do_sample=sample, temperature=self.cfg.sample_temperature if sample else 1.0, top_p=self.cfg.top_p)
        else:
            completions = [self.teacher_completions[i][: self.cfg.max_new_tokens] for i in idx]
        gen_s = time.perf_counter() - t0
        out = []
        for j in range(0, len(prompts), self.geometry.micro_batch):
            b = build_rollout_batch(prompts[j:j + self.geometry.micro_batch],
                                    completions[j:j + self.geometry.micro_batch], self.pad_id,
                                    self.tokenizer.eos_token_id)
            n_seq = b["lengths"].numel()
            meta = {"response_length": (float(b["lengths"].sum()), float(n_seq)),
                    "eos_rate": (float(b["has_eos"].sum()), float(n_seq)),
                    "on_policy": (float(on_policy), 1.0)}
            if j == 0:
                meta["gen_s"] = (gen_s, 1.0)
            t = {k: v.to(self.ctx.device) for k, v in b.items() if k not in ("lengths", "has_eos")}
            out.append(MicroBatch(t, int(b["loss_mask"].sum()), n_seq, int(b["attention_mask"].sum()), meta))
        return out

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict]:
        t = batch.tensors
        logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits[..., :self.vocab]
        t0 = time.perf_counter()
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits
            teacher_logits = teacher_logits[..., :self.vocab]
            mask, targets = t["loss_mask"], t["targets"].clamp(min=0)
            token_logit = teacher_logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
            teacher_lp = token_logit - torch.logsumexp(teacher_logits.float(), -1)  # (B, T) log p_T(y), τ = 1
        teacher_s = time.perf_counter() - t0
        if self.cfg.loss == "full_vocab":
            loss_sum, n = token_divergence(logits, teacher_logits, mask, self.cfg.beta, self.cfg.temperature,
                                           self.cfg.chunk_size)
        else:
            tlp = teacher_lp if self.cfg.temperature == 1.0 else (
                torch.log_softmax(teacher_logits.float() / self.cfg.temperature, -1)
                .gather(-1, targets.unsqueeze(-1)).squeeze(-1))
            loss_sum, n = sampled_token_objective(logits, tlp, targets, mask, self.cfg.temperature)
        return loss_sum, {"teacher_logprob": (float(teacher_lp[mask].sum()), float(n)),
                          "teacher_s": (teacher_s, 1.0 if batch.meta.get("gen_s") else 0.0)}


def sampled_token_objective(logits, teacher_logprobs, targets, mask, temperature) -> tuple[torch.Tensor, int]:
    """The sampled-token loss for the engine: its value is the reverse-KL estimate Σ(log q − log p) of the
    sampled tokens, its gradient the policy-gradient surrogate's. The surrogate's own value (−Σ A·log q,
    often negative) is no divergence; logging it made ``loss`` and the per-worker losses of a
    sampled_token run incomparable with a full_vocab run's."""
    surrogate, estimate, n = sampled_token_loss(logits, teacher_logprobs, targets, mask, temperature)
    return surrogate + (estimate - surrogate).detach(), n


@dataclass(frozen=True)
class OPDJob:
    cfg: OPDConfig
    ddp: DDPConfig
    paths: PathsConfig
    seed: int
    trust_remote_code: bool = False
    progress: bool = True


def _encode(tokenizer, rows: list[dict], cfg: OPDConfig) -> tuple[list[list[int]], list[list[int]], dict]:
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    completions = encode_completions(tokenizer, [r["completion"] for r in rows])
    keep = [i for i, p in enumerate(prompts) if len(p) <= cfg.max_prompt_tokens]
    counts = {"rows": len(rows), "kept": len(keep), "dropped_prompt_over_budget": len(rows) - len(keep)}
    return [prompts[i] for i in keep], [completions[i] for i in keep], counts


def opd_worker(job: OPDJob) -> dict:
    ctx = init_worker(job.ddp.device, job.ddp.backend, job.ddp.threads_per_worker, job.ddp.timeout_s)
    try:
        base_seed = derive_seed(job.seed, "opd")
        sampler_seed, rng_seed = scenario_seeds(job.ddp.scenario, base_seed, ctx.rank)
        set_seeds(rng_seed)
        tokenizer = load_tokenizer(job.paths.models_dir)
        from transformers import AutoTokenizer

        teacher_path = model_path(job.paths.models_dir, "teacher")
        check_shared_tokenizer(AutoTokenizer.from_pretrained(teacher_path, trust_remote_code=job.trust_remote_code),
                               tokenizer)
        vocab = len(tokenizer)
        student_dir = Path(job.paths.sft_dir) / "model"
        model = load_model_dir(student_dir, ctx.device)
        teacher = load_model(job.paths.models_dir, "teacher", trust_remote_code=job.trust_remote_code).to(ctx.device)
        teacher.eval().requires_grad_(False)
        for name, m in (("student", model), ("teacher", teacher)):
            rows_out = m.get_output_embeddings().weight.shape[0]
            if rows_out < vocab:
                raise ValueError(f"the {name} has {rows_out} output rows but the tokenizer {vocab} ids")
        rows = read_jsonl(Path(job.paths.teacher_dir) / "train.jsonl")
        prompts, completions, counts = _encode(tokenizer, rows, job.cfg)
        if not prompts:
            raise ValueError(f"no OPD prompts left after the budget: {counts}")
        geometry = BatchGeometry.check(job.cfg.global_batch_size, ctx.world_size, job.cfg.micro_batch_size, "opd")
        model.train()
        task = OPDTask(prompts, completions, teacher, tokenizer, job.cfg, geometry, sampler_seed, base_seed, ctx, vocab)
        fingerprint = config_fingerprint({
            "opd": to_dict(job.cfg), "workers": job.ddp.workers, "scenario": job.ddp.scenario, "seed": job.seed,
            "student": sha256_of_files(student_dir), "teacher": read_manifest(job.paths.models_dir)["teacher"]["revision"],
            "rows": len(rows), "data": file_sha256(Path(job.paths.teacher_dir) / "train.jsonl")})
        out_dir = Path(job.paths.opd_dir)
        state, log = fit(ctx, model, task, job.cfg, job.ddp, fingerprint, Path(job.paths.opd_checkpoints), out_dir,
                         Path(job.paths.opd_live), job.progress, on_step=lambda s: {"gkd_source": task.source(s)})
        if ctx.is_main:
            model.save_pretrained(out_dir / "model", safe_serialization=True)
            tokenizer.save_pretrained(out_dir / "model")
            write_json(out_dir / "manifest.json", {
                "data": counts, "workers": ctx.world_size, "geometry": dataclasses.asdict(geometry),
                "resumed_from": state.resumed_from, "steps": state.step, "vocab": vocab,
                **provenance({"opd": to_dict(job.cfg), "ddp": to_dict(job.ddp), "seed": job.seed}),
            })
        return {"steps": state.step, "data": counts, "final_loss": log[-1]["loss"] if log else None}
    finally:
        shutdown_worker()


def load_model_dir(path: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} holds no model: run the sft stage first (dvc repro sft)")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)


def run_opd(cfg: OPDConfig, ddp: DDPConfig, paths: PathsConfig, seed: int, trust_remote_code: bool = False,
            progress: bool = True) -> dict:
    """The opd stage: start the workers, distil, write outputs. Returns rank 0's summary."""
    return launch(opd_worker, OPDJob(cfg, ddp, paths, seed, trust_remote_code, progress), ddp.workers,
                  ddp.threads_per_worker)
