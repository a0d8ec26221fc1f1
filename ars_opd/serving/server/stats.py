"""The bundled server's counters, answered at ``GET /stats``: how it batched, scored, pushed back and loaded.

Both halves of the engine count in them (``ars_opd.serving.server.engine`` on the event loop, its
``runner`` on the generation thread) and the ``/stats`` handler reads them, so they live apart from both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerStats:
    """Counters for batching, readable at ``GET /stats``."""

    completions: int = 0
    """Chat requests accepted for generation."""
    generate_calls: int = 0
    """``model.generate`` calls started (one per batch)."""
    rows_generated: int = 0
    """Sum of batch sizes."""
    tokens_generated: int = 0
    """Completion tokens recorded (the rows' own tokens, not the padding of rows that ended earlier)."""
    clients_gone: int = 0
    """Requests whose client left (a timeout, a dropped connection) before their answer."""
    rows_dropped: int = 0
    """Rows whose client had left while they waited: taken out of the queue and never computed."""
    rows_stopped: int = 0
    """Rows whose client left during their batch: stopped at the next decoding step."""
    largest_batch: int = 0
    largest_batch_tokens: int = 0
    """Largest token budget of a generate call: its rows × their longest ``max_tokens``."""
    generating: bool = False
    """A ``generate`` call is running now."""
    scores: int = 0
    """Prompts accepted for scoring (``/v1/completions``)."""
    score_calls: int = 0
    """Scoring forwards run (one per batch of prompts)."""
    tokens_scored: int = 0
    """Prompt tokens scored."""
    generations: int = 0
    """Token-id generation requests accepted (``/v1/completions`` without ``prompt_logprobs``)."""
    weight_loads: int = 0
    """Weight files loaded through ``/collective_rpc`` (pretended ones included, under the fault option)."""
    pushed_back: int = 0
    """Generation requests answered 429 because their estimated wait exceeded ``max_queue_s``."""
    step_fixed_s: float | None = None
    """The wait estimate's model of a decoding step: this many seconds ..."""
    step_per_row_s: float | None = None
    """... plus this many per row of the batch (``ars_opd.serving.server.admission.Throughput``)."""
