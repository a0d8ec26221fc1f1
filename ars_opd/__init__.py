"""ars-opd: on-policy distillation of language models with worker-level diagnostics for DDP training.

The library behind the DVC stages in ``stages/``. Its packages follow the pipeline:

- ``data``: the ``subset`` stage (instruction datasets, the synthetic tasks, prompt rendering);
- ``models``: the ``models`` stage (built-in tokenizer and models, pinning of pretrained ones);
- ``teacher``: the ``teacher_gen`` stage (answer cache, OpenAI-compatible client, bundled server);
- ``lm``: what every stage does with a causal LM (batching, generation, losses and divergences);
- ``training``: the ``sft`` and ``opd`` stages on one data-parallel engine with the consistency monitor;
- ``evaluation``: the ``evaluate`` and ``report`` stages and the scenario comparison.

Design notes the code relies on are in ``docs/design.md``.
"""

__version__ = "0.1.0"
