"""Starting the rollout engine for the opd stage: the bundled server, a real vLLM, or a server already running.

``opd.engine.server``:

- ``bundled``: our server (``python -m ars_opd.serving.server``) with weight updates on, the embedded
  default: nothing to install;
- ``vllm``: vLLM from its own environment (``ars_opd.serving.vllm_server``), started with our weight
  sync worker extension, chunked prefill off (per-request seeds otherwise crash vLLM CPU's engine) and
  vLLM's own generation defaults (never the checkpoint's);
- an ``http(s)://`` URL: a server the user started (the README gives the exact vLLM command); it must have
  the extension loaded and ``VLLM_SERVER_DEV_MODE=1``, which the first sync checks.

A started vLLM's launch fits its build (``ars_opd.serving.vllm_server``: fp32, eager and a small KV cache
on a CPU build; the checkpoint's dtype, CUDA graphs and ``opd.engine.gpu_memory_utilization`` on a GPU build)
and its context is what the stage asks for (``vllm_options``), not the student's full context.

With ``opd.engine.transport: nccl`` a started vLLM also gets ``--weight-transfer-config '{"backend": "nccl"}'``
(``ars_opd.rollouts.nccl_sync``); the bundled engine has no NCCL (``RolloutEngineConfig`` refuses the pair).

Either started server serves the models-stage student directory (architecture and tokenizer); the first sync,
before the first rollout, replaces its weights with the run's starting student (the SFT model, merged with its
adapter if any), and the version check proves it (``ars_opd.rollouts.version_check``). The engine runs for the stage's
duration in the launching process; workers only talk to it over HTTP.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ars_opd.rollouts.weights import remove_versions
from ars_opd.teacher.client.endpoint import ClientSettings

BUNDLED = "bundled"
VLLM = "vllm"
NCCL_ENGINE_ARGS = ("--weight-transfer-config", '{"backend": "nccl"}')  # transport nccl (a CUDA vLLM)


@dataclass(frozen=True)
class RolloutEndpoint:
    """The rollout engine as this run reaches it: its URL, the served model's name, the client settings, and the
    directory rank 0 writes versions to (readable by the engine). Run-time only: a started engine's port
    changes every run, so it stays out of the checkpoint fingerprint."""

    url: str
    model: str
    settings: ClientSettings
    sync_dir: str


SYNC_DIR = "engine-sync"  # opd.engine.sync_dir's default, under the stage's checkpoint directory
LOG_DIR = "engine"  # a started vLLM's log, under the same


def sync_directory(engine, checkpoints: str | Path) -> Path:
    """Where rank 0 writes versions for the engine to read: ``opd.engine.sync_dir``, else
    ``<checkpoints>/engine-sync`` (the stage's checkpoint directory: persistent, and on a disk that can be shared
    with an engine in another container or on another host, as a temporary directory cannot). Absolute, since
    the engine reads the path it is given from its own working directory."""
    return Path(engine.sync_dir if engine.sync_dir else Path(checkpoints) / SYNC_DIR).absolute()


@contextlib.contextmanager
def rollout_endpoint(engine, student_dir: str, checkpoints: str | Path, context: int = 0) -> Iterator[RolloutEndpoint]:
    """The engine for the stage's duration (``rollout_engine``; ``context`` as there), with its client settings
    and its sync directory (``sync_directory``). The versions written there are removed at the end (each is as
    large as the student; a resumed run publishes its own before its first rollout)."""
    from ars_opd.config import EndpointConfig

    sync_dir = sync_directory(engine, checkpoints)
    try:
        with rollout_engine(engine, student_dir, Path(checkpoints) / LOG_DIR, context) as url:
            limits = EndpointConfig(
                endpoint=url,
                model=engine.model,
                concurrency=engine.concurrency,
                request_timeout_s=engine.request_timeout_s,
                max_attempts=engine.max_attempts,
            )
            yield RolloutEndpoint(url, engine.model, ClientSettings(url, "EMPTY", limits), str(sync_dir))
    finally:
        remove_versions(sync_dir)


def stage_context(cfg) -> int:
    """The longest sequence the opd stage (``OPDConfig``) asks an engine for: a prompt it keeps
    (``max_prompt_tokens``) and its longest rollout (``max_new_tokens``), or a scored probe sequence and the one
    token a scoring request generates, whichever is longer."""
    return max(cfg.max_prompt_tokens + cfg.max_new_tokens, cfg.engine.probe_tokens + 1)


def vllm_options(engine, student_dir: str, context: int = 0):
    """The options a started vLLM rollout engine gets (``VLLMOptions``, its build not yet resolved). Its context
    is ``opd.engine.max_model_len`` when set, else ``context`` (the stage's need) up to the student's
    ``max_position_embeddings``: vLLM reserves KV cache for a full context per sequence, and a real student's
    (40,960 for Qwen3) would not start where the stage's few hundred tokens do."""
    from ars_opd.serving.vllm_server import VLLMOptions

    model_context = int(json.loads((Path(student_dir) / "config.json").read_text())["max_position_embeddings"])
    return VLLMOptions(
        served_model_name=engine.model,
        build=engine.build,
        dtype=engine.dtype,
        max_model_len=engine.max_model_len or (min(context, model_context) if context > 0 else model_context),
        gpu_memory_utilization=engine.gpu_memory_utilization,
        enforce_eager=engine.enforce_eager,
        cpus=engine.cpus,
        weight_sync=True,
        startup_timeout_s=engine.startup_timeout_s,
        extra_args=NCCL_ENGINE_ARGS if engine.transport == "nccl" else (),
    )


def check_engine_dtype(engine, opts) -> None:
    """Refuse a vLLM that would compute in another precision than fp32 (a GPU build's auto: bf16) while the
    version check holds its first sync to the derived fp32 bound (``opd.engine.probe_tolerance`` null): it
    would refuse that sync after the minutes of start-up. ``opts``: resolved for the build."""
    from ars_opd.config import ConfigError
    from ars_opd.serving.vllm_server import FP32

    if opts.dtype not in FP32 and engine.probe_tolerance is None:
        raise ConfigError(
            "opd.engine.dtype",
            f"a {opts.build} vLLM computes in {opts.dtype} (opd.engine.dtype: {engine.dtype or 'null'}), outside "
            "the fp32 rounding bound the version check calibrates its first sync against: set opd.engine.dtype: "
            "float32, or opd.engine.probe_tolerance to the tolerance that precision needs",
        )


@contextlib.contextmanager
def rollout_engine(engine, student_dir: str, log_dir: Path, context: int = 0) -> Iterator[str]:
    """Start (or name) the engine described by ``engine`` (``RolloutEngineConfig``); yield its base URL.
    ``context``: the longest sequence the stage asks of it (``stage_context``), a started vLLM's default context."""
    if engine.server == BUNDLED:
        from ars_opd.serving.local_server import local_server

        with local_server(
            student_dir, engine.bundled, model_name=engine.model, extra_args=("--weight-updates",)
        ) as url:
            yield url
    elif engine.server == VLLM:
        from ars_opd.serving.vllm_server import resolve_build, resolve_options, vllm_server

        opts = vllm_options(engine, student_dir, context)
        opts = resolve_options(opts, resolve_build(opts))
        check_engine_dtype(engine, opts)
        log_dir.mkdir(parents=True, exist_ok=True)
        with vllm_server(student_dir, opts, log_path=log_dir / "vllm-rollouts.log") as url:
            yield url
    else:
        yield engine.server
