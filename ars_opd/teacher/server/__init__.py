"""The bundled teacher server: ``app`` (HTTP routes, ``python -m ars_opd.teacher.server``), ``engine`` (the
model side: batched generation), ``validation`` (what a request may ask) and ``scoring`` (prompt
log-probabilities for OPD)."""
