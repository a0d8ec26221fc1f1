"""Supervised fine-tuning of the student on the teacher's completions, on the shared engine.

Each row becomes prompt ids (chat template with the generation prompt) + completion ids + EOS; labels are
the completion tokens and -100 on the prompt and padding, so the loss is on response tokens only.
A completion the teacher was cut off in at its length limit (``finish_reason: length``) gets no EOS
(``ars_opd.data.prompts.encode_teacher_completions``): the student must not learn to stop where the teacher
ran out of tokens. ``sft.truncated_completions`` keeps such a row without an end (default) or drops it.
Budgets (``sft.max_prompt_tokens``, ``max_completion_tokens``, ``max_seq_len``): a prompt over budget
drops the row (a cut prompt is a different task), a long completion is truncated (and so loses its EOS too),
and a row left with no room for any completion token is dropped; all are counted in the stage manifest
(``teacher_truncated``: rows the teacher cut, ``dropped_*``: each reason a row was left out), never silent.
The pad id is the one rule of ``ars_opd.lm.batching.pad_token_id`` (a tokenizer without a pad token pads
with EOS).

Batches are right-padded, or with ``packing: true`` padding-free (``ars_opd.lm.batching.pack_sequences``,
attended by ``ars_opd.lm.attention``'s varlen implementations without an (L × L) mask: tested to give the
same logits as unpacked rows). The loss is taken from the student's last hidden states through its output
head one chunk of positions at a time (``ars_opd.lm.cross_entropy.causal_lm_loss_from_hidden``), over the
tokenizer's ids only (embedding rows beyond it are padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ars_opd.config import SFTConfig
from ars_opd.data.prompts import encode_prompts, encode_teacher_completions, teacher_ended
from ars_opd.lm.attention import packed_model_inputs, use_packed_attention
from ars_opd.lm.batching import count_loss_tokens, pack_sequences, pad_right_with_labels, pad_token_id
from ars_opd.lm.cross_entropy import causal_lm_loss_from_hidden
from ars_opd.lm.head import OutputHead, last_hidden_states
from ars_opd.models.loading import PinnedModels
from ars_opd.training.batch_plan import step_indices
from ars_opd.training.budget import matmul_parameters
from ars_opd.training.data_cost import TeacherText, charges_teacher_text, generated_tokens
from ars_opd.training.task import MicroBatch
from ars_opd.training.train_rows import train_rows
from ars_opd.training.worker import (  # noqa: F401  (continued_sft_config: where the arms ask it)
    PreparedRun,
    TrainingJob,
    WorkerSetup,
    continued_sft_config,
    launch_stage,
    run_worker,
    starting_student,
)


@dataclass
class EncodedData:
    prompts: list[list[int]]
    completions: list[list[int]]
    counts: dict[str, int]
    tasks: list[str | None] = field(default_factory=list)  # each kept row's task label (synthetic data)
    generated: list[int] = field(default_factory=list)  # tokens the teacher generated for each kept row


def encode_sft_rows(tokenizer, rows: list[dict], cfg: SFTConfig) -> EncodedData:
    """Encode prompt+completion rows under the budgets; count what was dropped or truncated and why."""
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows]) if rows else []
    completions = encode_teacher_completions(tokenizer, rows) if rows else []
    counts = {
        "rows": len(rows),
        "kept": 0,
        "dropped_prompt_over_budget": 0,
        "dropped_teacher_truncated": 0,
        "dropped_no_room_for_completion": 0,
        "completion_truncated": 0,
        "teacher_truncated": sum(not teacher_ended(r) for r in rows),
    }
    keep_p, keep_c, tasks, generated = [], [], [], []
    for row, p, c, g in zip(rows, prompts, completions, generated_tokens(tokenizer, rows)):
        if len(p) > cfg.max_prompt_tokens:
            counts["dropped_prompt_over_budget"] += 1
            continue
        if cfg.truncated_completions == "drop" and not teacher_ended(row):
            counts["dropped_teacher_truncated"] += 1
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
        tasks.append(row.get("task"))
        generated.append(g)
    counts["kept"] = len(keep_p)
    return EncodedData(keep_p, keep_c, counts, tasks, generated)


class SFTTask:
    """Micro-batches of teacher completions for one worker; loss = summed token cross-entropy.

    It takes the data, the config and the worker's place in the run (``WorkerSetup``: batch geometry,
    data-order seed, rank, device, fault, and the tokenizer, whose pad id pads); the vocabulary and the
    budget's terms are keyword-only, so that no call passes a row of bare numbers whose order it could get
    wrong.
    """

    def __init__(
        self,
        data: EncodedData,
        cfg: SFTConfig,
        setup: WorkerSetup,
        *,
        vocab: int | None = None,
        flops_per_token: float = 0.0,
        teacher_text: TeacherText | None = None,
    ):
        self.data, self.cfg, self.geometry = data, cfg, setup.geometry
        self.sampler_seed, self.rank, self.device = setup.sampler_seed, setup.ctx.rank, setup.ctx.device
        self.pad_id = pad_token_id(setup.tokenizer)
        self.fault = setup.fault
        self.vocab = vocab  # scored ids 0..vocab-1 (None: every output row)
        self.flops_per_token = flops_per_token  # 6 · P_s: forward and backward (ars_opd.training.budget)
        self.teacher_text = teacher_text  # the rows' teacher tokens this run charges (None: none)

    def teacher_tokens(self, step: int) -> int:
        return self.teacher_text.new_tokens(step) if self.teacher_text is not None else 0

    def metric_names(self) -> list[str]:
        return ["padding_fraction"]

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        idx = step_indices(step, len(self.data.prompts), self.geometry, self.sampler_seed, self.rank)
        if self.fault is not None:
            idx = self.fault.select(step, idx, self.data.tasks)
        out = []
        for i in range(0, len(idx), self.geometry.micro_batch):
            chunk = idx[i : i + self.geometry.micro_batch]
            p = [self.data.prompts[j] for j in chunk]
            c = [self.data.completions[j] for j in chunk]
            if self.cfg.packing:
                t = pack_sequences(p, c, self.cfg.pack_length, self.pad_id)
            else:
                t = pad_right_with_labels(p, c, self.pad_id)
            if self.fault is not None:
                t["labels"] = self.fault.corrupt_labels(t["labels"], step, self.vocab)
            t = {k: v.to(self.device) for k, v in t.items()}
            real = sum(len(x) + len(y) for x, y in zip(p, c))
            out.append(
                MicroBatch(t, count_loss_tokens(t["labels"]), len(chunk), real, flops=self.flops_per_token * real)
            )
        return out

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict]:
        t = batch.tensors
        if "cu_seq_lens" in t:  # packed: the model's attention is one of ars_opd.lm.attention's (prepare_sft)
            kwargs = packed_model_inputs(t)
        else:
            kwargs = {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"]}
        hidden = last_hidden_states(model, **kwargs)  # (B, T, H)
        loss_sum, _ = causal_lm_loss_from_hidden(
            hidden, OutputHead.of(model, self.vocab), t["labels"], self.cfg.chunk_size
        )
        total = t["input_ids"].numel()
        return loss_sum, {"padding_fraction": (float(total - batch.n_real_tokens), float(total))}


def prepare_sft(job: TrainingJob, setup: WorkerSetup) -> PreparedRun:
    """The sft stage starts from the base student; sft_continued from ``paths.distill_init`` (the student the
    distillation arms start from), so that it is OPD's control at equal steps."""
    rows, identity = train_rows(job.paths, job.stage, job.control)
    data = encode_sft_rows(setup.tokenizer, rows, job.cfg)
    if not data.prompts:
        raise ValueError(f"no SFT rows left after the budgets: {data.counts}")
    student = starting_student(
        job, setup.ctx.device, setup.models or PinnedModels(job.paths.models_dir, job.trust_remote_code)
    )
    model, init, start = student.model, student.init, student.budget
    manifest = {"adapter_start": student.adapter}
    if job.cfg.packing:
        manifest["packed_attention"] = use_packed_attention(model, job.cfg.packed_attention)
    task = SFTTask(
        data,
        job.cfg,
        setup,
        vocab=len(setup.tokenizer),
        flops_per_token=6.0 * matmul_parameters(model),
        teacher_text=TeacherText(
            data.generated,
            setup.geometry,
            list(setup.sampler_seeds),
            charged=charges_teacher_text(job.stage, job.control),
        ),
    )
    fingerprint = {"init": init, **identity}
    return PreparedRun(model, task, fingerprint, data.counts, manifest=manifest, budget_start=start)


def sft_worker(job: TrainingJob) -> dict:
    return run_worker(job, prepare_sft)


def run_sft(job: TrainingJob) -> dict:
    """The sft stage, or sft_continued (OPD's control arm: more SFT from the same start, with OPD's loop, on
    the SFT stage's rows again or on fresh ones, ``control``, under the SFT stage's data rules): check the
    job, start the workers, train, write outputs. Returns rank 0's summary. ``trust_remote_code``
    (``models.trust_remote_code``) reaches every load of the student."""
    job.check()  # before any worker starts: e.g. a packed attention this machine cannot train with
    return launch_stage(sft_worker, job)


def run_sft_continued(job: TrainingJob) -> dict:
    """The sft_continued stage (``TrainingJob.from_params("sft_continued", ...)`` gives its job): ``run_sft``."""
    return run_sft(job)
