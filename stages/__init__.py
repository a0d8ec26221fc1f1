"""The DVC stages' entry points (``python -m stages.<name>``), and what every one of them shares.

DVC runs each stage's ``cmd`` with the first ``python`` on PATH. Started as ``.venv/bin/dvc repro``
without the environment activated, that is the system interpreter, which lacks torch. Python imports this
package before any stage module, so the check below runs first: instead of a bare ``ModuleNotFoundError``
it names the interpreter, what it lacks and the fix, using the standard library only (it must work
precisely where the packages are missing).

``run_stage`` runs a stage's ``main``. An error whose message says everything prints that message alone,
as argparse does, instead of a traceback that buries it, and exits with its own code:

- 2: a params error (``ConfigError``, from ``params.yaml`` or from a check ``load_params`` runs, such as
  the OPD objective's);
- 3: this interpreter lacks the packages (the check below, before any stage import);
- 4: an endpoint or API-key error (``ars_opd.teacher.client.endpoint.EndpointError`` and its subclasses: the
  endpoint is unreachable, serves another model, rejects the key or tokenizes differently from the
  student, or the variable named by ``api_key_env`` is not set), also when a data-parallel worker raised it
  (``ars_opd.training.distributed.launch`` re-raises a worker's error as itself);
- 5: a model that cannot be found, read or trusted (``ars_opd.models.loading.ModelSourceError``: a missing
  directory or hub id, a GGUF file that is corrupt or of an architecture transformers cannot read, a pinned
  model whose files changed since the models stage).

Any other exception is unexpected and keeps its traceback.

Every run of a stage appends its wall time and the peak resident memory of its process tree (workers and servers
included) to ``paths.stage_runs`` (``ars_opd.resources``), whether it succeeds or not.

Each stage reads its params before it imports the code that runs it (torch, transformers), so bad params
are refused in a fraction of a second.

A training stage (sft, opd, sft_continued) that will start two or more local workers on CPU also starts
their forkserver in ``run_stage``, before its ``main`` imports the engine
(``ars_opd.training.forkserver.start_early``): the two import torch and transformers side by side instead of
one after the other. Importing this package starts nothing (a test, a tool or a stage module imported for its
``main`` gets no process it did not ask for); the training stages import torch only inside ``main``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable

# top-level modules of requirements.txt that every stage imports (directly or through ars_opd)
REQUIRED_MODULES = ("yaml", "numpy", "torch", "transformers")
EXIT_PARAMS, EXIT_ENVIRONMENT, EXIT_ENDPOINT, EXIT_MODEL = 2, 3, 4, 5


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


def _start_workers_early(raw: dict | None) -> None:
    """Start the workers' forkserver if this process is a training stage that will fork them: run as
    ``python -m stages.<training stage>``, not under an outside launcher (``launched_externally``, the rule
    ``launch`` itself follows), ``ddp.workers`` ≥ 2 and no CUDA in sight (CUDA workers are spawned). Only a
    head start: where it guesses wrong, ``launch`` still does the right thing, and bad params are left for the
    stage to report. ``raw``: params.yaml as read once by ``run_stage`` (None: unreadable)."""
    from ars_opd.config import TRAINING_STAGES, launched_externally

    argv = list(getattr(sys, "orig_argv", []))
    if "-m" not in argv[:-1] or argv[argv.index("-m") + 1] not in {f"stages.{s}" for s in TRAINING_STAGES}:
        return
    if launched_externally() or raw is None:
        return
    try:
        from ars_opd.config import load_params

        ddp = load_params(raw=raw).ddp  # the whole file: a stage that will refuse its params starts no forkserver
    except Exception:
        return
    cuda_in_sight = os.path.exists("/dev/nvidiactl") or bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if ddp.workers < 2 or ddp.device == "cuda" or (ddp.device == "auto" and cuda_in_sight):
        return
    from ars_opd.training.forkserver import start_early

    start_early(ddp.threads_per_worker)


def _pin_cpu_kernels(raw: dict | None) -> None:
    """Set ``base.cpu_kernels``'s caps in this process's environment before anything imports torch, so the stage,
    its forkserver, its workers and any server it starts use the kernels the params name. Bad params are left
    for the stage to report. ``raw``: as for ``_start_workers_early``."""
    if raw is None:
        return
    try:
        from ars_opd.config import load_params
        from ars_opd.seeding import pin_cpu_kernels

        pin_cpu_kernels(load_params(sections=("base",), raw=raw).base.cpu_kernels)
    except Exception:
        return


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main``; a ``ConfigError`` prints ``ars-opd <stage>: invalid params: <message>`` and
    exits 2, an ``EndpointError`` ``ars-opd <stage>: <message>`` and exits 4, a ``ModelSourceError`` the same and
    exits 5; anything else propagates.
    First params.yaml is read once; from it the CPU kernels ``base.cpu_kernels`` names are pinned
    (``_pin_cpu_kernels``), then a training stage's forkserver starts (``_start_workers_early``)."""
    from ars_opd.config import ConfigError, PathsConfig, load_params, read_params_file
    from ars_opd.resources import timed

    try:
        raw = read_params_file()  # once, for the three uses below; the stage reads its own params itself
    except Exception:  # ... and says what is wrong with them
        raw = None
    _pin_cpu_kernels(raw)
    _start_workers_early(raw)
    stage = os.path.splitext(os.path.basename(main.__code__.co_filename))[0]
    try:
        log = PathsConfig().stage_runs
        if raw is not None:
            try:
                log = load_params(sections=("paths",), raw=raw).paths.stage_runs
            except Exception:
                pass
        timed(stage, main, log)  # wall time and the process tree's peak memory, appended to paths.stage_runs
    except ConfigError as e:
        print(f"ars-opd {stage}: invalid params: {e}", file=sys.stderr)
        sys.exit(EXIT_PARAMS)
    except Exception as e:
        # an EndpointError exists only once its module is loaded, so a stage that never loaded the HTTP
        # client (most of them) does not import it (openai and all) just to find out what failed; the same for
        # a ModelSourceError (transformers)
        client = sys.modules.get("ars_opd.teacher.client.endpoint")
        models = sys.modules.get("ars_opd.models.loading")
        if client is not None and isinstance(e, client.EndpointError):
            print(f"ars-opd {stage}: {e}", file=sys.stderr)
            sys.exit(EXIT_ENDPOINT)
        if models is not None and isinstance(e, models.ModelSourceError):
            print(f"ars-opd {stage}: {e}", file=sys.stderr)
            sys.exit(EXIT_MODEL)
        raise
