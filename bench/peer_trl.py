"""Our SFT and OPD training steps against TRL's on the real profile's models: step time, tokens/s, extra peak memory,
and whether the two compute the same loss.

Why: a figure for our engine's step (bench/sft_throughput.py, bench/gpu.py) says little on its own; against the
implementation most people would reach for instead, TRL's ``SFTTrainer`` and its on-policy ``DistillationTrainer``,
doing the same work, it says whether our step is slow, and where. The comparison holds only if both sides train the
same thing, so each run starts from the same weights (the student reloaded from disk), sees the same batches in the same
order, and uses the same optimiser (``ars_opd.lm.optim.make_optimizer``, handed to TRL), the same schedule
(``make_scheduler`` over the profile's steps, so a run's first steps have the real run's learning rates) and the same
clipping, on CPU in fp32. Whether the batches were the same is recorded, not assumed: every sequence either side
trained on is read back from its batches (ours: the micro-batches the task built; TRL's: the examples its collator
received, or the prompts its trainer tokenised) and compared. Step 0's loss, from the same weights on the same tokens,
must then agree between the two sides to the digits both print (ours ``.4f``, TRL's logger ``.4g``); the later steps'
losses and the pre-clip gradient norms are reported too, so an optimiser, schedule or clipping difference shows up as
a drift from step 1 on.

Settings: ``params.yaml`` with ``profiles/real.yaml`` applied (``ars_opd.profiles.merged``), so lr, warmup, clipping,
batch sizes, budgets and max_new_tokens are the real profile's, except OPD's ``max_new_tokens`` (``--max-new-tokens``,
64); one worker in this process (``ddp.workers: 1``, in a world of one, as the stages run one worker), CPU fp32.

- SFT, ours: the sft stage's own preparation (``prepare_sft``: budgets, EOS rules, the data order of
  ``batch_plan.step_indices``) and the engine's step (``Trainer.step``: micro-batches with the global token
  normalisation, clipping, AdamW, schedule), with the per-worker diagnostics off (the consistency monitor and the drift
  check, whose cost bench/consistency_overhead.py measures). Variants ``padded`` (``sft.packing: false``, the profile's
  default) and ``packed`` (padding-free packed rows, per-sequence SDPA on CPU).
- SFT, TRL: ``SFTTrainer`` on a pre-tokenised dataset (``input_ids`` + ``completion_mask``, completion-only loss) made
  of exactly our tokens, in our order (sequential sampler, no shuffling, drop_last, no length grouping), with our
  micro-batch as ``per_device_train_batch_size`` and our accumulation as ``gradient_accumulation_steps``
  (transformers then divides each micro-batch's loss sum by the step's loss-token count: our global token mean).
  Variants ``padded`` (padding_free off, packing off), ``padding_free`` (each micro-batch flattened into one row; on CPU
  transformers' SDPA masks the sequences apart from the restarting position ids) and ``packing`` (TRL's best-fit-
  decreasing packing into rows of ``sft.pack_length``, one row per micro-batch; it packs the whole dataset before
  batching, so its steps hold other sequences than ours: reported, its losses not compared). Packing without
  padding-free (``packing_strategy: wrapped``) cuts sequences and lets them attend across each other: another
  objective, reported as not run.
- OPD, ours: the opd stage's preparation (``prepare_opd``, from the base student) and step: trainer rollouts
  (``opd.rollouts: trainer``), the local teacher, reverse KL (beta 1) over the full vocabulary, sampling temperature 1.
  Variants (``OPD_SETTINGS``, each a setting of the stage):
  ``trainer_rollouts`` (the profile's: transformers' ``generate``, fp32);
  ``static_rollouts`` (``opd.rollout_cache: static``: our decode loop over a preallocated KV cache with the inverse-CDF
  sampler, fp32: the same policy and the same loss, other random draws);
  ``bf16_rollouts`` (static, and ``opd.rollout_dtype: bf16``: sampled from a bf16 copy of the student refreshed every
  step, much faster on a CPU with AMX; the loss is still fp32, but the samples are the bf16-rounded policy's);
  ``bf16_rollouts_teacher`` (that, and ``opd.teacher_dtype: bf16``: the teacher's weights in bf16, as a GPU run loads
  them by default; its log-probabilities are those of the rounded teacher).
  TRL: ``DistillationTrainer`` (always on-policy, lambda 1) on the same prompts in the same order, with the same
  temperature, beta, top-p 1, top-k off, generation batch = our global batch split into our micro-batches (TRL
  shuffles the rollouts before the split; the step's loss, a global token mean, is the same); variants ``on_policy``
  (fp32 teacher) and ``on_policy_bf16_teacher`` (the teacher model loaded in bf16, the student fp32). The fp32
  variants of both sides (``FP32_VARIANTS``) are compared like for like in the summary's ``fp32_trl_over_ours``.
  Rollouts are random on both sides, so step 0's losses differ by sampling alone; to check that the two losses are the
  same function, the ``opd_same_samples`` line scores our step-0 rollouts with both: our objective and TRL's
  ``_chunked_divergence_loss`` (its private loss function, called directly). On the same hidden states the
  ``opd_loss_memory`` line measures the extra peak memory of each loss alone (forward and backward from the hidden
  states, the gradient buffers preallocated): what the loss itself costs, apart from the models' activations.
  TRL's vLLM generation is reported as not run where it cannot run (this environment has no vllm; its server mode
  syncs weights over NCCL, CUDA only).

Rounds: for threads in ``--threads``, ``--rounds`` rounds; within a round the runs alternate between the sides
(ours, TRL, ours, TRL, ...; TRL first in odd rounds), each ``--steps`` optimiser steps from the same start. Step 0 is
warm-up: the medians and tokens/s use steps 1 on. Ours is timed around ``Trainer.step`` (building its micro-batches
included); TRL's from the end of one step to the end of the next (its batch fetch and collation, and its log of the
step before, included), from callbacks. Extra peak memory: in round 0 of each thread count one more step,
untimed, runs under ``torch.profiler`` with ``profile_memory=True`` (bench/loss_memory.py's method: the peak of the
running sum of every CPU allocation and free, on every thread, above what existed before the step: weights,
optimiser state and, for TRL, the collated batch; generation, gradients and activations count). Our DDP keeps the
gradients in its buckets between steps (``gradient_as_bucket_view``), so they are not part of our extra peak; TRL
frees them every step (``zero_grad``), so they are part of its: ``grad_bytes_held`` says which, and
``extra_peak_plus_held_bytes`` adds them back for a like-for-like figure.

Output (stdout, JSON lines; progress and TRL's own log on stderr): a ``setup`` line (versions, the settings used);
``skipped`` lines; the ``opd_same_samples`` check and the ``opd_loss_memory`` line; one line per (kind, side, variant,
threads, round) with ``step_s``, ``median_step_s``, ``tokens_per_step`` and ``tokens_per_s`` (real, non-padding tokens
trained, per second of the timed steps), ``step0_loss`` (and as that side prints it), ``losses``, ``grad_norms``
(pre-clip), ``lrs``, ``extra_peak_bytes``, ``rows_match`` (the sequences it trained on are ours, in our order); a
``step0_loss`` check line per TRL SFT variant and thread count (round 0); and a ``summary`` line per (kind, threads):
TRL's best same-batch median step time over our default variant's (``trl_over_ours``), over our best variant's
(``trl_over_ours_best``) and over each of ours (``trl_best_over``), TRL's best fp32 variant over our best fp32 variant
(``fp32_trl_over_ours``), each the median of the per-round ratios with their min and max, and the tokens/s ratio of
each side's best variant.

    make trl    # trl==1.16.0 into .venv (a benchmark dependency only)
    python bench/peer_trl.py > reports/peer_trl.jsonl     # after make repro-real: data/models, data/teacher
    python bench/peer_trl.py --models /path/models --teacher-rows /path/teacher/train.jsonl --rounds 1 --steps 3
    python bench/peer_trl.py --quick                        # smoke run: 1 thread, 1 round, 2 steps, batch 4

Time: the default run (threads 1 and 2, 3 rounds, 5 SFT and 6 OPD variants) took 35 minutes on 2 idle cores, a
1-thread round about 9 minutes of it (OPD ~11 s a step); ``--kinds sft`` takes about a quarter of it,
``--opd-variants`` fewer OPD runs, ``--quick`` about 2 minutes. Imports neither dvc nor
openai; needs trl (and datasets, which it brings).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "bench", REPO):  # `python bench/peer_trl.py` from anywhere runs this checkout's ars_opd
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from loss_memory import cpu_extra_peak, profiled_peak  # noqa: E402

from ars_opd.config import Params, load_params, read_params_file  # noqa: E402
from ars_opd.data.prompts import encode_prompts  # noqa: E402
from ars_opd.lm.batching import IGNORE_INDEX  # noqa: E402
from ars_opd.lm.optim import make_optimizer, make_scheduler  # noqa: E402
from ars_opd.models.loading import load_model, load_tokenizer  # noqa: E402
from ars_opd.profiles import merged, read_profile  # noqa: E402
from ars_opd.seeding import derive_seed, scenario_seeds, set_seeds  # noqa: E402
from ars_opd.training.batch_plan import BatchGeometry, step_indices  # noqa: E402
from ars_opd.training.distributed import init_worker, shutdown_worker  # noqa: E402
from ars_opd.training.loop import Trainer  # noqa: E402
from ars_opd.training.opd.stage import prepare_opd  # noqa: E402
from ars_opd.training.sft import encode_sft_rows, prepare_sft  # noqa: E402
from ars_opd.training.task import RunHooks  # noqa: E402
from ars_opd.training.train_rows import train_rows  # noqa: E402
from ars_opd.training.worker import TrainingJob, WorkerSetup  # noqa: E402

# our OPD variants, each a setting of the opd stage: the profile's (generate, fp32), the static-cache loop (fp32, the
# same policy), rollouts from a bf16 copy of the student (the loss in fp32; the samples are the bf16-rounded policy's),
# and a bf16 teacher on top (its log-probabilities rounded to bf16 weights)
OPD_SETTINGS = {
    "trainer_rollouts": {},
    "static_rollouts": {"rollout_cache": "static"},
    "bf16_rollouts": {"rollout_cache": "static", "rollout_dtype": "bf16"},
    "bf16_rollouts_teacher": {"rollout_cache": "static", "rollout_dtype": "bf16", "teacher_dtype": "bf16"},
}
OURS_VARIANTS = {"sft": ("padded", "packed"), "opd": tuple(OPD_SETTINGS)}
# TRL's teacher can be loaded in bf16 too (the student, which it samples from and trains, stays fp32)
TRL_VARIANTS = {"sft": ("padded", "padding_free", "packing"), "opd": ("on_policy", "on_policy_bf16_teacher")}
# every variant but TRL's whole-dataset packing trains on our batches
SAME_BATCHES = {"padded", "padding_free", "packed", *OPD_SETTINGS, *TRL_VARIANTS["opd"]}
# the variants that compute in fp32 throughout (like for like); the others round the rollouts' policy or the teacher
FP32_VARIANTS = {"padded", "padding_free", "packing", "packed", "trainer_rollouts", "static_rollouts", "on_policy"}
MEMORY_METHOD = "torch.profiler allocation events (bench/loss_memory.py), one untimed step after the timed ones"
OUT = sys.stdout  # JSON only; everything else (ours, TRL's logger prints) goes to stderr


def emit(line: dict) -> None:
    OUT.write(json.dumps(line) + "\n")
    OUT.flush()


def progress(msg: str) -> None:
    print(f"[peer_trl {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- settings and inputs ----


def real_params(work: Path, quick: bool, max_new_tokens: int, profile: Path = REPO / "profiles/real.yaml") -> Params:
    """params.yaml with the real profile (or ``profile``) applied; one CPU worker without the diagnostics; OPD's
    max_new_tokens; OPD from the base student (no SFT model is needed). Written to ``work`` and parsed with every
    stage check."""
    raw = merged(read_params_file(REPO / "params.yaml"), read_profile(profile))
    raw["ddp"].update(workers=1, device="cpu", backend="gloo", consistency=False, drift_check_every=0)
    raw["opd"].update(max_new_tokens=max_new_tokens, rollouts="trainer", teacher="local")
    models_dir = raw.get("paths", {}).get("models_dir", "data/models")
    raw.setdefault("paths", {})["distill_init"] = f"{models_dir}/student"
    if quick:
        for kind in ("sft", "opd"):
            raw[kind].update(global_batch_size=4, micro_batch_size=2)
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_params(path, sections=("paths", "ddp", "sft", "opd", "control"), base=REPO)


def link_inputs(work: Path, params: Params, models: Path, rows: Path) -> None:
    """``work`` as the stages' workspace: the params' models_dir and teacher_dir/train.jsonl linked to the inputs."""
    for target, source in (
        (work / params.paths.models_dir, models),
        (work / params.paths.completions("train"), rows),
    ):
        if not source.exists():
            raise SystemExit(f"{source} not found: run `make repro-real` first, or pass --models / --teacher-rows")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source.resolve(), target_is_directory=source.is_dir())


def section(params: Params, kind: str, variant: str):
    cfg = getattr(params, kind)
    if kind == "sft":
        return dataclasses.replace(cfg, packing=variant == "packed")
    return dataclasses.replace(cfg, **OPD_SETTINGS[variant])


def worker_setup(ctx, params: Params, kind: str, cfg) -> WorkerSetup:
    """This worker's place, as ``run_worker`` derives it for the stage (seeds, geometry, tokenizer); no fault."""
    stage_seed = derive_seed(params.ddp.seed, kind)
    sampler_seed, rng_seed = scenario_seeds(params.ddp.scenario, stage_seed, ctx.rank)
    set_seeds(rng_seed)
    geometry = BatchGeometry.check(cfg.global_batch_size, ctx.world_size, cfg.micro_batch_size, kind)
    tokenizer = load_tokenizer(params.paths.models_dir)
    return WorkerSetup(ctx, tokenizer, geometry, sampler_seed, stage_seed, None, (sampler_seed,), rng_seed)


