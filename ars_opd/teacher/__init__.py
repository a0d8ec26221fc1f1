"""The ``teacher_gen`` stage: the answer cache, the OpenAI-compatible client and the bundled server."""
