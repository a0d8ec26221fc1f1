"""``python -m ars_opd.serving.server``: run the bundled server (``app.main``)."""

import sys

from ars_opd.serving.server.app import main

sys.exit(main())