def step_order(params: Params, kind: str, n_items: int) -> list[int]:
    """Item indices in the order our steps take them, for one epoch (``batch_plan.step_indices``)."""
    cfg = getattr(params, kind)
    geometry = BatchGeometry.check(cfg.global_batch_size, 1, cfg.micro_batch_size, kind)
    sampler_seed, _ = scenario_seeds(params.ddp.scenario, derive_seed(params.ddp.seed, kind), 0)
    per_epoch = n_items // geometry.global_batch
    return [i for s in range(per_epoch) for i in step_indices(s, n_items, geometry, sampler_seed, 0)]


# ---- what a batch held ----


def sft_sequences(t: dict) -> list[tuple[int, ...]]:
    """The whole sequences (prompt + completion ids) of one of our SFT micro-batches, padded or packed."""
    if "cu_seq_lens" in t:
        ids, labels, cu = t["input_ids"].reshape(-1), t["labels"].reshape(-1), t["cu_seq_lens"].tolist()
        return [tuple(ids[a:b].tolist()) for a, b in zip(cu[:-1], cu[1:]) if bool((labels[a:b] != IGNORE_INDEX).any())]
    return [tuple(row[: int(n)].tolist()) for row, n in zip(t["input_ids"], t["attention_mask"].sum(1))]


