"""Whom teacher_gen asks: the one teacher, or each prompt's own teacher of several (``teachers.named``).

An ``Asker`` is one teacher as the stage reaches it: the model name and revision its requests' cache keys carry,
the server to start for it (or the URL it already has), the client limits (concurrency, timeout, retries) and the
API key. ``single_asker`` is the pipeline's one teacher (``teacher_gen.endpoint``: the bundled server for the
models-stage teacher, or a URL); ``routed_askers`` one per named teacher, from the models stage's pins: a teacher
with weights is served by the bundled server started for its pinned directory, under ``teacher_gen.server``'s
batching, its key's revision the pin (so two specialists never share an answer, and a teacher named ``teacher``
shares the one-teacher pipeline's cached answers); an endpoint teacher is asked at its URL with its own limits and
key, its key's model and revision its served name and ``revision``. Everything an asker needs is resolved here,
before any request: a missing key variable or a changed pin stops the stage before any work.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, ContextManager

from ars_opd.config import LOCAL_ENDPOINT, EndpointConfig, PathsConfig, TeacherGenConfig, TeachersConfig
from ars_opd.models.loading import model_path, read_manifest
from ars_opd.models.teachers import check_pinned, teacher_identity, teacher_path
from ars_opd.serving.local_server import LOCAL_MODEL_NAME, local_server
from ars_opd.teacher.client import endpoint
from ars_opd.teacher.client.chat import AskSummary


@dataclass(frozen=True)
class Asker:
    """One teacher as teacher_gen asks it (see the module docstring)."""

    name: str | None  # the named teacher (None: the pipeline's one teacher)
    model: str
    revision: str | None
    server: Callable[[], ContextManager[str]]  # enters the server (or none) and yields its base URL
    limits: EndpointConfig
    api_key: str = "EMPTY"
    endpoint: str = LOCAL_ENDPOINT  # what the manifest records of where it answered


def bundled_server(cfg: TeacherGenConfig, model_dir: str, log_requests: str | None = None):
    """The bundled server as ``endpoint: local`` starts it for ``model_dir`` (a context manager yielding its base
    URL): ``teacher_gen.server``'s batching and threads, and pushback past ``server.max_queue_fraction`` of
    this client's ``request_timeout_s``."""
    return local_server(model_dir, cfg.server, log_requests=log_requests, request_timeout_s=cfg.request_timeout_s)


def single_asker(
    cfg: TeacherGenConfig,
    paths: PathsConfig,
    api_key: str,
    log_requests: str | None = None,
    check_tokenizer: Callable[[str, str], None] | None = None,
) -> Asker:
    """The pipeline's one teacher: the bundled server for the models-stage teacher (its revision the pin, which
    ``model_path`` verifies), or ``teacher_gen.endpoint``'s URL with ``teacher_gen.model``/``model_revision``.
    ``check_tokenizer(models_dir, teacher_dir)``: run on the served directory before anything starts."""
    if cfg.endpoint != LOCAL_ENDPOINT:
        return Asker(
            None,
            cfg.model,
            cfg.model_revision,
            lambda: contextlib.nullcontext(cfg.endpoint),
            cfg,
            api_key,
            cfg.endpoint,
        )
    revision = read_manifest(paths.models_dir)["teacher"]["revision"]
    teacher_dir = model_path(paths.models_dir, "teacher")
    if check_tokenizer is not None:
        check_tokenizer(paths.models_dir, teacher_dir)
    return Asker(None, LOCAL_MODEL_NAME, revision, lambda: bundled_server(cfg, teacher_dir, log_requests), cfg, api_key)


def routed_askers(
    cfg: TeacherGenConfig,
    paths: PathsConfig,
    teachers: TeachersConfig,
    error: type[endpoint.MissingAPIKeyError] = endpoint.MissingAPIKeyError,
    log_requests: str | None = None,
) -> dict[str, Asker]:
    """One asker per named teacher, in the params' order, from the models stage's pins (checked: the params'
    teachers are the pinned ones, and each model's files still match its pin)."""
    entries = check_pinned(paths.models_dir, teachers)
    out: dict[str, Asker] = {}
    for i, t in enumerate(teachers.named):
        entry = entries[t.name]
        model, revision = teacher_identity(entry)
        if t.is_endpoint:
            key = endpoint.api_key(t.endpoint.api_key_env, f"teachers.named[{i}].endpoint", error)
            url = t.endpoint.endpoint
            out[t.name] = Asker(
                t.name, model, revision, lambda url=url: contextlib.nullcontext(url), t.endpoint, key, url
            )
            continue
        directory = teacher_path(paths.models_dir, t.name, entry)
        out[t.name] = Asker(
            t.name,
            LOCAL_MODEL_NAME,
            revision,
            lambda directory=directory: bundled_server(cfg, directory, log_requests),
            cfg,
        )
    return out


def merged(a: AskSummary, b: AskSummary) -> AskSummary:
    """Two teachers' summaries as one run's: counts, failures and seconds added (asked one after the other), the
    concurrency the larger."""
    return dataclasses.replace(
        a,
        requested=a.requested + b.requested,
        already_cached=a.already_cached + b.already_cached,
        completed=a.completed + b.completed,
        failures=[*a.failures, *b.failures],
        retries=a.retries + b.retries,
        pushed_back=a.pushed_back + b.pushed_back,
        concurrency=max(a.concurrency, b.concurrency),
        seconds=a.seconds + b.seconds,
    )
