"""The teacher, in two sides that never import each other.

- ``server``: the bundled OpenAI-compatible teacher server (``python -m ars_opd.teacher.server``): the app,
  the engine that batches generation on the model, request validation and prompt scoring;
- ``client``: talking to any such endpoint (ours, vLLM or a hosted API) and the ``teacher_gen`` stage built
  on it: the chat and score clients, the answer cache, the failure report, and starting the bundled server
  as a local subprocess (``client.local_server``: the one point where the client side names the server, by
  its module path on a command line, not by an import).
"""
