"""The ``ars-opd`` subcommands that compare DVC experiments: ``scenarios`` (the seed scenarios against the
paper's expected ordering) and ``distillation`` (OPD against its control at equal budget across training seeds).
Each reads ``dvc exp show --json`` and writes a findings page, or says which commands make the experiments it
needs; what each does is the command's docstring (``ars_opd.cli``).
"""

from __future__ import annotations

import argparse
import json
import sys

SCENARIO_COMMANDS = """\
git switch -c scenario-study && bash studies/scenario_sweep.sh   # after dvc repro; see the script's comments
# it queues, per seed in 1..5 (ddp.seed), with ddp.workers=4 and opd from one fixed SFT student:
#   dvc exp run --queue -S ddp.scenario=S1-1|S1-2|S1-3 -S ddp.seed=N ...
#   dvc exp run --queue -S ddp.inject.kind=shard_skew ... (the positive control)
# runs the queue, then: dvc exp show --json --all-commits > exps.json
ars-opd scenarios --from exps.json --notes reports/scenarios_notes.md --out reports/scenarios.md
"""


def _cmd_scenarios(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ars_opd.evaluation import scenarios

    data = json.loads(Path(args.source).read_text()) if args.source else scenarios.exp_show_json()
    found = scenarios.collect(data)
    if not found:
        print(
            "ars-opd scenarios: no experiment with ddp.scenario (or ddp.inject.kind) and report metrics found; "
            "run:\n" + SCENARIO_COMMANDS,
            file=sys.stderr,
        )
        return 1
    notes = Path(args.notes).read_text() if args.notes else ""
    text = scenarios.render(found, SCENARIO_COMMANDS, notes)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


DISTILLATION_COMMANDS = """\
dvc repro                                    # the default pipeline: training seed 0
for seed in 1 2 3; do dvc exp run --queue -S ddp.seed=$seed -n distill-seed$seed; done
dvc queue start --jobs 1                     # then wait until `dvc queue status` shows all done
dvc exp show --json --all-commits > exps.json
ars-opd distillation --from exps.json --out reports/distillation.md
"""


def _pairs(items: list[str]) -> dict[str, str]:
    """KEY=VALUE strings as a dict (params keys are dotted: opd.steps=1000)."""
    out = {}
    for item in items:
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"{item!r}: expected KEY=VALUE with a dotted params key, e.g. opd.steps=1000")
        out[key] = value
    return out


def _cmd_distillation(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ars_opd.evaluation import distillation
    from ars_opd.evaluation.experiments import exp_show_json

    data = json.loads(Path(args.source).read_text()) if args.source else exp_show_json()
    try:
        where = _pairs(args.where or [])
        regime_filters = {}
        for spec in args.regime or []:
            label, sep, rest = spec.partition(":")
            if not sep or not label.strip() or not rest.strip():
                raise ValueError(f"--regime {spec!r}: expected 'LABEL:KEY=VALUE[,KEY=VALUE...]'")
            regime_filters[label.strip()] = _pairs(rest.split(","))
    except ValueError as e:
        print(f"ars-opd distillation: {e}", file=sys.stderr)
        return 2
    runs = distillation.with_curves(distillation.collect(data, where))
    if len(runs) < 2:
        print(
            f"ars-opd distillation: {len(runs)} training seed(s) with both arms evaluated; at least 2 are needed "
            "for intervals. Run:\n" + DISTILLATION_COMMANDS,
            file=sys.stderr,
        )
        return 1
    regimes = {}
    for label, filters in regime_filters.items():
        regimes[label] = distillation.with_curves(distillation.collect(data, filters))
        if len(regimes[label]) < 2:
            print(
                f"ars-opd distillation: regime {label!r} ({filters}) has {len(regimes[label])} seed(s) with both "
                "arms evaluated; at least 2 are needed",
                file=sys.stderr,
            )
            return 1
    missing = [r["name"] for rs in [runs, *regimes.values()] for r in rs if not distillation.has_curves(r["evaluate"])]
    if missing:
        print(
            f"ars-opd distillation: no learning curves for {', '.join(map(str, missing))} (`dvc exp show --json` "
            "drops them and their commits could not be read here): the equal-FLOPs tables, the positive control "
            "and the figures leave those runs out. Run this inside the repository that holds the experiments.",
            file=sys.stderr,
        )
    out = Path(args.out)
    figures = distillation.write_figures(runs, out, args.family)
    commands = Path(args.commands).read_text() if args.commands else DISTILLATION_COMMANDS
    text, _ = distillation.render_study(runs, commands, figures, regimes)
    notes = Path(args.notes).read_text() if args.notes else ""
    text += "\n" + notes.strip() + "\n" if notes.strip() else ""
    if args.family:  # replace (or add) this family's section, keep the others
        section = distillation.as_family_section(text, args.family)
        text = distillation.merge_family_section(out.read_text() if out.is_file() else "", args.family, section)
    out.write_text(text)
    print(f"wrote {out} and its figures ({', '.join(figures.values())})")
    return 0


def add_parsers(sub) -> None:
    """``scenarios`` and ``distillation``, in the command's order."""
    sc = sub.add_parser("scenarios", help="compare the seed-scenario experiments (S1-1/2/3)")
    sc.add_argument("--from", dest="source", default=None, help="saved `dvc exp show --json` output")
    sc.add_argument("--out", default=None, help="write the markdown here (default: stdout)")
    sc.add_argument("--notes", default=None, help="markdown appended after the tables (the interpretation)")
    sc.set_defaults(func=_cmd_scenarios)
    d = sub.add_parser("distillation", help="OPD against its control at equal budget, across training seeds")
    d.add_argument("--from", dest="source", default=None, help="saved `dvc exp show --json` output")
    d.add_argument("--out", default="reports/distillation.md", help="markdown to write (figures beside it)")
    d.add_argument("--notes", default=None, help="markdown appended after the tables (the interpretation)")
    d.add_argument(
        "--commands",
        default=None,
        help="file with the commands that made the sweep (default: the seed sweep of the README)",
    )
    d.add_argument(
        "--where",
        action="append",
        metavar="KEY=VALUE",
        help="only experiments whose params have this value (repeatable), e.g. opd.steps=300",
    )
    d.add_argument(
        "--family",
        default=None,
        help="the task family the sweep studied: write its section of --out (## Task family: LABEL), keeping the "
        "other families' sections",
    )
    d.add_argument(
        "--regime",
        action="append",
        metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
        help="a further set of seeds, reported in its own section (repeatable), e.g. 'longer horizon:opd.steps=1000'",
    )
    d.set_defaults(func=_cmd_distillation)
