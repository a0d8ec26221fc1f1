"""The ``ars-opd`` console command.

Subcommands:

- ``ars-opd params [--file params.yaml]``: validate every section of the params file and print the
  resolved values (defaults filled in) as JSON; exits 2 naming the first bad key. Cheap enough for a
  pre-commit hook or the first step of CI, before hours of ``dvc repro``.
- ``ars-opd serve MODEL_DIR [...]``: the bundled OpenAI-compatible server (``ars_opd.teacher_server``)
  for any local Hugging Face causal-LM directory, on 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import json
import sys

from ars_opd.config import ConfigError, load_params, to_dict


def _cmd_params(args: argparse.Namespace) -> int:
    try:
        params = load_params(args.file)
    except ConfigError as e:
        print(f"ars-opd: invalid params: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_dict(params), indent=2))
    return 0


def _serve(argv: list[str]) -> int:
    from ars_opd import teacher_server  # heavy imports only for this subcommand

    return teacher_server.main(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ars-opd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("params", help="validate params.yaml and print the resolved values")
    p.add_argument("--file", default="params.yaml", help="params file (default: params.yaml)")
    p.set_defaults(func=_cmd_params)
    # parsed by the server itself (main() hands it the rest of the command line)
    sub.add_parser("serve", help="serve a local HF causal LM with an OpenAI-compatible API (serve --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
