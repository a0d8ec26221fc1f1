"""The bundled teacher server: ``app`` (the application and process, ``python -m ars_opd.teacher.server``),
``handlers`` (the HTTP routes), ``engine`` (the model side: the queue and batched generation), ``jobs`` (the
queued rows and the events answering them), ``sampling`` (per-row sampling in a batch), ``validation``
(what a request may ask) and ``scoring`` (prompt log-probabilities for OPD)."""
