"""The teacher an OPD run scores with: built in each worker, and behind an endpoint, started and checked first.

``build_teacher`` gives a worker its teacher (``ars_opd.training.opd.teachers``) for ``opd.teacher``:
``local`` loads the pinned teacher into the worker (after checking that it shares the student's tokenizer
and covers its vocabulary); ``endpoint`` makes a client of the scoring endpoint, and counts the teacher's
parameters for the budget from its config alone, so the trainer never loads teacher weights.

Once per stage, before any worker starts (``run_opd``), ``scoring_endpoint`` resolves the endpoint: the
configured URL, or ``local``, the bundled server started for the pinned teacher for the stage's duration;
``check_scoring_endpoint`` then refuses one that does not answer, does not serve the model, tokenizes
otherwise than the student, or returns anything but log-probabilities for the run's k. The resolved
endpoint (``ScoringEndpoint``: URL, model, client settings) rides to the workers on the job.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ars_opd.config import OPDConfig, PathsConfig
from ars_opd.lm.precision import frozen_model_dtype
from ars_opd.models.loading import PinnedModels, model_path
from ars_opd.models.tokenizer import check_shared_tokenizer
from ars_opd.serving.local_server import LOCAL_MODEL_NAME, local_server
from ars_opd.teacher.client.endpoint import ClientSettings, api_key, make_client, preflight
from ars_opd.teacher.client.score import check_tokenizer
from ars_opd.training.budget import matmul_parameters
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.worker import ScoringEndpoint, TrainingJob, WorkerSetup

ENDPOINT_SECTION = "opd.teacher_endpoint"


def _teacher_params_from_config(models: PinnedModels) -> int:
    """The models-stage teacher's parameter count from its config alone (meta tensors, no weights read)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return matmul_parameters(
            AutoModelForCausalLM.from_config(models.config("teacher"), trust_remote_code=models.trust_remote_code)
        )


def build_teacher(
    job: TrainingJob, setup: WorkerSetup, vocab: int, models: PinnedModels
) -> tuple[LocalTeacher | EndpointTeacher, int, dict]:
    """(the teacher that scores this worker's rollouts, its parameter count for the budget, manifest entries);
    ``models``: the models stage's output, opened once (``WorkerSetup.models``)."""
    ctx, cfg = setup.ctx, job.cfg
    if cfg.teacher == "endpoint":  # no teacher weights in the trainer, only the count from the teacher's config
        endpoint = job.scoring
        if endpoint is None:
            raise ValueError("opd.teacher: endpoint, but the job carries no scoring endpoint (run_opd resolves it)")
        if cfg.cross_tokenizer:
            vocab = len(models.teacher_tokenizer)
        teacher = EndpointTeacher(endpoint.settings, endpoint.model, vocab, cfg.topk)
        return (
            teacher,
            _teacher_params_from_config(models),
            {
                "teacher": "endpoint",
                "teacher_model": endpoint.model,
                "teacher_endpoint": "local" if cfg.teacher_endpoint.endpoint == "local" else endpoint.url,
            },
        )
    from transformers import AutoTokenizer

    if cfg.cross_tokenizer:  # the teacher keeps its own vocabulary: its head covers its own tokenizer
        vocab = len(models.teacher_tokenizer)
    else:  # the tokenizer that ships with the teacher's files, against the student's
        check_shared_tokenizer(
            AutoTokenizer.from_pretrained(models.path("teacher"), trust_remote_code=models.trust_remote_code),
            setup.tokenizer,
        )
    teacher_dtype = frozen_model_dtype(cfg.teacher_dtype, ctx.device)
    model = models.load("teacher", dtype=teacher_dtype).to(ctx.device)
    rows_out = model.get_output_embeddings().weight.shape[0]
    if rows_out < vocab:
        raise ValueError(f"the teacher has {rows_out} output rows but the tokenizer {vocab} ids")
    return (
        LocalTeacher(model, vocab, cfg.chunk_size, cfg.topk),
        matmul_parameters(model),
        {"teacher": "local", "teacher_dtype": str(teacher_dtype).removeprefix("torch.")},
    )


@contextlib.contextmanager
def scoring_endpoint(cfg: OPDConfig, paths: PathsConfig) -> Iterator[ScoringEndpoint]:
    """The scoring endpoint for the stage's duration, with its client settings (the API key read here, once);
    'local' starts the bundled server for the pinned teacher."""
    ep = cfg.teacher_endpoint
    key = api_key(ep.api_key_env, ENDPOINT_SECTION)
    if ep.endpoint != "local":
        yield ScoringEndpoint(ep.endpoint, ep.model, ClientSettings(ep.endpoint, key, ep))
        return
    with local_server(
        model_path(paths.models_dir, "teacher"), cfg.teacher_server, max_logprobs=max(cfg.topk, 1)
    ) as url:
        yield ScoringEndpoint(url, LOCAL_MODEL_NAME, ClientSettings(url, key, ep))


def check_scoring_endpoint(endpoint: ScoringEndpoint, job: TrainingJob) -> None:
    """Before step 0: the endpoint answers, serves its model, tokenizes as the student does, and returns
    log-probabilities (not logits) for a probe scored with the run's k (so ``--max-logprobs`` is checked too)."""
    import asyncio

    cfg, settings, model = job.cfg, endpoint.settings, endpoint.model

    async def check() -> None:
        client = make_client(settings)
        try:
            await preflight(client, model, min(15.0, cfg.teacher_endpoint.request_timeout_s), ENDPOINT_SECTION)
            await check_tokenizer(  # the teacher's own tokenizer (the student's unless opd.cross_tokenizer)
                client,
                model,
                PinnedModels(job.paths.models_dir, job.trust_remote_code).teacher_tokenizer,
                settings,
                ENDPOINT_SECTION,
                k=cfg.topk if cfg.loss == "topk" else 1,
            )
        finally:
            await client.close()

    asyncio.run(check())