def opd_sequences(t: dict) -> list[tuple[tuple[int, ...], int]]:
    """(prompt ids, completion length) of each row of one of our OPD micro-batches."""
    out = []
    for ids, mask, attended in zip(t["input_ids"], t["loss_mask"], t["attention_mask"]):
        first = int(mask.nonzero()[0]) if bool(mask.any()) else int(attended.sum()) - 1  # no completion: all prompt
        out.append((tuple(ids[: first + 1].tolist()), int(mask.sum())))
    return out


# ---- our side ----


def run_ours(ctx, params: Params, kind: str, variant: str, threads: int, steps: int, measure: bool) -> dict:
    torch.set_num_threads(threads)
    cfg = section(params, kind, variant)
    job = TrainingJob(kind, cfg, params.ddp, params.paths, progress=False, control=params.control)
    job.check()
    setup = worker_setup(ctx, params, kind, cfg)
    run = (prepare_sft if kind == "sft" else prepare_opd)(job, setup)
    run.model.train()
    trainer = Trainer.build(ctx, run.model, run.task, cfg, params.ddp, RunHooks(progress=False))
    built: list[list] = []
    make = run.task.micro_batches

    def recording(step, model):  # keeps what each step trained on; read after the run, outside the timings
        micro = make(step, model)
        built.append(micro)
        return micro

    run.task.micro_batches = recording
    times, losses, norms, lrs, peak = [], [], [], [], None
    results = []
    step_once = trainer.step
    for step in range(steps + int(measure)):
        lrs.append(trainer.opt.param_groups[0]["lr"])  # the rate this step uses (step() advances the schedule)
        if step < steps:
            t0 = time.perf_counter()
            results.append(step_once())
            times.append(time.perf_counter() - t0)
        else:  # the memory step, untimed
            peak = cpu_extra_peak(lambda: results.append(step_once()))
        result = results[-1]
        losses.append(result.loss)
        norms.append(result.grad_norm)
        trainer.state.step += 1
        took = f" ({times[-1]:.2f} s)" if step < steps else " (memory)"
        progress(f"  ours {kind}/{variant} step {step}: loss {result.loss:.4f}{took}")
    out = {"times": times, "losses": losses, "grad_norms": norms, "lrs": lrs, "peak": peak}
    out["threads_seen"] = torch.get_num_threads()
    if kind == "sft":
        out["seen"] = [[s for b in micro for s in sft_sequences(b.tensors)] for micro in built]
    else:
        out["seen"] = [[s for b in micro for s in opd_sequences(b.tensors)] for micro in built]
        out["real_tokens"] = [sum(b.n_real_tokens for b in micro) for micro in built]
    out["grad_bytes_held"] = sum(p.numel() * p.element_size() for p in run.model.parameters())  # DDP bucket views
    del trainer, run
    gc.collect()
    return out


