"""The DVC stages' entry points (``python -m stages.<name>``), and what every one of them shares.

DVC runs each stage's ``cmd`` with the first ``python`` on PATH. Started as ``.venv/bin/dvc repro``
without the environment activated, that is the system interpreter, and a stage used to die on its first
import with a bare ``ModuleNotFoundError: No module named 'torch'``. Python imports this package before
any stage module, so the check below runs first: it names the interpreter, what it lacks and the fix,
using the standard library only (it must work precisely where the packages are missing).

``run_stage`` runs a stage's ``main``: a params error (``ConfigError``, from ``params.yaml`` or from a
check such as the OPD objective's) prints its message alone and exits 2, as argparse does, instead of a
traceback that buries it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable

# top-level modules of requirements.txt that every stage imports (directly or through ars_opd)
REQUIRED_MODULES = ("yaml", "numpy", "torch", "transformers")
EXIT_ENVIRONMENT, EXIT_PARAMS = 3, 2


def missing_modules(names: tuple[str, ...] = REQUIRED_MODULES) -> list[str]:
    """The modules of ``names`` this interpreter cannot import (looked up, not imported)."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def environment_message(missing: list[str]) -> str:
    venv = os.path.join(os.getcwd(), ".venv", "bin", "python")
    found = f"{venv} exists but is not the interpreter that ran. " if os.path.exists(venv) else ""
    return (
        f"ars-opd stage: this Python ({sys.executable}, {sys.version.split()[0]}) has no {', '.join(missing)}: "
        f"DVC ran the stage with the first `python` on PATH, which is not the project's environment. {found}"
        "Fix: `source .venv/bin/activate` and run `dvc repro` again, or run `make repro` (it sets up .venv "
        "and puts it first on PATH). Running .venv/bin/dvc alone is not enough: its stages still find "
        "`python` on PATH."
    )


def _require_environment() -> None:
    missing = missing_modules()
    if missing:
        print(environment_message(missing), file=sys.stderr)
        sys.exit(EXIT_ENVIRONMENT)


_require_environment()


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main``; a ``ConfigError`` prints ``<stage>: invalid params: <message>`` and exits 2."""
    from ars_opd.config import ConfigError

    try:
        main()
    except ConfigError as e:
        stage = os.path.splitext(os.path.basename(main.__code__.co_filename))[0]
        print(f"ars-opd {stage}: invalid params: {e}", file=sys.stderr)
        sys.exit(EXIT_PARAMS)
