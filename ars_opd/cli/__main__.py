"""``python -m ars_opd.cli``: the ``ars-opd`` command (``main``)."""

import sys

from ars_opd.cli import main

sys.exit(main())
