"""On-policy distillation: the student samples, the frozen teacher scores, a token-level objective trains.

Each step, on each worker: take this worker's share of the training prompts; with probability λ
(``opd.on_policy_fraction``, GKD mixing) sample completions from the current student (no grad, KV cache,
left-padded prompts), else take the teacher's cached completions; rebuild right-padded sequences that keep
each completion up to and including its first EOS, the first of any id the student stops at
(``ars_opd.lm.generation.eos_token_ids``, also in the loss mask: ``ars_opd.lm.batching.build_rollout_batch``); let the
frozen teacher score them and train the student on the objective ``opd.loss`` chosen from
``ars_opd.lm.opd_objectives``, from both models' last hidden states one chunk of positions at a time (no
(tokens × vocabulary) logits on either side). Rollouts use
transformers' generate, or with ``opd.rollout_cache: static`` a preallocated KV cache and a decode loop of
our own (compiled on CUDA); either way the rollouts are samples of softmax(z/τ) within the nucleus and
nothing else (a checkpoint's generation_config, e.g. a repetition penalty, is not applied:
``ars_opd.lm.generation``). The λ draw depends only on (seed, step), so every worker makes the same choice,
and the log records it (``gkd_source``). The teacher's completions end with EOS only where the teacher ended
them; one cut at its length limit is trained on without an end, or dropped with ``opd.truncated_completions:
drop`` (``ars_opd.data.prompts.teacher_ended``; counted in the manifest). It runs on the shared engine (exact
token normalisation, clipping, resume) with the consistency hook. ``opd.loss_normalisation: sequence`` averages
each completion's token losses first and the step over its completions (each token weighs 1 / its completion's
length, ``ars_opd.lm.batching.sequence_weights``; the engine then divides by the global count of completions,
``MicroBatch.units``), so a long rollout weighs what a short one does; the default ``token`` is the global
token mean, where the longest rollouts weigh most.

The teacher (``ars_opd.training.opd.teachers``, chosen, started and checked by
``ars_opd.training.opd.teacher_setup``) is ``opd.teacher: local``, the model in every worker (eval mode,
no grad; bf16 on CUDA by default, ``opd.teacher_dtype``), or ``endpoint``, a served teacher's vLLM-style
``prompt_logprobs`` (``opd.teacher_endpoint``; ``local`` there starts the bundled server for the pinned
teacher): the trainer then never loads teacher weights, each step's sequences are scored at once with bounded
concurrency and retries, and before any worker starts the endpoint must answer, serve the model and
tokenize a probe text as the student's tokenizer does. Endpoint losses: ``sampled_token`` (at τ = 1; an
unbiased single-sample estimator of reverse KL's gradient, not the exact divergence) and ``topk``.

White-box rule: teacher and student must share the tokenizer (checked at start, clear error otherwise).
Vocabulary rule: logits are compared over the tokenizer's ids 0..len(tokenizer)-1 only; embedding rows
beyond it (e.g. 151,936 vs 152,064) are padding and are sliced off both sides.

Per-step task columns, the dashboard a user reads first when OPD goes wrong (steps.jsonl, DVCLive, the
report's rollout section; ``lr`` is the engine's column): teacher_logprob (mean log p_T of the trained tokens at
τ = 1), response_length (tokens, EOS included), eos_rate, truncation_rate (completions that reached
``max_new_tokens`` without an EOS), correct_rate (the share of the step's completions whose answer is correct,
checked as the evaluation checks it: ``ars_opd.data.synthetic.is_correct_for``; only where every row carries a
task and a reference, i.e. the synthetic tasks), divergence_first_half and divergence_second_half (the
objective's per-token value, reverse KL under the default β = 1, averaged over the tokens in the first and the
second half of each completion: ``ars_opd.lm.batching.in_first_half``), on_policy, and the seconds spent
sampling (gen_s) and in the teacher's forward to its hidden states (teacher_s; with ``full_vocab`` its head runs
inside the chunked loss).

Budget (``ars_opd.training.budget``): sampling is charged 2·P_s per token position the student's forward
computed while generating (``ars_opd.lm.generation.GenerationCost``): the left-padded prompt batch, padding
included, and every decode step of every row, also of rows that already ended, until the batch's last row
ends or ``max_new_tokens``; not each row's kept completion. It is counted on the step's first micro-batch
(one generate call serves them all).
"""

