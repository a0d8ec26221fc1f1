"""What every training stage's worker does around the engine: join the world, seed, train, publish.

``run_worker(job, prepare)`` is the body of one data-parallel worker of a training stage (``sft``,
``opd``, ``sft_continued``): join the process group, derive this rank's seeds from the stage seed and the seed scenario,
load the shared tokenizer, let the stage's ``prepare`` build the model and the task, train with
``ars_opd.training.loop.Trainer`` (resuming from a matching checkpoint), and on rank 0 write the stage's
outputs: the model directory (``paths.<stage>_model``, the only output later stages read) and the run
log directory (``paths.<stage>_log``: ``steps.jsonl`` and ``manifest.json``). ``launch_stage`` starts the
workers (``ars_opd.training.distributed.launch``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ars_opd.artifacts import provenance, write_json
from ars_opd.config import (
    TRAINING_STAGES,
    AdapterConfig,
    ControlConfig,
    OPDConfig,
    ParallelConfig,
    Params,
    PathsConfig,
    SFTConfig,
    TeachersConfig,
    TrainLoopConfig,
    to_dict,
)
from ars_opd.lm.attention import packed_attention_implementation
from ars_opd.lm.opd_objectives import check_config
from ars_opd.lm.precision import resolve_device
from ars_opd.models.adapters import (
    adapter_of,
    attach,
    check_adapter,
    is_adapted,
    resume,
    save_trained,
    trainable_parameters,
)
from ars_opd.models.loading import PinnedModels, load_model_dir, sha256_of_files
from ars_opd.seeding import derive_seed, scenario_seeds, set_seeds
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.budget import SNAPSHOTS, read_budget, write_budget
from ars_opd.training.checkpoint import config_fingerprint, layout_free
from ars_opd.training.distributed import WorkerContext, init_worker, launch, shutdown_worker
from ars_opd.training.faults import Fault
from ars_opd.training.loop import Trainer
from ars_opd.training.snapshots import snapshot_dir
from ars_opd.training.task import RunHooks, RunIdentity, TrainingTask

if TYPE_CHECKING:  # the HTTP client is imported only by a run that scores or samples through an endpoint
    from ars_opd.rollouts.engines import RolloutEndpoint
    from ars_opd.teacher.client.endpoint import ClientSettings


# What a resume may change: keys of the fingerprinted configuration (the stage's section and ddp) that cannot
# change a number the run computes. Where the run's servers are (an engine's or a scoring endpoint's address,
# the key's variable, the directory versions go through), how long it waits for them, how many requests it
# keeps in flight, how often it retries, which cores and how much of a GPU's memory a started vLLM takes, how
# the engine's version check decides (it stops a run or logs, so a run it stopped may resume under another
# verdict). Fingerprinted, each made a resume against a restarted engine on another port, or with a longer
# timeout, start over at step 0, and its first save delete the checkpoints it could have resumed
# (ars_opd.training.checkpoint.superseded).
RESUMABLE_KEYS = (
    "ddp.timeout_s",
    "opd.engine.sync_dir",
    "opd.engine.concurrency",
    "opd.engine.request_timeout_s",
    "opd.engine.max_attempts",
    "opd.engine.cpus",
    "opd.engine.gpu_memory_utilization",
    "opd.engine.startup_timeout_s",
    "opd.engine.probe_calibration",
    "opd.engine.probe_margin",
    "opd.engine.indistinguishable",
    "opd.engine.fingerprint",
    "opd.engine.dlogp_check",
    "opd.engine.bundled.startup_timeout_s",
    "opd.teacher_endpoint.api_key_env",
    "opd.teacher_endpoint.concurrency",
    "opd.teacher_endpoint.request_timeout_s",
    "opd.teacher_endpoint.max_attempts",
    "opd.teacher_endpoint.backoff_base_s",
    "opd.teacher_endpoint.backoff_max_s",
    "opd.teacher_server.startup_timeout_s",
)
# Addresses, fingerprinted by their kind alone: a server the stage starts is named as such (bundled and vllm are
# other engines, so other numbers); any URL is "url", so a restarted server on another port is the same run.
ADDRESS_KINDS = {"opd.engine.server": ("bundled", "vllm"), "opd.teacher_endpoint.endpoint": ("local",)}


def resumable_view(config: dict) -> dict:
    """``config`` (the fingerprinted configuration, in plain form) as the checkpoint fingerprint takes it:
    without ``RESUMABLE_KEYS``, each address of ``ADDRESS_KINDS`` as its kind."""
    out = copy.deepcopy(config)

    def parent(key: str) -> tuple[dict | None, str]:
        *path, leaf = key.split(".")
        node = out
        for name in path:
            node = node.get(name) if isinstance(node, dict) else None
        return (node if isinstance(node, dict) else None), leaf

    for key in RESUMABLE_KEYS:
        node, leaf = parent(key)
        if node is not None:
            node.pop(leaf, None)
    for key, started in ADDRESS_KINDS.items():
        node, leaf = parent(key)
        if node is not None and leaf in node and node[leaf] not in started:
            node[leaf] = "url"
    return out


def continued_sft_config(sft: SFTConfig, opd: OPDConfig) -> SFTConfig:
    """OPD's optimisation loop (steps, batch, learning-rate schedule, clipping, checkpoints) with SFT's data
    budgets: the control arm differs from OPD in its objective and data alone."""
    loop = {f.name: getattr(opd, f.name) for f in dataclasses.fields(TrainLoopConfig)}
    own = {f.name: getattr(sft, f.name) for f in dataclasses.fields(SFTConfig) if f.name not in loop}
    return SFTConfig(**loop, **own)


@dataclass(frozen=True)
class ScoringEndpoint:
    """A served teacher as this run reaches it: the resolved base URL, the model name it serves, and the
    client settings (the endpoint params and the API key, read once before any worker starts). Run-time only:
    a bundled server's port changes every run, so it stays out of the checkpoint fingerprint."""

    url: str
    model: str
    settings: ClientSettings


