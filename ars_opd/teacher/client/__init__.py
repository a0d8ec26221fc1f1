"""Talking to an OpenAI-compatible teacher endpoint: ``endpoint`` (settings, retries, errors, chat
completions), ``score`` (prompt log-probabilities for OPD), ``cache`` (the sha256-keyed answer cache),
``failures`` (the failure report), ``local_server`` (the bundled server as a subprocess) and ``generate``
(the ``teacher_gen`` stage)."""