from __future__ import annotations

import math
import random
import sys
import time
from typing import NamedTuple

import torch

from ars_opd.config import OPDConfig
from ars_opd.data.answers import is_correct
from ars_opd.lm.batching import (
    build_rollout_batch,
    eos_set,
    in_first_half,
    pad_token_id,
    sequence_weights,
)
from ars_opd.lm.generation import GenerationCost, decode_completion, generate_token_ids
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import objective_for
from ars_opd.lm.optim import autocast_context
from ars_opd.lm.rollout_copy import CastCopy
from ars_opd.rollouts.schedule import (
    ENGINE_METRICS,
    EngineRollouts,
    against_engine,
    engine_step_metrics,
    place_on_mask,
)
from ars_opd.seeding import derive_seed
from ars_opd.training.batch_plan import step_indices
from ars_opd.training.opd.anchor import anchor_loss, anchor_rows, joint_hidden
from ars_opd.training.opd.data import OPDData
from ars_opd.training.opd.rollout_health import HealthMonitor, StepRollouts
from ars_opd.training.opd.teacher_route import ROW_KEY, RoutedTeacher, column, rollout_columns, scored_columns
from ars_opd.training.opd.teacher_route import metric_names as per_teacher_names
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.sharding import is_sharded
from ars_opd.training.task import MicroBatch
from ars_opd.training.worker import WorkerSetup

# the rollout-health columns, kept per worker too (``OPDTask.worker_metric_names``); the detector that judges them
# is ``ars_opd.training.opd.rollout_health``
ROLLOUT_HEALTH = ("eos_rate", "truncation_rate", "response_length", "entropy", "teacher_logprob")


def step_rollouts(step: int, metrics: dict, prefix: str = "") -> StepRollouts:
    """A step's rollouts for the health detector, from its reduced columns (n = 0, not judged, on a step that
    trained on the teacher's text). ``prefix``: one teacher's of several (``<teacher>/``)."""
    n = int(round(metrics.get(f"{prefix}rollouts", 0.0))) if metrics.get("on_policy", 1.0) >= 1.0 else 0

    def value(name: str) -> float:
        v = metrics.get(f"{prefix}{name}", 0.0)
        return v if n and math.isfinite(v) else 0.0  # a teacher without rollouts this step: nothing to judge

    return StepRollouts(
        step,
        n,
        int(round(value("eos_rate") * n)),
        int(round(value("truncation_rate") * n)),
        value("response_length") * n,
        value("response_length_sq") * n,
    )


def uses_student_rollouts(seed: int, step: int, on_policy_fraction: float) -> bool:
    """GKD draw for a step: a pure function of (seed, step), identical on every worker."""
    return random.Random(derive_seed(seed, f"gkd-step-{step}")).random() < on_policy_fraction


class ModelSizes(NamedTuple):
    """Matrix-multiply parameter counts for the budget's FLOPs (``ars_opd.training.budget``)."""

    student: int = 0
    teacher: int = 0
    student_head: int = 0  # the head's share of ``student``: cross-tokenizer sampled_token runs it once more


class RolloutSetup(NamedTuple):
    """How this worker's rollouts are made: the ids that end one (the student's EOS ids; None: the tokenizer's),
    and the engine that samples them (``opd.rollouts: engine``; None: this worker samples)."""

    eos_ids: tuple[int, ...] | None = None
    engine: EngineRollouts | None = None


