"""OPD's several teachers (``teachers.named``), built in each worker and, for the served ones, checked first.

Once per stage, before any worker starts (``run_opd``), ``routed_endpoints`` reads each endpoint teacher's API key
(``teachers.named[i].endpoint.api_key_env``) and checks the endpoint as ``opd.teacher: endpoint`` is checked
(``opd_teacher_setup.check_scoring_endpoint``'s checks: it answers, serves the model, tokenises a probe as the
student does, returns log-probabilities for the run's k); the resolved endpoints ride to the workers on the job
(``TrainingJob.teacher_endpoints``), outside the checkpoint fingerprint.

In each worker ``build_routed_teacher`` makes the ``RoutedTeacher`` (``ars_opd.training.teacher_route``): every
teacher with weights loaded once (after its pin is checked and its tokenizer compared with the student's, and in
``opd.teacher_dtype``), every endpoint teacher a client of its own; each teacher's parameter count for the budget
(a served one's from ``parameters``, else the models stage's teacher's, as ``opd.teacher: endpoint`` counts it).
"""

from __future__ import annotations

import asyncio

from ars_opd.config import OPDConfig, TeachersConfig
from ars_opd.lm.precision import frozen_model_dtype
from ars_opd.models.loading import PinnedModels, load_tokenizer
from ars_opd.models.teachers import Route, check_pinned, manifest_summary, teacher_path
from ars_opd.models.tokenizer import check_shared_tokenizer
from ars_opd.teacher.client.endpoint import ClientSettings, api_key, make_client, preflight
from ars_opd.teacher.client.score import check_tokenizer
from ars_opd.training.budget import matmul_parameters
from ars_opd.training.opd.teacher_route import RoutedTeacher
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.worker import ScoringEndpoint, TrainingJob, WorkerSetup


def _section(i: int) -> str:
    return f"teachers.named[{i}].endpoint"


def routed_endpoints(
    teachers: TeachersConfig, cfg: OPDConfig, models_dir: str, trust_remote_code: bool
) -> dict[str, ScoringEndpoint]:
    """Each endpoint teacher resolved (its key read here, once) and checked before step 0, by name."""
    out: dict[str, ScoringEndpoint] = {}
    tokenizer = None
    for i, t in enumerate(teachers.named):
        if not t.is_endpoint:
            continue
        ep = t.endpoint
        settings = ClientSettings(ep.endpoint, api_key(ep.api_key_env, _section(i)), ep)
        out[t.name] = ScoringEndpoint(ep.endpoint, ep.model, settings)
        tokenizer = tokenizer or load_tokenizer(models_dir, trust_remote_code)
        asyncio.run(_check(out[t.name], cfg, tokenizer, _section(i)))
    return out


async def _check(endpoint: ScoringEndpoint, cfg: OPDConfig, tokenizer, section: str) -> None:
    client = make_client(endpoint.settings)
    try:
        await preflight(client, endpoint.model, min(15.0, endpoint.settings.limits.request_timeout_s), section)
        await check_tokenizer(
            client, endpoint.model, tokenizer, endpoint.settings, section, k=cfg.topk if cfg.loss == "topk" else 1
        )
    finally:
        await client.close()


def build_routed_teacher(
    job: TrainingJob, setup: WorkerSetup, vocab: int, models: PinnedModels
) -> tuple[RoutedTeacher, dict]:
    """(this worker's routed teacher, manifest entries); ``models``: the models stage's output, opened once
    (``WorkerSetup.models``): its manifest names the teachers, each pin checked as the teacher's is."""
    cfg, teachers = job.cfg, job.teachers
    entries = check_pinned(models.root, teachers)
    dtype = frozen_model_dtype(cfg.teacher_dtype, setup.ctx.device)
    members, parameters = [], []
    for t in teachers.named:
        if t.is_endpoint:
            endpoint = (job.teacher_endpoints or {}).get(t.name)
            if endpoint is None:
                raise ValueError(f"teacher {t.name} is an endpoint, but the job carries none (run_opd resolves it)")
            members.append(EndpointTeacher(endpoint.settings, endpoint.model, vocab, cfg.topk))
            parameters.append(t.parameters or _models_stage_teacher_parameters(models))
            continue
        model = _load(teacher_path(models.root, t.name, entries[t.name]), dtype, models.trust_remote_code, setup)
        rows_out = model.get_output_embeddings().weight.shape[0]
        if rows_out < vocab:
            raise ValueError(f"teacher {t.name} has {rows_out} output rows but the tokenizer {vocab} ids")
        members.append(LocalTeacher(model.to(setup.ctx.device), vocab, cfg.chunk_size, cfg.topk))
        parameters.append(matmul_parameters(model))
    names = Route(teachers).names
    manifest = {
        "teacher": "routed",
        "teacher_dtype": str(dtype).removeprefix("torch."),
        "teachers": manifest_summary(entries),
        "route": {"route_by": teachers.route_by, "route": dict(teachers.route), "default": teachers.default},
        "teacher_parameters": dict(zip(names, parameters)),
    }
    return RoutedTeacher(names, members, parameters, vocab), manifest


def _models_stage_teacher_parameters(models: PinnedModels) -> int:
    """The models-stage teacher's matmul parameters from its config alone (no weights read): what an endpoint
    teacher without ``parameters`` is counted as, the rule ``opd.teacher: endpoint`` follows."""
    import torch
    from transformers import AutoModelForCausalLM

    config = models.config("teacher")
    with torch.device("meta"):
        return matmul_parameters(AutoModelForCausalLM.from_config(config, trust_remote_code=models.trust_remote_code))


def _load(directory: str, dtype, trust_remote_code: bool, setup: WorkerSetup):
    """A teacher's weights from its pinned directory, after checking its tokenizer is the student's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    check_shared_tokenizer(tokenizer, setup.tokenizer)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, trust_remote_code=trust_remote_code)