# ---- TRL's side ----


def _trl_clock(profile_step: int | None):
    """A TrainerCallback timing each optimiser step (end to end: the next batch's fetch and the last step's log
    included, as a user of the trainer waits for them) and profiling step ``profile_step``'s memory."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin, self.end, self.peak, self.prof, self.threads = [], [], None, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            self.threads = torch.get_num_threads()
            if state.global_step == profile_step:
                self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                self.peak, self.prof = profiled_peak(self.prof), None

        def step_seconds(self, steps: int) -> list[float]:
            return [self.end[0] - self.begin[0]] + [self.end[k] - self.end[k - 1] for k in range(1, steps)]

    return Clock()


def _common_args(cfg, geometry: BatchGeometry, steps: int, out_dir: str, seed: int) -> dict:
    return dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=geometry.micro_batch,
        gradient_accumulation_steps=geometry.accumulation,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
        learning_rate=cfg.lr,  # unused: the optimizer and schedule are ours, handed over
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        seed=seed,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_drop_last=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        shuffle_dataset=False,
    )


def _losses(log_history: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Each step's loss, pre-clip gradient norm and learning rate (the one the step used), as TRL logged them."""
    rows = [r for r in log_history if "loss" in r]
    return [r["loss"] for r in rows], [r.get("grad_norm") for r in rows], [r.get("learning_rate") for r in rows]


def run_trl_sft(params: Params, variant: str, data, order: list[int], threads: int, steps: int, measure: bool) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(threads)
    cfg = params.sft
    geometry = BatchGeometry.check(cfg.global_batch_size, 1, cfg.micro_batch_size, "sft")
    packing = variant == "packing"
    tokenizer = load_tokenizer(params.paths.models_dir)
    model = load_model(params.paths.models_dir, "student")
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg, cfg.steps)
    rows = [
        {
            "input_ids": data.prompts[i] + data.completions[i],
            "completion_mask": [0] * len(data.prompts[i]) + [1] * len(data.completions[i]),
        }
        for i in order
    ]
    total = steps + int(measure)
    clock = _trl_clock(steps if measure else None)
    seen: list[list[tuple[int, ...]]] = []
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as out_dir:
        common = _common_args(cfg, geometry, total, out_dir, derive_seed(params.ddp.seed, "sft"))
        if packing:  # one packed row of pack_length per micro-batch
            common["per_device_train_batch_size"] = 1
        args = SFTConfig(
            **common,
            completion_only_loss=True,
            padding_free=variant == "padding_free",
            packing=packing,
            packing_strategy="bfd",
            # padding-free without packing refuses a max_length (our rows already fit max_seq_len)
            max_length=cfg.pack_length if packing else None if variant == "padding_free" else cfg.max_seq_len,
        )
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            optimizers=(opt, sched),
            callbacks=[clock],
        )
        collate = trainer.data_collator

        def recording(examples):
            batch = []
            for ex in examples:
                ids = list(ex["input_ids"])
                lengths = ex.get("seq_lengths") or [len(ids)]
                starts = [sum(lengths[:k]) for k in range(len(lengths))]
                batch += [tuple(ids[a : a + n]) for a, n in zip(starts, lengths)]
            seen.append(batch)
            return collate(examples)

        trainer.data_collator = recording
        trainer.train()
        losses, norms, lrs = _losses(trainer.state.log_history)
    per_step = [
        [s for mb in seen[k * geometry.accumulation : (k + 1) * geometry.accumulation] for s in mb]
        for k in range(total)
    ]
    out = {"times": clock.step_seconds(steps), "losses": losses, "grad_norms": norms, "lrs": lrs, "peak": clock.peak}
    out.update(seen=per_step, threads_seen=clock.threads, grad_bytes_held=0)
    for k, loss in enumerate(losses):
        progress(f"  trl sft/{variant} step {k}: loss {loss:.4g}")
    del trainer, model, opt
    gc.collect()
    return out