class OPDTask:
    """Rollouts (or cached teacher completions) for this worker, scored by the teacher.

    It takes the data, the scorer, the config and the worker's place in the run (``WorkerSetup``: tokenizer,
    batch geometry, seeds, rank, device, fault); the budget's parameter counts and the EOS ids are
    keyword-only (the EOS ids and the engine in ``RolloutSetup``), so that no call passes a row of bare numbers
    whose order it could get wrong.
    """

    def __init__(
        self,
        data: OPDData,
        teacher: LocalTeacher | EndpointTeacher,
        cfg: OPDConfig,
        setup: WorkerSetup,
        *,
        sizes: ModelSizes = ModelSizes(),
        rollouts: RolloutSetup = RolloutSetup(),
    ):
        tokenizer = setup.tokenizer
        self.prompts, self.teacher_completions, self.teacher = data.prompts, data.completions, teacher
        self.tokenizer, self.cfg, self.geometry = tokenizer, cfg, setup.geometry
        self.sampler_seed, self.seed = setup.sampler_seed, setup.stage_seed
        self.rank, self.device = setup.ctx.rank, setup.ctx.device
        self.fault, self.item_tasks = setup.fault, data.tasks or [None] * len(data.prompts)
        self.check_rows = data.check_rows if data.checkable() else None  # None: no correct_rate column
        self.student_params, self.teacher_params, head_params = sizes  # ars_opd.training.budget
        # cross-tokenizer sampled_token: one more no-grad pass of the student's head over the completion tokens
        self.extra_head_params = head_params if cfg.cross_tokenizer and cfg.loss == "sampled_token" else 0
        self.objective = objective_for(cfg)
        self.pad_id = pad_token_id(tokenizer)
        # what ends a completion, in the rollouts and in the loss mask alike: the student's EOS ids (default: the
        # tokenizer's alone)
        eos_ids = rollouts.eos_ids
        self.eos_ids = eos_ids if eos_ids is not None else tuple(eos_set(tokenizer.eos_token_id))
        self.engine = rollouts.engine  # opd.rollouts: engine (ars_opd.rollouts.schedule); None: this worker samples
        self.rollout_copy = CastCopy(torch.bfloat16) if cfg.rollout_dtype == "bf16" else None
        self.health = HealthMonitor()  # the live rollout-health check (check_step)
        # several teachers (ars_opd.training.opd.teacher_route): each row's teacher, and the columns again per teacher
        self.routed = teacher.names if isinstance(teacher, RoutedTeacher) else None
        self.row_teachers = data.teachers
        self.teacher_health = {t: HealthMonitor() for t in self.routed or ()}

    def worker_metric_names(self) -> tuple[str, ...]:
        """The columns the step log also keeps per worker (``worker_task/<name>``): the rollouts' health, so that
        one worker whose samples stop ending (a stale engine, a skewed shard) shows in the log by itself; with several
        teachers, per teacher too (``worker_task/<teacher>/<name>``)."""
        return ROLLOUT_HEALTH + tuple(column(t, n) for t in self.routed or () for n in ROLLOUT_HEALTH)

    def metric_names(self) -> list[str]:
        names = ["rollouts", "teacher_logprob", "entropy", "response_length", "response_length_sq", "eos_rate"]
        names += ["truncation_rate"]
        names += ["correct_rate"] if self.check_rows is not None else []
        names += ["divergence_first_half", "divergence_second_half", "gen_s", "teacher_s", "on_policy"]
        names += ["unaligned_rate"] if self.cfg.cross_tokenizer else []
        names += ["anchor_loss"] if self.cfg.anchor != "none" else []
        names += per_teacher_names(self.routed, self.check_rows is not None) if self.routed else []
        return names + (list(ENGINE_METRICS) if self.engine is not None else [])

    def teacher_tokens(self, step: int) -> int:
        """0: OPD's teacher-text steps (GKD) train on the SFT stage's rows, which the SFT stage paid for
        (``ars_opd.training.data_cost``); the teacher's scoring is in the step's FLOPs."""
        return 0

    def source(self, step: int) -> str:
        return "student" if uses_student_rollouts(self.seed, step, self.cfg.on_policy_fraction) else "teacher"

    def _indices(self, step: int) -> list[int]:
        idx = step_indices(step, len(self.prompts), self.geometry, self.sampler_seed, self.rank)
        if self.fault is not None:
            idx = self.fault.select(step, idx, self.item_tasks)
        return idx

    def _rollout_prompts(self, step: int) -> list[list[int]] | None:
        """This worker's prompts at ``step`` if it samples the student then (the engine asks ahead), else None."""
        if step >= self.cfg.steps or self.source(step) != "student":
            return None
        return [self.prompts[i] for i in self._indices(step)]

    def micro_batches(self, step: int, model: torch.nn.Module) -> list[MicroBatch]:
        idx = self._indices(step)
        prompts = [self.prompts[i] for i in idx]
        on_policy = self.source(step) == "student"
        t0 = time.perf_counter()
        sampling = GenerationCost()
        engine_meta: dict[str, tuple[float, float]] = {}
        engine_logprobs = None
        if self.engine is not None:  # sync if due and ask ahead, on every step (teacher-text steps included)
            self.engine.prepare(step, model, self.device, self._rollout_prompts)
        if on_policy and self.engine is not None:
            got = self.engine.take(step, prompts)
            completions, engine_logprobs = got.completions, got.logprobs
            sampling.forward_tokens = got.tokens  # the engine's forward: each prompt once, then each sampled token
            engine_meta = engine_step_metrics(got, self.engine.lag0_tolerance(got, model, self.cfg.precision))
        elif on_policy:
            sample = self.cfg.sample_temperature > 0
            sampler, precision = model, self.cfg.precision
            if self.rollout_copy is not None:  # a bf16 copy holding this step's weights (ars_opd.lm.rollout_copy)
                sampler, precision = self.rollout_copy.of(model), "fp32"
            with autocast_context(precision, self.device):  # rollouts in the training precision (or the copy's)
                completions = generate_token_ids(
                    sampler,
                    self.tokenizer,
                    prompts,
                    self.cfg.max_new_tokens,
                    batch_size=len(prompts),
                    do_sample=sample,
                    temperature=self.cfg.sample_temperature if sample else 1.0,
                    top_p=self.cfg.top_p,
                    cache=self.cfg.rollout_cache,
                    synced=is_sharded(model) and self.geometry.workers > 1,
                    eos_ids=self.eos_ids,
                    cost=sampling,
                )
        else:
            completions = [self.teacher_completions[i][: self.cfg.max_new_tokens] for i in idx]
        gen_s = time.perf_counter() - t0
        built = []
        for j in range(0, len(prompts), self.geometry.micro_batch):
            batch = build_rollout_batch(
                prompts[j : j + self.geometry.micro_batch],
                completions[j : j + self.geometry.micro_batch],
                self.pad_id,
                self.eos_ids,
            )
            if self.cfg.cross_tokenizer:  # the teacher renders each row's prompt in its own tokens
                batch["row_index"] = torch.tensor(idx[j : j + self.geometry.micro_batch], dtype=torch.long)
            if self.routed:  # several teachers: each row's own scores it
                rows = idx[j : j + self.geometry.micro_batch]
                batch[ROW_KEY] = torch.tensor([self.row_teachers[i] for i in rows], dtype=torch.long)
            if on_policy and self.cfg.truncated_rollouts != "keep":  # rollouts cut at max_new_tokens (no EOS)
                batch["overlong"] = (~batch["has_eos"]) & (batch["lengths"] >= self.cfg.max_new_tokens)
            if on_policy and self.cfg.anchor != "none":  # the teacher's text of the same prompts, beside them
                rows = idx[j : j + self.geometry.micro_batch]
                batch.update(
                    anchor_rows(
                        prompts[j : j + self.geometry.micro_batch],
                        [self.teacher_completions[i][: self.cfg.max_new_tokens] for i in rows],
                        self.pad_id,
                    )
                )
            if engine_logprobs is not None:
                batch["engine_logprobs"] = place_on_mask(
                    batch["loss_mask"], engine_logprobs[j : j + self.geometry.micro_batch]
                )
            built.append(batch)
        t0 = time.perf_counter()
        # an endpoint teacher scores the whole step's sequences here, at once (a local one does nothing)
        self.teacher.attach(built, self.objective)
        attach_s = time.perf_counter() - t0
        out = []
        for n, (j, b) in enumerate(zip(range(0, len(prompts), self.geometry.micro_batch), built)):
            n_seq = b["lengths"].numel()
            cut = (~b["has_eos"]) & (b["lengths"] >= self.cfg.max_new_tokens)
            meta = {
                # the step's rollouts, all workers: counted once (rank 0's first micro-batch holds the count)
                "rollouts": (float(n_seq), 1.0 if n == 0 and self.rank == 0 else 0.0),
                "response_length": (float(b["lengths"].sum()), float(n_seq)),
                "response_length_sq": (float(b["lengths"].double().pow(2).sum()), float(n_seq)),
                "eos_rate": (float(b["has_eos"].sum()), float(n_seq)),
                "truncation_rate": (float(cut.sum()), float(n_seq)),
                "on_policy": (float(on_policy), 1.0),
            }
            if self.check_rows is not None:  # over the micro-batch's checkable rows
                right, checked = self._correct(idx[j : j + self.geometry.micro_batch], completions[j : j + n_seq])
                meta["correct_rate"] = (float(right), float(checked))
            if self.routed:  # the same columns over each teacher's rows
                rows, done = idx[j : j + n_seq], completions[j : j + n_seq]
                correct = None
                if self.check_rows is not None:
                    correct = lambda sel, rows=rows, done=done: self._correct(  # noqa: E731
                        [r for r, s in zip(rows, sel.tolist()) if s], [c for c, s in zip(done, sel.tolist()) if s]
                    )
                meta.update(rollout_columns(self.routed, b, cut, meta["rollouts"][1], correct))
            if n == 0:
                meta["gen_s"] = (gen_s, 1.0)
                meta["teacher_s"] = (attach_s, 0.0)  # loss_sum adds the per-micro-batch part and the count
                meta.update(engine_meta)
            if "unaligned" in b:  # cross_tokenizer: student tokens after the last boundary the teacher can spell
                meta["unaligned_rate"] = (float(b["unaligned"]), float(b["loss_mask"].sum()))
            t = {k: v.to(self.device) for k, v in b.items() if k not in ("lengths", "has_eos", "unaligned")}
            real = int(b["attention_mask"].sum())
            generated = int(b["lengths"].sum()) if on_policy else 0
            # sampling: what the student's forward computed for the whole step (one generate call), not the kept
            # tokens: padded prompts, and rows that ended still step until the batch's last row does
            sampled = sampling.forward_tokens if n == 0 else 0
            # the teacher's forward runs on its own tokens of the text when they are not the student's
            real_t = int(b["teacher_attention_mask"].sum()) if "teacher_attention_mask" in b else real
            n_tok = int(b["loss_mask"].sum())
            flops = 6 * self.student_params * real + 2 * self.teacher_params * real_t
            if self.routed:  # each row's teacher forward at its own teacher's size
                flops = 6 * self.student_params * real + self.teacher.forward_flops(b)
            flops += 2 * self.student_params * sampled + 2 * self.extra_head_params * n_tok
            if "anchor_attention_mask" in b:  # the anchor rows' forward and backward (and the teacher's forward)
                anchor_real = int(b["anchor_attention_mask"].sum())
                real += anchor_real
                flops += 6 * self.student_params * anchor_real
                flops += 2 * self.teacher_params * anchor_real if self.cfg.anchor == "forward_kl" else 0
            # per sequence: the loss sums each completion's token mean, so the step averages over completions
            # (those with a loss token: a completion with none has no mean)
            units = int((b["loss_mask"].sum(1) > 0).sum()) if self.cfg.loss_normalisation == "sequence" else None
            out.append(
                MicroBatch(t, n_tok, n_seq, real, meta, flops=float(flops), generated_tokens=generated, units=units)
            )
        return out

    def loss_sum(self, model: torch.nn.Module, batch: MicroBatch) -> tuple[torch.Tensor, dict]:
        t = batch.tensors
        mask = t["loss_mask"]  # (B, T)
        anchor_hidden = None
        if "anchor_input_ids" in t:  # one forward over the rollouts and their anchor rows together
            full, anchor_hidden = joint_hidden(model, t, self.pad_id)
        else:
            full = last_hidden_states(model, t["input_ids"], t["attention_mask"])
        hidden = select_rows(full, mask)  # (M, H)
        t0 = time.perf_counter()
        scores = self.teacher.score(t, self.objective, self.cfg.temperature)
        teacher_s = time.perf_counter() - t0
        head = OutputHead.of(model, self.teacher.vocab)
        targets = t["targets"][mask]
        extra, weights = {}, None
        if "engine_logprobs" in t:  # engine rollouts: the sampler's log p of each token against ours now
            vocab = self.engine.engine_vocab or self.teacher.vocab
            extra, weights = against_engine(hidden, model, targets, t["engine_logprobs"][mask], self.cfg, vocab)
        if self.cfg.loss_normalisation == "sequence":  # each token weighs 1 / its completion's length
            per_seq = sequence_weights(mask)
            weights = per_seq if weights is None else weights * per_seq
        penalty = None
        if "overlong" in t:  # opd.truncated_rollouts: each scored token's rollout was cut at max_new_tokens
            cut = t["overlong"][mask.nonzero()[:, 0]].float()  # (M,)
            if self.cfg.truncated_rollouts == "mask":
                weights = (1.0 - cut) if weights is None else weights * (1.0 - cut)
            else:
                penalty = cut * self.cfg.overlong_penalty
        per_token = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(per_token)
        loss_sum, n = self.objective.loss(
            hidden,
            head,
            scores,
            targets,
            self.cfg.beta,
            self.cfg.temperature,
            self.cfg.chunk_size,
            row_weights=weights,
            record=per_token,
            entropy=entropy,
            penalty=penalty,
        )
        if anchor_hidden is not None:
            anchor_sum, anchor_metric = anchor_loss(anchor_hidden, head, t, self.cfg, self.teacher)
            loss_sum = loss_sum + anchor_sum
            extra["anchor_loss"] = anchor_metric
        first = in_first_half(mask)
        second = ~first
        if "student_span" in t:  # across tokenizers: the columns average over the tokens in a span (unaligned: 0)
            aligned = t["student_span"] >= 0
            n, first, second = int(aligned.sum()), first & aligned, second & aligned
        if self.routed:  # the same columns over each teacher's positions
            owner = t[ROW_KEY][mask.nonzero()[:, 0]]
            values = {"teacher_logprob": scores.target_logprobs(), "entropy": entropy, "divergence": per_token}
            extra.update(scored_columns(self.routed, owner, values, first, second))
        return loss_sum, {
            "teacher_logprob": (float(scores.target_logprobs().sum()), float(n)),
            "entropy": (float(entropy.sum()), float(entropy.numel())),
            "divergence_first_half": (float(per_token[first].sum()), float(first.sum())),
            "divergence_second_half": (float(per_token[second].sum()), float(second.sum())),
            "teacher_s": (teacher_s, 1.0 if batch.meta.get("gen_s") else 0.0),
            **extra,
        }

    def _correct(self, rows: list[int], completions: list[list[int]]) -> tuple[int, int]:
        """(how many of these completions answer their row correctly, how many of the rows can be checked): token
        ids cut at the first EOS when decoded, checked as the evaluation checks them (``ars_opd.data.answers``)."""
        right = checked = 0
        for i, c in zip(rows, completions):
            row = self.check_rows[i]
            if row is not None:
                checked += 1
                right += is_correct(row, decode_completion(self.tokenizer, c, self.eos_ids))
        return right, checked

    def check_step(self, step: int, metrics: dict) -> None:
        """After the step's columns are reduced, before its update: the engine's lag-0 check
        (``EngineRollouts.check_step``), and the rollouts' health (``ars_opd.training.opd.rollout_health``, at its
        default settings): the step the rollouts leave their start, rank 0 says so in one line (the run goes on;
        the report, ``ars-opd summary`` and ``ars-opd check`` judge the whole log again)."""
        if self.engine is not None:
            self.engine.check_step(step, metrics, self.cfg.engine.dlogp_check)
        alarm = self.health.add(step_rollouts(step, metrics))
        if alarm is not None and self.rank == 0:
            print(f"warning: {alarm.line('opd')}", file=sys.stderr, flush=True)
        for teacher, monitor in self.teacher_health.items():  # several teachers: each one's rollouts too
            alarm = monitor.add(step_rollouts(step, metrics, column(teacher, "")))
            if alarm is not None and self.rank == 0:
                where = f"opd ({teacher}'s prompts)"
                print(f"warning: {alarm.line(where)}", file=sys.stderr, flush=True)
