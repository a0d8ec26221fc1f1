"""The opd stage: check the job, start the workers, and in each worker prepare the run (the student, the teacher,
the rows, the rollout engine's side) that the shared training engine distils.

``run_opd`` is the stage's entry (``stages/opd.py``); ``prepare_opd`` is what each worker runs before step 0
(``ars_opd.training.worker.run_worker``): it opens the models stage's output once (``PinnedModels``, handed to it
on ``WorkerSetup``) and passes it down to the student, the teacher and the cross-tokenizer alignment.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ars_opd.lm.batching import (
    pad_token_id,
)
from ars_opd.lm.generation import eos_token_ids
from ars_opd.lm.head import OutputHead
from ars_opd.lm.token_alignment import CrossTokenizer, teacher_end_id
from ars_opd.models.loading import PinnedModels
from ars_opd.models.teachers import Route, check_recorded
from ars_opd.rollouts.schedule import (
    EngineRollouts,
)
from ars_opd.rollouts.stage import WorkerPlace, stage_engine, worker_rollouts
from ars_opd.training.budget import matmul_parameters
from ars_opd.training.opd.cross_teacher import CrossTokenizerTeacher, TeacherSide, max_positions
from ars_opd.training.opd.data import OPDData, encode_rows
from ars_opd.training.opd.task import ModelSizes, OPDTask, RolloutSetup
from ars_opd.training.opd.teacher_route_setup import build_routed_teacher, routed_endpoints
from ars_opd.training.opd.teacher_setup import build_teacher, check_scoring_endpoint, scoring_endpoint
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.train_rows import train_rows
from ars_opd.training.worker import PreparedRun, TrainingJob, WorkerSetup, launch_stage, run_worker, starting_student


def prepare_opd(job: TrainingJob, setup: WorkerSetup) -> PreparedRun:
    ctx, tokenizer = setup.ctx, setup.tokenizer
    models = setup.models or PinnedModels(job.paths.models_dir, job.trust_remote_code)  # opened once, passed down
    vocab = len(tokenizer)
    student = starting_student(job, ctx.device, models)
    model = student.model
    rows_out = model.get_output_embeddings().weight.shape[0]
    if rows_out < vocab:
        raise ValueError(f"the student has {rows_out} output rows but the tokenizer {vocab} ids")
    rows, identity = train_rows(job.paths, job.stage, job.control)
    route = None
    if job.teachers.active:  # several teachers: each row's own (refused before any work if one has none)
        where = job.paths.completions("train")
        route = Route(job.teachers).indices(rows, where)
        if job.cfg.on_policy_fraction < 1 or job.cfg.anchor != "none":  # the teacher's text must be its own
            check_recorded(rows, Route(job.teachers).assign(rows, where), where)
        teacher, teacher_manifest = build_routed_teacher(job, setup, vocab, models)
        teacher_params = max(teacher.parameters)  # the budget charges each row's own (forward_flops)
    else:
        teacher, teacher_params, teacher_manifest = build_teacher(job, setup, vocab, models)
    teacher_tokenizer = None
    if job.cfg.cross_tokenizer:
        teacher_tokenizer = models.teacher_tokenizer
    positions = max_positions(teacher.model) if isinstance(teacher, LocalTeacher) else None
    data = encode_rows(tokenizer, rows, job.cfg, teacher_tokenizer, positions, route)
    if not data.prompts:
        raise ValueError(f"no OPD prompts left after the budget: {data.counts}")
    eos_ids = eos_token_ids(model, tokenizer)
    if teacher_tokenizer is not None:
        cross = CrossTokenizer(tokenizer, teacher_tokenizer, eos_ids, teacher_end_id(teacher_tokenizer))
        teacher = cross_tokenizer_teacher(teacher, cross, data, vocab, job.cfg.chunk_size)
        teacher_manifest["cross_tokenizer"] = {
            "loss": job.cfg.loss,
            "teacher_vocab": len(teacher_tokenizer),
            "student_vocab": vocab,
        }
    task = OPDTask(
        data,
        teacher,
        job.cfg,
        setup,
        sizes=ModelSizes(matmul_parameters(model), teacher_params, OutputHead.of(model, vocab).weight.numel()),
        rollouts=RolloutSetup(eos_ids, engine_rollouts(job, setup, eos_ids)),
    )
    fingerprint = {
        "init": student.init,
        "teacher": models.revision("teacher"),
        **identity,
    }
    if job.teachers.active:  # which teachers score which prompts: another route is another run
        fingerprint["teachers"] = {"pins": teacher_manifest["teachers"], "route": teacher_manifest["route"]}
    return PreparedRun(
        model,
        task,
        fingerprint,
        data.counts,
        manifest={"vocab": vocab, "adapter_start": student.adapter, **teacher_manifest},
        on_step=lambda s: {"gkd_source": task.source(s)},
        budget_start=student.budget,
        close=task.engine.close if task.engine is not None else None,
    )


def cross_tokenizer_teacher(
    teacher: LocalTeacher | EndpointTeacher, cross: CrossTokenizer, data: OPDData, vocab: int, chunk_size: int
) -> CrossTokenizerTeacher:
    """``teacher`` scoring the student's text in its own tokens (``ars_opd.training.opd.cross_teacher``)."""
    local = isinstance(teacher, LocalTeacher)
    side = TeacherSide(
        data.teacher_prompts,
        len(cross.teacher),
        pad_token_id(cross.teacher),
        max_positions(teacher.model) if local else None,
    )
    if local:
        return CrossTokenizerTeacher(cross, side, vocab, model=teacher.model, chunk_size=chunk_size)
    return CrossTokenizerTeacher(cross, side, vocab, endpoint=teacher, chunk_size=chunk_size)