def run_trl_opd(
    params: Params, variant: str, messages: list[list[dict]], threads: int, steps: int, measure: bool
) -> dict:
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    class Recording(DistillationTrainer):
        def _generate(self, prompts):
            out = super()._generate(prompts)
            self.bench_rollouts.append((out[0], out[1]))  # prompt ids, completion ids (cut after the first EOS)
            return out

    torch.set_num_threads(threads)
    cfg = params.opd
    if cfg.sample_temperature != cfg.temperature:
        raise ValueError("TRL samples and scores at one temperature: opd.sample_temperature != opd.temperature")
    geometry = BatchGeometry.check(cfg.global_batch_size, 1, cfg.micro_batch_size, "opd")
    tokenizer = load_tokenizer(params.paths.models_dir)
    student = load_model(params.paths.models_dir, "student")  # the base student: ours starts from it (distill_init)
    teacher_dtype = torch.bfloat16 if variant == "on_policy_bf16_teacher" else torch.float32
    teacher = load_model(params.paths.models_dir, "teacher", dtype=teacher_dtype).eval()
    opt = make_optimizer(student, cfg)
    sched = make_scheduler(opt, cfg, cfg.steps)
    total = steps + int(measure)
    clock = _trl_clock(steps if measure else None)
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as out_dir:
        args = DistillationConfig(
            **_common_args(cfg, geometry, total, out_dir, derive_seed(params.ddp.seed, "opd")),
            max_completion_length=cfg.max_new_tokens,
            temperature=cfg.sample_temperature,
            top_p=cfg.top_p,
            top_k=0,
            beta=cfg.beta,
        )
        trainer = Recording(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=Dataset.from_list([{"prompt": m} for m in messages]),
            processing_class=tokenizer,
            optimizers=(opt, sched),
            callbacks=[clock],
        )
        trainer.bench_rollouts = []
        trainer.train()
        losses, norms, lrs = _losses(trainer.state.log_history)
        rollouts = trainer.bench_rollouts
    seen = [[(tuple(p), len(c)) for p, c in zip(ps, cs)] for ps, cs in rollouts]
    real = [sum(len(p) + len(c) for p, c in zip(ps, cs)) for ps, cs in rollouts]
    out = {"times": clock.step_seconds(steps), "losses": losses, "grad_norms": norms, "lrs": lrs, "peak": clock.peak}
    out.update(seen=seen, real_tokens=real, threads_seen=clock.threads, grad_bytes_held=0)
    for k, loss in enumerate(losses):
        progress(f"  trl opd step {k}: loss {loss:.4g}")
    del trainer, student, teacher, opt
    gc.collect()
    return out


# ---- the comparison ----


def opd_same_samples(ctx, params: Params) -> list[dict]:
    """Our step-0 rollouts (from the base student) scored by our objective and by TRL's loss function: the same
    divergence on the same samples must give the same number. Then the extra peak memory of each loss alone
    (``opd_loss_memory``), on the same hidden states."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    cfg = params.opd
    job = TrainingJob("opd", cfg, params.ddp, params.paths, progress=False, control=params.control)
    run = prepare_opd(job, worker_setup(ctx, params, "opd", cfg))
    model, task = run.model.eval(), run.task
    teacher = task.teacher.model
    hidden = []
    with torch.no_grad():
        micro = task.micro_batches(0, model)
        n = sum(b.n_tokens for b in micro)
        ours = sum(float(task.loss_sum(model, b)[0]) for b in micro) / n
        theirs = 0.0
        for b in micro:
            t = b.tensors
            hs = model.base_model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).last_hidden_state
            ht = teacher.base_model(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).last_hidden_state
            hidden.append((hs, ht, t))
            loss, _, _ = _chunked_divergence_loss(
                hs[:, :-1],
                ht[:, :-1],
                model.get_output_embeddings().weight,
                teacher.get_output_embeddings().weight,
                t["loss_mask"][:, :-1],
                cfg.beta,
                num_items_in_batch=n,
                temperature=cfg.temperature,
            )
            theirs += float(loss)
    same = {
        "kind": "opd",
        "check": "opd_same_samples",
        "tokens": n,
        "ours": ours,
        "trl": theirs,
        "abs_diff": abs(ours - theirs),
        "rel_diff": abs(ours - theirs) / abs(ours) if ours else None,
        "what": "reverse KL of our step-0 rollouts, our objective vs trl.trainer.distillation_trainer."
        "_chunked_divergence_loss on the same hidden states' heads",
    }
    memory = opd_loss_memory(model, teacher, task, hidden, n)
    del run, model, task, teacher, hidden
    gc.collect()
    return [same, memory]


def opd_loss_memory(model, teacher, task, hidden: list, n: int) -> dict:
    """Extra peak memory of the OPD loss alone, forward and backward, per micro-batch of the step-0 rollouts: ours
    (the rows with a loss token selected, ``full_vocab`` chunked over ``opd.chunk_size`` positions) against TRL's
    ``_chunked_divergence_loss`` (its tiles), each from the same (B, T, H) student hidden states (a leaf that needs a
    gradient) and the same teacher hidden states, up to the gradients of the student's hidden states and head. The
    gradient buffers both sides fill exist before (preallocated, zero), so they are not counted; what is counted is
    what the loss itself allocates (logits, probabilities, their gradients, and the head's gradient before it is added
    into the buffer)."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    from ars_opd.lm.head import OutputHead, select_rows
    from ars_opd.lm.opd_objectives import TeacherLogits, TeacherScores

    cfg = task.cfg
    weight_s = model.get_output_embeddings().weight
    weight_t = teacher.get_output_embeddings().weight
    head_s, head_t = OutputHead.of(model, task.teacher.vocab), OutputHead.of(teacher, task.teacher.vocab)
    peaks: dict[str, list[int]] = {"ours": [], "trl": []}
    for hs0, ht, t in hidden:
        mask = t["loss_mask"]
        targets = t["targets"][mask]

        def ours_loss(hs):
            scores = TeacherScores(logits=TeacherLogits(select_rows(ht, mask), head_t, targets))
            loss, _ = task.objective.loss(
                select_rows(hs, mask), head_s, scores, targets, cfg.beta, cfg.temperature, cfg.chunk_size
            )
            return loss / n

        def trl_loss(hs):
            loss, _, _ = _chunked_divergence_loss(
                hs[:, :-1], ht[:, :-1], weight_s, weight_t, mask[:, :-1], cfg.beta, num_items_in_batch=n,
                temperature=cfg.temperature,
            )  # fmt: skip
            return loss

        for side, fn in (("ours", ours_loss), ("trl", trl_loss)):
            hs = hs0.detach().clone().requires_grad_(True)
            hs.grad = torch.zeros_like(hs)
            model.zero_grad(set_to_none=True)
            weight_s.grad = torch.zeros_like(weight_s)
            fn(hs).backward()  # warm-up: the same shapes once before the measured call
            peaks[side].append(cpu_extra_peak(lambda: fn(hs).backward()))
    model.zero_grad(set_to_none=True)
    ours, trl = max(peaks["ours"]), max(peaks["trl"])
    return {
        "kind": "opd",
        "check": "opd_loss_memory",
        "micro_batches": len(hidden),
        "loss_positions": [int(t["loss_mask"].sum()) for _, _, t in hidden],
        "chunk_size": cfg.chunk_size,
        "ours_extra_peak_bytes": peaks["ours"],
        "trl_extra_peak_bytes": peaks["trl"],
        "ours_over_trl": round(ours / trl, 3),
        "method": "torch.profiler allocation events (bench/loss_memory.py) around the loss's forward and backward "
        "from hidden states, gradient buffers preallocated; the largest micro-batch figure of each side",
    }


