"""``python -m ars_opd.teacher.server``: run the bundled teacher server (``app.main``)."""

import sys

from ars_opd.teacher.server.app import main

sys.exit(main())
