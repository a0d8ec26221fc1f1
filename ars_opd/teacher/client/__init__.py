"""Talking to an OpenAI-compatible teacher endpoint: ``endpoint`` (the shared HTTP layer: settings, retries,
errors), ``chat`` (chat completions for ``teacher_gen``), ``score`` (prompt log-probabilities for OPD),
``cache`` (the sha256-keyed answer cache), ``failures`` (the failure report) and ``generate`` (the
``teacher_gen`` stage, which starts the bundled server through ``ars_opd.serving.local_server`` when the
endpoint is local)."""