def record(kind: str, side: str, variant: str, threads: int, rnd: int, got: dict, expected: list | None) -> dict:
    steps = len(got["times"])
    seen = got["seen"][:steps]
    tokens = got.get("real_tokens") or [sum(len(s) for s in step) for step in got["seen"]]
    timed = got["times"][1:]  # step 0 is warm-up
    line = {
        "kind": kind,
        "side": side,
        "variant": variant,
        "threads": threads,
        "threads_seen": got["threads_seen"],
        "round": rnd,
        "steps": steps,
        "step_s": [round(t, 4) for t in got["times"]],
        "median_step_s": round(statistics.median(timed), 4) if timed else None,
        "tokens_per_step": tokens[:steps],
        "tokens_per_s": round(sum(tokens[1:steps]) / sum(timed), 1) if timed else None,
        "step0_loss": got["losses"][0],
        "step0_loss_printed": f"{got['losses'][0]:.4f}" if side == "ours" else f"{got['losses'][0]:.4g}",
        "losses": got["losses"][:steps],
        "grad_norms": got["grad_norms"][:steps],
        "lrs": got["lrs"][:steps],
        "extra_peak_bytes": got["peak"],
        "memory_method": MEMORY_METHOD if got["peak"] is not None else None,
        "grad_bytes_held": got["grad_bytes_held"],
        "extra_peak_plus_held_bytes": got["peak"] + got["grad_bytes_held"] if got["peak"] is not None else None,
        "same_batches": variant in SAME_BATCHES,
    }
    if kind == "opd":
        line["completion_tokens_per_step"] = [sum(c for _, c in step) for step in seen]
        seen = [[p for p, _ in step] for step in seen]
    if expected is not None:
        flat = [s for step in seen for s in step]
        line["rows_match"] = flat == expected[: len(flat)]
    return line


def step0_check(ours: dict, trl: dict) -> dict:
    a, b = ours["step0_loss"], trl["step0_loss"]
    printed = (f"{a:.4f}", f"{b:.4g}")
    # the digits both print: TRL's 4 significant digits are the coarser (a loss >= 1 gets 3 decimals)
    agree = f"{a:.4g}" == f"{b:.4g}"
    line = {
        "kind": "sft",
        "check": "step0_loss",
        "threads": ours["threads"],
        "ours_variant": ours["variant"],
        "trl_variant": trl["variant"],
        "ours": a,
        "trl": b,
        "printed": {"ours": printed[0], "trl": printed[1]},
        "agree_printed": agree,
        "abs_diff": abs(a - b),
        "rel_diff": abs(a - b) / abs(a),
        "loss_abs_diff_per_step": [abs(x - y) for x, y in zip(ours["losses"], trl["losses"])],
        "grad_norm_rel_diff_per_step": [
            abs(x - y) / abs(x) if x and y is not None else None for x, y in zip(ours["grad_norms"], trl["grad_norms"])
        ],
        "lrs_equal": ours["lrs"] == trl["lrs"],
    }
    if not trl["same_batches"]:
        line.update(agree_printed=None, why="TRL's packing packs the whole dataset before batching: other sequences")
        return line
    line["note"] = (
        "step 0: the same weights on the same tokens; from step 1 on the weights differ by the first AdamW "
        "updates of gradients rounded differently in fp32 (AdamW's first updates are about lr * sign(g), so a "
        "near-zero gradient element whose sign differs moves its weight by the full learning rate): later steps "
        "agree closely, not to the bit"
    )
    if not (ours.get("rows_match") and trl.get("rows_match")):
        line.update(why="the two sides did not see the same rows (rows_match false)")
    elif not agree:
        line.update(why="fp32 sums in another order (chunked head vs TRL's tiles) landed across a rounding boundary")
    return line


