"""The bundled server, for any local causal-LM directory (a teacher, or a student as a rollout engine):
``app`` (the application and process, ``python -m ars_opd.serving.server``), ``handlers`` (the HTTP routes),
``engine`` (the model side: the queue and batched generation), ``admission`` (the queue's token-bounded
batches and wait estimate), ``preparation`` (request bodies to rows, off the event loop), ``jobs`` (the queued
rows and the events answering them), ``sampling`` (per-row sampling in a batch), ``validation`` (what a
request may ask), ``generation`` (token-id prompts, a rollout engine's requests), ``scoring`` (prompt
log-probabilities for OPD) and ``weights`` (a rollout engine's weight updates and their fingerprint)."""
