"""Causal-LM mechanics shared by every stage: batching, generation, token losses and divergences.

Nothing here knows about data parallelism or files; training, evaluation and the teacher server use it.
"""