def engine_rollouts(job: TrainingJob, setup: WorkerSetup, eos_ids: tuple[int, ...]) -> EngineRollouts | None:
    """This worker's side of the rollout engine that ``run_opd`` started or named (None: the worker samples). Its
    requests are seeded from the rank's seed under the seed scenario, as the trainer's rollouts are."""
    if job.cfg.rollouts != "engine":
        return None
    place = WorkerPlace(setup.ctx.rank, setup.ctx.world_size, setup.stage_seed, setup.rng_seed)
    return worker_rollouts(job.rollout_engine, job.cfg, place, eos_ids, len(setup.tokenizer))


def opd_worker(job: TrainingJob) -> dict:
    return run_worker(job, prepare_opd)


def run_opd(job: TrainingJob) -> dict:
    """The opd stage: check the job, start the workers, distil, write outputs. Returns rank 0's summary.

    With ``opd.teacher: endpoint`` the endpoint is checked (reachable, serving the model, same tokenizer)
    before any worker starts, and the bundled server (``teacher_endpoint.endpoint: local``) runs for the
    stage's duration; under an outside launcher every process does this for itself.
    """
    job.check()  # before any worker starts: e.g. a loss the rollouts cannot serve is a config error
    with contextlib.ExitStack() as stack:
        if job.cfg.rollouts == "engine":
            engine = stage_engine(job.cfg, job.paths.models_dir, job.paths.opd_checkpoints)
            job = dataclasses.replace(job, rollout_engine=stack.enter_context(engine))
        if job.teachers.active:  # several teachers: every prompt has one, the served ones answer, before any worker
            Route(job.teachers).assign(train_rows(job.paths, job.stage, job.control)[0], job.paths.completions("train"))
            endpoints = routed_endpoints(job.teachers, job.cfg, job.paths.models_dir, job.trust_remote_code)
            return launch_stage(opd_worker, dataclasses.replace(job, teacher_endpoints=endpoints))
        if job.cfg.teacher == "local":
            return launch_stage(opd_worker, job)
        endpoint = stack.enter_context(scoring_endpoint(job.cfg, job.paths))
        check_scoring_endpoint(endpoint, job)
        # the resolved endpoints are run-time only: a started server's port changes every run, and must not keep a
        # checkpoint from resuming (job.scoring and job.rollout_engine are outside the checkpoint fingerprint)
        return launch_stage(opd_worker, dataclasses.replace(job, scoring=endpoint))
