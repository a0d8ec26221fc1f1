"""Serving a model over an OpenAI-compatible HTTP API, whichever model it is: the teacher that teacher_gen and
OPD scoring ask, or the student that OPD's rollout engine samples and the trainer syncs its weights into.

- ``server``: the bundled server (``python -m ars_opd.serving.server``): the app, the engine that batches
  generation and scoring on the model, request validation, weight updates;
- the launchers, which start a server as a subprocess and stop it: ``local_server`` (the bundled server) and
  ``vllm_server`` (a real vLLM from its own environment, launched for its build).

The launchers name the server only by its module path on a command line and never import it, and the server
imports nothing of them: a stage that starts a server does not depend on how it computes, and the server runs
without the code that talks to it. The clients (``ars_opd.teacher.client``, ``ars_opd.rollouts``) import the
launchers, never the server.
"""