@dataclass(frozen=True)
class TrainingJob:
    """Everything a worker needs (picklable: crosses into spawned processes). A stage builds it once from its
    params (``from_params``); the stage's ``run_*`` checks it once (``check``) before any worker starts."""

    stage: str  # one of TRAINING_STAGES: names the params section and the paths
    cfg: TrainLoopConfig
    ddp: ParallelConfig  # ddp.seed is the training seed
    paths: PathsConfig
    trust_remote_code: bool = False  # models.trust_remote_code: passed to every load of the student (and teacher)
    progress: bool = True
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """``models.student_adapter``: train the whole student (kind null) or a LoRA adapter on it."""
    control: ControlConfig = field(default_factory=ControlConfig)
    """``control``: train rows held back from sft and opd, and whether the control arm trains on them."""
    scoring: ScoringEndpoint | None = None
    rollout_engine: RolloutEndpoint | None = None
    """OPD with ``opd.rollouts: engine``: the engine that samples, resolved by ``run_opd`` for the stage's
    duration; outside the checkpoint fingerprint like ``scoring``."""
    """OPD with ``opd.teacher: endpoint``: the endpoint, resolved by ``run_opd`` for the stage's duration.
    Outside the checkpoint fingerprint (``run_worker`` fingerprints cfg, ddp, adapter and the data), so a
    rerun against another port still resumes."""
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    """``teachers``: OPD with several teachers scores each rollout with its prompt's own
    (``ars_opd.training.teacher_route``); none named: the one teacher, as always."""
    teacher_endpoints: dict[str, ScoringEndpoint] | None = None
    """The endpoint teachers of several, by name, with their client settings (the API keys read once by
    ``run_opd``); run-time only, like ``scoring``."""

    @classmethod
    def from_params(cls, stage: str, params: Params, progress: bool = True) -> TrainingJob:
        """The job of training stage ``stage`` from the parsed params (sections paths, models, ddp, control
        and the stage's own: sft, opd, or both for sft_continued, which runs OPD's loop on SFT's data)."""
        if stage not in TRAINING_STAGES:
            raise ValueError(f"not a training stage: {stage!r} (one of {TRAINING_STAGES})")
        cfg = continued_sft_config(params.sft, params.opd) if stage == "sft_continued" else getattr(params, stage)
        models = params.models
        return cls(
            stage,
            cfg,
            params.ddp,
            params.paths,
            trust_remote_code=models.trust_remote_code if models is not None else False,
            progress=progress,
            adapter=models.student_adapter if models is not None else AdapterConfig(),
            control=params.control if params.control is not None else ControlConfig(),
            teachers=params.teachers if params.teachers is not None else TeachersConfig(),
        )

    def check(self) -> None:
        """Refuse, before any worker starts, what the workers could not train: an OPD loss the rollouts cannot
        serve (``load_params`` refuses it too, before torch is imported; this covers jobs built in code), a
        packed attention this machine has not, an adapter that would not wrap the student."""
        if self.stage == "opd":
            check_config(self.cfg)
        if getattr(self.cfg, "packing", False):
            packed_attention_implementation(self.cfg.packed_attention, resolve_device(self.ddp.device))
        check_adapter(self.adapter, self.paths.models_dir, self.trust_remote_code)


