"""ars-opd: on-policy distillation of language models with worker-level diagnostics for DDP training.

The library behind the DVC stages in ``stages/``: data subsets, teacher generation, SFT and on-policy
distillation on one data-parallel engine, and the worker-consistency monitor.
"""

__version__ = "0.1.0"