def summary(kind: str, threads: int, lines: list[dict]) -> dict:
    """TRL's best same-batch median step time over ours, per round (the rounds' median, min and max): against our
    default variant (the profile's), against our best, against each of our variants (``trl_best_over``), and like for
    like in fp32 (TRL's best fp32 variant over our best fp32 variant, ``fp32_trl_over_ours``); and the tokens/s of
    each side's best variant (any)."""
    mine = [x for x in lines if x["kind"] == kind and x["threads"] == threads and x.get("median_step_s")]
    rounds = sorted({x["round"] for x in mine})

    def med(side, variant, r, key="median_step_s"):
        got = [x[key] for x in mine if x["side"] == side and x["variant"] == variant and x["round"] == r]
        return got[0] if got else None

    def spread(values: list[float], name: str) -> dict:
        if not values:
            return {name: None}
        return {name: round(statistics.median(values), 3), f"{name}_min": round(min(values), 3),
                f"{name}_max": round(max(values), 3)}  # fmt: skip

    default = OURS_VARIANTS[kind][0]
    ratios, ratios_best, ratios_fp32, tps_ratios, best = [], [], [], [], {}
    per_variant: dict[str, list[float]] = {v: [] for v in OURS_VARIANTS[kind]}
    for r in rounds:
        trl = {v: med("trl", v, r) for v in TRL_VARIANTS[kind] if v in SAME_BATCHES and med("trl", v, r)}
        ours = {v: med("ours", v, r) for v in OURS_VARIANTS[kind] if med("ours", v, r)}
        if trl and ours:
            v = min(trl, key=trl.get)
            best[v] = best.get(v, 0) + 1
            if default in ours:
                ratios.append(trl[v] / ours[default])
            ratios_best.append(trl[v] / min(ours.values()))
            for o, t in ours.items():
                per_variant[o].append(trl[v] / t)
        trl32 = [t for v, t in trl.items() if v in FP32_VARIANTS]
        ours32 = [t for v, t in ours.items() if v in FP32_VARIANTS]
        if trl32 and ours32:
            ratios_fp32.append(min(trl32) / min(ours32))
        trl_tps = [med("trl", v, r, "tokens_per_s") for v in TRL_VARIANTS[kind] if med("trl", v, r, "tokens_per_s")]
        ours_tps = max([med("ours", v, r, "tokens_per_s") or 0 for v in OURS_VARIANTS[kind]])
        if trl_tps and ours_tps:
            tps_ratios.append(max(trl_tps) / ours_tps)
    medians = {
        f"{side}/{v}": statistics.median([x["median_step_s"] for x in mine if x["side"] == side and x["variant"] == v])
        for side in ("ours", "trl")
        for v in (OURS_VARIANTS if side == "ours" else TRL_VARIANTS)[kind]
        if any(x["side"] == side and x["variant"] == v for x in mine)
    }
    return {
        "kind": kind,
        "summary": True,
        "threads": threads,
        "rounds": len(rounds),
        "median_step_s": medians,
        "ratio": f"trl's best same-batch median step time / ours ({default}; _best: our best variant), per round",
        "trl_best": max(best, key=best.get) if best else None,
        **spread(ratios, "trl_over_ours"),
        **spread(ratios_best, "trl_over_ours_best"),
        **spread(ratios_fp32, "fp32_trl_over_ours"),
        "trl_best_over": {v: spread(x, "ratio") for v, x in per_variant.items() if x},
        "fp32_variants": sorted(FP32_VARIANTS & {*OURS_VARIANTS[kind], *TRL_VARIANTS[kind]}),
        "tokens_per_s_trl_best_over_ours_best": round(statistics.median(tps_ratios), 3) if tps_ratios else None,
    }


