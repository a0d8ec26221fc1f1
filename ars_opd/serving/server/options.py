"""What the bundled server is started with, in one record: ``ServerOptions``.

Its batching defaults are ``TeacherServerConfig``'s (the params section a stage starts the server from), so
the command line, ``create_app``, ``run_server`` and the engine read one source instead of repeating the
numbers. ``max_logprobs`` defaults to vLLM's ``--max-logprobs`` (20).
"""

from __future__ import annotations

from dataclasses import dataclass

from ars_opd.config import TeacherServerConfig

DEFAULT_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class ServerOptions:
    """How the server serves one model directory (the directory itself is passed beside it)."""

    model_name: str | None = None
    """The id clients must send (None: the directory's name)."""
    max_batch_size: int = TeacherServerConfig.max_batch_size
    """Most rows in one generate call or scoring forward."""
    max_wait_ms: float = TeacherServerConfig.max_wait_ms
    """How long the first row of a batch waits for company (again while more arrive, ``engine.GATHER_WAITS``
    times at most)."""
    max_batch_tokens: int | None = TeacherServerConfig.max_batch_tokens
    """Most token budget in one generate call: rows × their longest ``max_tokens`` (None: rows only)."""
    max_queue_s: float | None = None
    """Answer a generation request 429 with Retry-After when its estimated time to an answer (the queue ahead
    at the measured speed, ``ars_opd.serving.server.admission``) exceeds this many seconds (None: never)."""
    threads: int | None = None
    """torch intra-op threads of the server process (None: torch's choice)."""
    device: str = "cpu"
    dtype: str = "float32"
    log_requests: str | None = None
    """Append one JSON line per accepted chat request to this file."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Largest ``prompt_logprobs`` k a scoring request may ask."""
    weight_updates: bool = False
    """Serve ``POST /collective_rpc`` ``{"method": "ars_opd_load_weights", "kwargs": {"path"}}``: load a
    safetensors file into the served model (a rollout engine whose trainer publishes weights). Off: 404."""
    ignore_weight_updates: bool = False
    """FAULT INJECTION, for tests only: answer weight loads with success but keep the old weights (a stale
    engine, as vLLM issue #32718), so that the trainer's version check can be shown to catch it. Needs
    ``weight_updates``."""
    keep_old_head: bool = False
    """FAULT INJECTION, for tests only: load every tensor but the output head, which keeps its old values (a tied
    head is untied first): "new embedding, old head", what vLLM CPU's stock reload serves. Needs
    ``weight_updates``."""

    parent_pid: int | None = None
    """Stop when this process is gone (the stage that started the server: a ``kill -9`` of it runs no cleanup,
    and a server in its own session would otherwise serve on, orphaned, until someone kills it)."""

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_wait_ms < 0:
            raise ValueError(
                f"need max_batch_size >= 1 and max_wait_ms >= 0, got {self.max_batch_size}, {self.max_wait_ms}"
            )
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"need max_batch_tokens >= 1 or None, got {self.max_batch_tokens}")
        if self.max_queue_s is not None and self.max_queue_s <= 0:
            raise ValueError(f"need max_queue_s > 0 or None, got {self.max_queue_s}")
        if (self.ignore_weight_updates or self.keep_old_head) and not self.weight_updates:
            raise ValueError("ignore_weight_updates and keep_old_head (fault injections) need weight_updates")