@dataclass
class WorkerSetup:
    """This rank's view of the stage, handed to the stage's ``prepare``."""

    ctx: WorkerContext
    tokenizer: Any
    geometry: BatchGeometry
    sampler_seed: int  # this rank's data-order seed under the scenario
    stage_seed: int  # the stage's seed, the same on every rank (e.g. for GKD draws)
    fault: Fault | None  # the injected fault as this rank sees it (a no-op unless ddp.inject names this stage)
    sampler_seeds: tuple[int, ...] = ()  # every rank's data-order seed, by rank (the world's draws of a step)
    rng_seed: int | None = None
    """This rank's RNG seed under the scenario (Python's and torch's generators: the trainer's rollouts sample with
    it; so do the engine's requests). None: ``sampler_seed``, which it equals in every scenario."""
    models: PinnedModels | None = None
    """The models stage's output, opened once for this worker by ``run_worker`` (``tokenizer`` is its student
    tokenizer) and handed down; None in a setup built in code, which then opens it from the job's paths."""

    def __post_init__(self):
        if self.rng_seed is None:
            self.rng_seed = self.sampler_seed


@dataclass
class PreparedRun:
    """What the stage's ``prepare`` returns: the model to train (on ``ctx.device``) and its task."""

    model: torch.nn.Module
    task: TrainingTask
    fingerprint: dict  # the run's inputs (starting weights, data hashes): a checkpoint resumes only if they match
    data_counts: dict  # rows kept and dropped, for the manifest
    manifest: dict = field(default_factory=dict)  # more manifest entries
    on_step: Callable[[int], dict] | None = None  # extra per-step log columns
    budget_start: dict = field(default_factory=dict)  # the starting model's budget (ars_opd.training.budget)
    close: Callable[[], None] | None = None
    """Releases what the run holds outside this process (OPD's rollout engine: its thread, the NCCL group and
    the engine's weight-transfer side); ``run_worker`` calls it on every way out of the run."""


@dataclass
class StartingStudent:
    model: torch.nn.Module  # on the device; adapted if the job trains an adapter
    init: str  # what it starts from: the base student's revision, or the sha256 of the starting directory
    budget: dict  # the budget already spent on it (ars_opd.training.budget)
    adapter: str  # "none", "fresh" or "continued" (from the starting directory's adapter)


def starting_student(job: TrainingJob, device: torch.device, models: PinnedModels) -> StartingStudent:
    """The student a training stage starts from. ``sft`` starts from the models stage's base student; the
    stages after it (opd, sft_continued) from ``paths.distill_init``, the SFT stage's output. With an adapter:
    a fresh one on the base student (sft), the published one continued on that same base student (when
    ``distill_init`` holds one), or a fresh one on the fully fine-tuned SFT student (when it holds none).
    ``models``: the models stage's output, opened once (``WorkerSetup.models``)."""
    base_revision = models.revision("student")
    if job.stage == "sft":
        model = models.load("student")
        init, budget = base_revision, {}
        published = None
    else:
        start = Path(job.paths.distill_init)
        model = load_model_dir(start, "cpu", stage="sft", trust_remote_code=job.trust_remote_code)
        init, budget = sha256_of_files(start), read_budget(start)
        published = adapter_of(start)
    how = "none"
    if job.adapter.enabled and published is not None:
        model = resume(models.load("student"), published, base_revision)
        how = "continued"
    elif job.adapter.enabled:
        model = attach(model, job.adapter)
        how = "fresh"
    # sharded: the whole student stays on the CPU until fully_shard has cut it (the engine moves the shards)
    return StartingStudent(model.to("cpu" if job.ddp.strategy == "fsdp" else device), init, budget, how)


