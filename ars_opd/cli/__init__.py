"""The ``ars-opd`` console command.

Subcommands:

- ``ars-opd params [--file params.yaml]``: validate every section of the params file with every check a
  stage runs on its params (``ars_opd.config.load_params``, the stages' own loader) and print the resolved
  values (defaults filled in) as JSON; exits 2 naming the first bad key. Cheap enough for a
  pre-commit hook or the first step of CI, before hours of ``dvc repro``.
- ``ars-opd params-reference [--file params.yaml] [--out docs/reference/params.md] [--check]``: write the params
  reference page from ``ars_opd/config.py``'s field docstrings and ``params.yaml``'s values and comments
  (``ars_opd.params_reference``); ``--check`` writes nothing and exits 1 when the page on disk is not what it
  would write. Exits 2 naming every field without a docstring.
- ``ars-opd profile show|run PROFILE [-n NAME] [-- DVC_ARGS]``: a profile (``profiles/*.yaml``, the params that
  differ from params.yaml) as ``dvc exp run -S`` overrides, checked first (``ars_opd.profiles``): ``show`` prints
  them, ``run`` runs the experiment (``make repro-real``).
- ``ars-opd check [--stages s1,s2] [--file params.yaml]``: validate the stages' outputs (files, schemas,
  row counts across stages, finite in-range metrics); exits 1 listing every problem.
- ``ars-opd summary --out FILE --command CMD [--title T]``: a run's summary in Markdown written from its own
  outputs (models, data, the held-out table per model and per kind, training, each stage's wall time and peak
  memory; ``ars_opd.evaluation.run_summary``): ``make repro-real`` writes ``reports/real_model.md`` with it.
- ``ars-opd scenarios [--from exp.json] [--out reports/scenarios.md]``: compare the seed scenarios of the DVC
  experiments (``dvc exp show --json``) against the paper's expected ordering.
- ``ars-opd distillation [--from exp.json] [--out reports/distillation.md] [--where K=V] [--regime L:K=V]
  [--family LABEL]``: OPD against its control arm at equal steps, equal FLOPs and equal FLOPs with the
  teacher's data cost across the training seeds of a DVC sweep, with intervals, a positive control, further
  regimes (sets of seeds selected by their params), and on long-horizon tasks where each model first goes
  wrong; ``--family`` writes one task family's section of the file.
- ``ars-opd serve MODEL_DIR [...]``: the bundled OpenAI-compatible server (``ars_opd.serving.server``)
  for any local Hugging Face causal-LM directory, on 127.0.0.1 by default.
- ``ars-opd vllm check``: start a real vLLM server (``.venv-vllm``, ``make vllm``) on a tiny model built here,
  ask it one chat completion and one scoring request, stop it; exits 1 naming what failed.
- ``ars-opd vllm serve MODEL_DIR [--port P] [--name N] [-- COMMAND ...]``: serve a local model directory with
  vLLM on 127.0.0.1 with the flags OPD scoring needs (``ars_opd.serving.vllm_server``); with a COMMAND,
  run it with the server's URL in ``$ARS_OPD_VLLM_URL``, stop the server and exit with the command's status
  (``make repro-vllm``); without one, serve until Ctrl-C. ``--rollout-engine`` serves a student for
  ``opd.rollouts: engine`` (``ars_opd.rollouts``). The launch fits the build (``--build auto`` asks the vLLM
  environment): fp32, eager and a small KV cache on CPU, the checkpoint's dtype, CUDA graphs and
  ``--gpu-memory-utilization`` on a GPU.

The subcommands live by what they work on, each module adding its own parsers: ``pipeline`` (params, params-reference,
profile, check, summary: a pipeline's params file and outputs), ``studies`` (scenarios, distillation: comparing DVC
experiments), ``servers`` (serve, vllm: starting a server); this module builds the parser and dispatches.
"""

from __future__ import annotations

import argparse
import sys

from ars_opd.cli import pipeline, servers, studies


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ars-opd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pipeline.add_parsers(sub)
    studies.add_parsers(sub)
    servers.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return servers.serve(argv[1:])
    command: list[str] = []
    if argv[:2] in (["vllm", "serve"], ["profile", "run"]) and "--" in argv:  # after `--`: passed on as it is
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    if command:
        if args.command == "profile":
            args.dvc_args = command
        else:
            args.command_line = command
    return args.func(args)
