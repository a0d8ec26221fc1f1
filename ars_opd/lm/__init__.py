"""Causal-LM mechanics shared by every stage: batching and packed attention, generation (and the static-cache
decode loop), the output head applied in chunks, token losses and divergences, the OPD objectives.

Nothing here knows about data parallelism or files; training, evaluation and the bundled server use it.
"""
