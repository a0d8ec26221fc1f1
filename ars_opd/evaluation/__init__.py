"""The ``evaluate`` and ``report`` stages, and the comparison of experiments across DVC runs."""
