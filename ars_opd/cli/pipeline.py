"""The ``ars-opd`` subcommands on a pipeline's params file and outputs: ``params`` (validate it),
``params-reference`` (the reference page written from it), ``profile`` (a profile's overrides, or its experiment
run), ``check`` (the stages' outputs against their contracts) and ``summary`` (a run's page from its outputs).
What each does is the command's docstring (``ars_opd.cli``); each parses its own arguments (``add_parsers``).
"""

from __future__ import annotations

import argparse
import json
import sys

from ars_opd.config import ConfigError, load_params, to_dict


def _cmd_params(args: argparse.Namespace) -> int:
    try:
        params = load_params(args.file)  # every check a stage runs on its params (config.check_params)
    except ConfigError as e:
        print(f"ars-opd: invalid params: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_dict(params), indent=2))
    return 0


def _cmd_params_reference(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ars_opd.params_reference import REGENERATE, generate

    try:
        page = generate(args.file)
    except ValueError as e:
        print(f"ars-opd params-reference: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        if out.exists() and out.read_text() == page:
            return 0
        print(
            f"ars-opd params-reference: {out} differs from what ars_opd/config.py and {args.file} give: "
            f"run `{REGENERATE}`",
            file=sys.stderr,
        )
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out}")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from ars_opd.profiles import profile_overrides, run_profile

    try:
        if args.profile_command == "show":
            print("\n".join(profile_overrides(args.profile)))
            return 0
        return run_profile(args.profile, args.name, args.dvc_args)
    except ConfigError as e:
        print(f"ars-opd profile: invalid params: {e}", file=sys.stderr)
        return 2


def _paths_or_none(params_file: str):
    """The params file's paths section, or None after saying why it is invalid (the caller exits 2)."""
    p = _sections_or_none(params_file, ("paths",))
    return None if p is None else p.paths


def _sections_or_none(params_file: str, sections: tuple[str, ...]):
    """The params file's named sections (``Params``), or None after saying why it is invalid (the caller exits 2)."""
    try:
        return load_params(params_file, sections=sections)
    except ConfigError as e:
        print(f"ars-opd: invalid params: {e}", file=sys.stderr)
        return None


def _cmd_summary(args: argparse.Namespace) -> int:
    from ars_opd.evaluation.run_summary import write_summary
    from ars_opd.training.opd.rollout_health import HealthConfig

    p = _sections_or_none(args.file, ("paths", "report"))
    if p is None:
        return 2
    out = write_summary(p.paths, args.out, args.command_line, args.title, HealthConfig.of(p.report))
    print(f"wrote {out}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from ars_opd.checks import STAGES, check_outputs
    from ars_opd.training.opd.rollout_health import HealthConfig

    p = _sections_or_none(args.file, ("paths", "report"))
    if p is None:
        return 2
    stages = tuple(s.strip() for s in args.stages.split(",")) if args.stages else STAGES
    try:
        problems = check_outputs(p.paths, stages, HealthConfig.of(p.report))
    except ValueError as e:
        print(f"ars-opd check: {e}", file=sys.stderr)
        return 2
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"ars-opd check: {len(problems)} problem(s) in the outputs of {', '.join(stages)}", file=sys.stderr)
        return 1
    print(f"ars-opd check: outputs of {', '.join(stages)} are sound")
    return 0


def add_parsers(sub) -> None:
    """``params``, ``params-reference``, ``check``, ``summary`` and ``profile``, in the command's order."""
    p = sub.add_parser("params", help="validate params.yaml and print the resolved values")
    p.add_argument("--file", default="params.yaml", help="params file (default: params.yaml)")
    p.set_defaults(func=_cmd_params)
    pref = sub.add_parser("params-reference", help="write the params reference page from config.py and params.yaml")
    pref.add_argument("--file", default="params.yaml", help="params file (default: params.yaml)")
    pref.add_argument("--out", default="docs/reference/params.md", help="the page (default: docs/reference/params.md)")
    pref.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is not up to date")
    pref.set_defaults(func=_cmd_params_reference)
    c = sub.add_parser("check", help="validate the stages' outputs (for CI)")
    c.add_argument("--stages", default=None, help="comma-separated stages (default: all)")
    c.add_argument("--file", default="params.yaml", help="params file (default: params.yaml)")
    c.set_defaults(func=_cmd_check)
    sm = sub.add_parser("summary", help="a run's summary in Markdown, from its own outputs (make repro-real)")
    sm.add_argument("--out", required=True, help="the Markdown file to write, e.g. reports/real_model.md")
    sm.add_argument("--command", dest="command_line", required=True, help="the command that made the run")
    sm.add_argument("--title", default="Pipeline run", help="the page's title")
    sm.add_argument("--file", default="params.yaml", help="params file (default: params.yaml)")
    sm.set_defaults(func=_cmd_summary)
    pr = sub.add_parser("profile", help="a profile of params overrides (profiles/*.yaml) as a DVC experiment")
    prs = pr.add_subparsers(dest="profile_command", required=True)
    show = prs.add_parser("show", help="print the profile's `dvc exp run -S` overrides, after checking them")
    show.add_argument("profile", help="a profile file, e.g. profiles/real.yaml")
    show.set_defaults(func=_cmd_profile)
    run = prs.add_parser("run", help="dvc exp run with the profile's overrides (arguments after -- go to dvc)")
    run.add_argument("profile", help="a profile file, e.g. profiles/real.yaml")
    run.add_argument("-n", "--name", default=None, help="the experiment's name")
    run.set_defaults(func=_cmd_profile, dvc_args=[])
