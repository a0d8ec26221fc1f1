"""The ``sft`` and ``opd`` stages on one data-parallel engine (torch DDP) with the consistency monitor."""