def skipped_lines(kinds: list[str]) -> list[dict]:
    import importlib.util

    out = []
    if "sft" in kinds:
        out.append(
            {
                "kind": "sft",
                "side": "trl",
                "variant": "packing_wrapped",
                "skipped": "packing without padding-free (packing_strategy: wrapped) cuts sequences at row ends and "
                "lets packed sequences attend to each other (all-ones attention mask, positions not restarted): "
                "another training objective, not a faster way to the same one",
            }
        )
    if "opd" in kinds:
        why = "vllm is not installed in this environment" if importlib.util.find_spec("vllm") is None else None
        out.append(
            {
                "kind": "opd",
                "side": "trl",
                "variant": "on_policy_vllm",
                "skipped": "; ".join(
                    x
                    for x in (
                        why,
                        "TRL's vLLM server mode syncs the student's weights over NCCL (CUDA only); colocate mode runs "
                        "vLLM inside the trainer's process, which needs a vllm build in trl's environment (the "
                        "project's CPU vLLM lives in .venv-vllm, without trl)",
                    )
                    if x
                ),
            }
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=None, help="models dir (default: the params' paths.models_dir)")
    p.add_argument("--teacher-rows", type=Path, default=None, help="default: the params' teacher_dir/train.jsonl")
    p.add_argument("--kinds", nargs="+", choices=["sft", "opd"], default=["sft", "opd"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="optimiser steps per run (step 0 is warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="OPD rollouts")
    p.add_argument("--no-memory", action="store_true", help="skip the profiled memory step")
    p.add_argument(
        "--opd-variants",
        nargs="+",
        choices=[*OPD_SETTINGS, *TRL_VARIANTS["opd"]],
        default=None,
        help="run only these OPD variants (default: all of both sides')",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 1 thread, 1 round, 2 steps, batch 4, 16 new tokens")
    a = p.parse_args(argv)
    if a.opd_variants:
        OURS_VARIANTS["opd"] = tuple(v for v in OURS_VARIANTS["opd"] if v in a.opd_variants)
        TRL_VARIANTS["opd"] = tuple(v for v in TRL_VARIANTS["opd"] if v in a.opd_variants)
    if a.quick:
        a.threads, a.rounds, a.steps, a.max_new_tokens = [1], 1, 2, 16
    if a.steps < 2:
        p.error("--steps must be >= 2 (step 0 is warm-up)")
    try:
        import trl
    except ImportError:
        p.error("trl is not installed: `make trl` installs it into .venv (for benchmarks only)")
    sys.stdout = sys.stderr  # TRL's logger prints its logs: keep stdout for the JSON lines
    base = load_params(REPO / "params.yaml", sections=("paths",))
    models = (a.models or REPO / base.paths.models_dir).resolve()
    rows_file = (a.teacher_rows or REPO / base.paths.completions("train")).resolve()
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="peer-trl-work-") as tmp:
        work = Path(tmp)
        params = real_params(work, a.quick, a.max_new_tokens)
        link_inputs(work, params, models, rows_file)
        here = os.getcwd()
        os.chdir(work)
        try:
            ctx = init_worker("cpu", "gloo", threads=a.threads[0])
            tokenizer = load_tokenizer(params.paths.models_dir)
            rows, _ = train_rows(params.paths, "sft", params.control)  # what both stages read (control.fresh_rows)
            data = encode_sft_rows(tokenizer, rows, params.sft)  # as prepare_sft encodes them
            sft_order = step_order(params, "sft", len(data.prompts))
            prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
            kept = [i for i, q in enumerate(prompts) if len(q) <= params.opd.max_prompt_tokens]  # as prepare_opd keeps
            opd_order = step_order(params, "opd", len(kept))
            expected = {
                "sft": [tuple(data.prompts[i] + data.completions[i]) for i in sft_order],
                "opd": [tuple(prompts[kept[i]]) for i in opd_order],
            }
            messages = [[m for m in rows[kept[i]]["messages"] if m["role"] != "assistant"] for i in opd_order]
            meta = {
                "kind": "setup",
                "trl": trl.__version__,
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "models": str(models),
                "teacher_rows": str(rows_file),
                "sft": {
                    k: getattr(params.sft, k)
                    for k in (
                        "global_batch_size",
                        "micro_batch_size",
                        "lr",
                        "warmup_steps",
                        "steps",
                        "max_grad_norm",
                        "max_seq_len",
                        "max_completion_tokens",
                        "pack_length",
                    )
                },
                "opd": {
                    k: getattr(params.opd, k)
                    for k in (
                        "global_batch_size",
                        "micro_batch_size",
                        "lr",
                        "warmup_steps",
                        "steps",
                        "max_grad_norm",
                        "max_new_tokens",
                        "beta",
                        "temperature",
                        "sample_temperature",
                        "loss",
                        "rollouts",
                    )
                },
                "sft_rows": data.counts,
                "opd_prompts": len(kept),
                "steps": a.steps,
                "rounds": a.rounds,
                "threads": a.threads,
                "quick": a.quick,
                "note": "" if not a.quick else "quick: batch 4 (micro 2), 16 new tokens; figures are not the profile's",
            }
            emit(meta)
            for line in skipped_lines(a.kinds):
                emit(line)
            if "opd" in a.kinds:
                progress("opd: our step-0 rollouts scored by both losses")
                for line in opd_same_samples(ctx, params):
                    emit(line)
            for threads in a.threads:
                for rnd in range(a.rounds):
                    for kind in a.kinds:
                        ours_v, trl_v = list(OURS_VARIANTS[kind]), list(TRL_VARIANTS[kind])
                        sides = [("ours", v) for v in ours_v], [("trl", v) for v in trl_v]
                        first, second = sides if rnd % 2 == 0 else sides[::-1]
                        plan = (
                            [x for pair in zip(first, second) for x in pair]
                            + first[len(second) :]
                            + second[len(first) :]
                        )
                        measure = rnd == 0 and not a.no_memory
                        for side, variant in plan:
                            progress(f"{kind} {side}/{variant} threads {threads} round {rnd}")
                            try:
                                if side == "ours":
                                    got = run_ours(ctx, params, kind, variant, threads, a.steps, measure)
                                elif kind == "sft":
                                    got = run_trl_sft(params, variant, data, sft_order, threads, a.steps, measure)
                                else:
                                    got = run_trl_opd(params, variant, messages, threads, a.steps, measure)
                            except Exception as e:  # noqa: BLE001 - a variant that cannot run is a line, not a crash
                                traceback.print_exc()
                                emit(
                                    {
                                        "kind": kind,
                                        "side": side,
                                        "variant": variant,
                                        "threads": threads,
                                        "round": rnd,
                                        "error": f"{type(e).__name__}: {e}",
                                    }
                                )
                                continue
                            line = record(kind, side, variant, threads, rnd, got, expected[kind])
                            lines.append(line)
                            emit(line)
                        if kind == "sft":
                            ours = next(
                                (
                                    x
                                    for x in lines
                                    if x["kind"] == "sft"
                                    and x["side"] == "ours"
                                    and x["variant"] == "padded"
                                    and x["threads"] == threads
                                    and x["round"] == rnd
                                ),
                                None,
                            )
                            for trl_line in [
                                x
                                for x in lines
                                if x["kind"] == "sft"
                                and x["side"] == "trl"
                                and x["threads"] == threads
                                and x["round"] == rnd
                            ]:
                                if ours is not None and rnd == 0:
                                    emit(step0_check(ours, trl_line))
            for threads in a.threads:
                for kind in a.kinds:
                    emit(summary(kind, threads, lines))
        finally:
            os.chdir(here)
            shutdown_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main())