def run_worker(job: TrainingJob, prepare: Callable[[TrainingJob, WorkerSetup], PreparedRun]) -> dict:
    ctx = init_worker(job.ddp.device, job.ddp.backend, job.ddp.threads_per_worker, job.ddp.timeout_s)
    with contextlib.ExitStack() as stack:
        stack.callback(shutdown_worker)  # last: after what the run holds is released
        stage_seed = derive_seed(job.ddp.seed, job.stage)
        sampler_seed, rng_seed = scenario_seeds(job.ddp.scenario, stage_seed, ctx.rank)
        set_seeds(rng_seed)
        geometry = BatchGeometry.check(job.cfg.global_batch_size, ctx.world_size, job.cfg.micro_batch_size, job.stage)
        models = PinnedModels(job.paths.models_dir, job.trust_remote_code)  # opened once, handed down
        tokenizer = models.tokenizer
        fault = Fault(job.ddp.inject, job.stage, ctx.rank, stage_seed)
        seeds = tuple(scenario_seeds(job.ddp.scenario, stage_seed, r)[0] for r in range(ctx.world_size))
        setup = WorkerSetup(ctx, tokenizer, geometry, sampler_seed, stage_seed, fault, seeds, rng_seed, models)
        run = prepare(job, setup)
        if run.close is not None:
            stack.push(_closing(run.close))
        run.model.train()
        out = job.paths.training(job.stage)
        # the job's configuration in plain form, once: the fingerprints and the manifest read it
        cfg, ddp_all, adapter_cfg = to_dict(job.cfg), to_dict(job.ddp), to_dict(job.adapter)
        adapter = {"adapter": adapter_cfg} if job.adapter.enabled else {}
        ddp = {k: v for k, v in ddp_all.items() if k != "reshard_resume"}
        run_config = {job.stage: cfg, "ddp": ddp, **adapter, **run.fingerprint}
        fingerprint = config_fingerprint(resumable_view(run_config))
        # what a resharded resume must match: the same run in any worker layout (ars_opd.training.checkpoint)
        layout = config_fingerprint(resumable_view({**run_config, "ddp": layout_free(ddp)}))
        trainer = Trainer.build(ctx, run.model, run.task, job.cfg, job.ddp, RunHooks(run.on_step, fault, job.progress))
        state, log, totals, trained = trainer.fit(out, RunIdentity(fingerprint, layout, run.budget_start))
        # the wrapped model (DDP's reducer, FSDP's hooks) must go while the process group lives: destroyed after
        # shutdown_worker, a rank's teardown can block for good (seen in CI once the trainer outlived the loop)
        del trainer
        gc.collect()
        if ctx.is_main:
            shutil.rmtree(Path(out.model) / "adapter", ignore_errors=True)  # a previous run's adapter
            save_trained(trained, Path(out.model), models.revision("student"))
            tokenizer.save_pretrained(Path(out.model))
            write_budget(out.model, totals, trainable_parameters(run.model))
            snapshots = snapshot_dir(Path(out.checkpoints), fingerprint)
            kept = Path(out.model) / SNAPSHOTS
            shutil.rmtree(kept, ignore_errors=True)  # a previous run's snapshots (outside dvc) are not this run's
            if job.cfg.snapshot_every and snapshots.is_dir():
                shutil.copytree(snapshots, kept)
            write_json(
                out.manifest,
                {
                    "data": run.data_counts,
                    "workers": ctx.world_size,
                    "geometry": dataclasses.asdict(geometry),
                    "resumed_from": state.resumed_from,
                    "resharded_from": state.resharded_from,
                    "steps": state.step,
                    "inputs": run.fingerprint,
                    "strategy": job.ddp.strategy,
                    "trainable_parameters": trainable_parameters(run.model),
                    "parameters": sum(p.numel() for p in {id(p): p for p in run.model.parameters()}.values()),
                    "adapter": adapter_cfg if is_adapted(run.model) else None,
                    **run.manifest,
                    **provenance({job.stage: cfg, "ddp": ddp_all}),
                },
            )
        return {
            "steps": state.step,
            "data": run.data_counts,
            "resumed_from": state.resumed_from,
            "final_loss": log[-1]["loss"] if log else None,
        }


def _closing(close: Callable[[], None]):
    """An exit callback that releases what a run holds, on every way out of it (a return, an error, Ctrl-C).
    After an error its own failure is printed, not raised: the error that ended the run is the one to report."""

    def exit_(kind, error, traceback) -> bool:
        if kind is None:
            close()
            return False
        try:
            close()
        except Exception as e:  # noqa: BLE001 - the run's own error propagates
            print(f"releasing the run after {kind.__name__} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return False

    return exit_


def launch_stage(worker: Callable[[TrainingJob], dict], job: TrainingJob) -> dict:
    """Start ``job.ddp.workers`` processes running ``worker(job)`` (or run here under an outside launcher)."""
    return launch(worker, job, job.ddp.workers, job.ddp.threads_per_worker)
