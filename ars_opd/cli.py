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
"""

from __future__ import annotations

import argparse
import json
import sys

from ars_opd.config import VLLM_DTYPES, ConfigError, load_params, to_dict


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


def _serve(argv: list[str]) -> int:
    from ars_opd.serving.server import app  # heavy imports only for this subcommand

    return app.main(argv)


def _vllm_check(args: argparse.Namespace) -> int:
    import tempfile
    import time
    import urllib.request

    from ars_opd.config import ArchConfig
    from ars_opd.data import synthetic
    from ars_opd.models.builtin import save_builtin_model
    from ars_opd.models.tokenizer import build_char_word_tokenizer
    from ars_opd.serving.local_server import LocalServerError
    from ars_opd.serving.vllm_server import VLLMOptions, vllm_server

    def post(url: str, body: dict) -> dict:
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)

    with tempfile.TemporaryDirectory(prefix="ars-opd-vllm-check-") as tmp:
        tokenizer = build_char_word_tokenizer(synthetic.instruction_words())
        arch = ArchConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=128)
        save_builtin_model(tmp, arch, tokenizer)  # head size 32: one vLLM's CPU attention serves
        t0 = time.monotonic()
        try:
            with vllm_server(tmp, VLLMOptions(served_model_name="check")) as url:
                ready = time.monotonic() - t0
                chat = post(
                    f"{url}/chat/completions",
                    {"model": "check", "messages": [{"role": "user", "content": "Add 2 and 3."}], "max_tokens": 4},
                )
                scored = post(
                    f"{url}/completions",
                    {"model": "check", "prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": 1},
                )
        except (LocalServerError, OSError, ValueError) as e:
            print(f"ars-opd vllm check: {e}", file=sys.stderr)
            return 1
    n_scored = len(scored["choices"][0]["prompt_logprobs"])
    print(
        f"ars-opd vllm check: vLLM served a tiny model after {ready:.0f} s: a chat completion "
        f"({chat['choices'][0]['finish_reason']}) and prompt_logprobs for {n_scored} positions"
    )
    return 0


def _vllm_serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import subprocess
    import threading

    from ars_opd.serving.local_server import LocalServerError
    from ars_opd.serving.vllm_server import VLLMOptions, vllm_server

    opts = VLLMOptions(
        served_model_name=args.name,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        logprobs_mode=args.logprobs_mode,
        build=args.build,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        weight_sync=args.rollout_engine,
    )
    command = args.command_line
    try:
        with vllm_server(args.model_dir, opts, port=args.port, log_path=args.log) as url:
            print(f"ars-opd vllm: serving {args.model_dir} as {args.name!r} at {url}", file=sys.stderr, flush=True)
            if not command:
                stop = threading.Event()
                signal.signal(signal.SIGTERM, lambda *_: stop.set())
                try:
                    stop.wait()
                except KeyboardInterrupt:
                    pass
                return 0
            return subprocess.run(command, env={**os.environ, "ARS_OPD_VLLM_URL": url}).returncode
    except LocalServerError as e:
        print(f"ars-opd vllm: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ars-opd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
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
    # parsed by the server itself (main() hands it the rest of the command line)
    sub.add_parser("serve", help="serve a local HF causal LM with an OpenAI-compatible API (serve --help)")
    v = sub.add_parser("vllm", help="a real vLLM server from .venv-vllm (make vllm): check it, or serve a model")
    vsub = v.add_subparsers(dest="vllm_command", required=True)
    vsub.add_parser("check", help="start vLLM on a tiny model, ask it once, stop it").set_defaults(func=_vllm_check)
    vs = vsub.add_parser("serve", help="serve MODEL_DIR with vLLM; with `-- COMMAND`, run it against the server")
    vs.add_argument("model_dir", help="a local Hugging Face model directory (e.g. data/models/teacher)")
    vs.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default 8000)")
    vs.add_argument("--name", default="teacher", help="served model name (default: teacher)")
    vs.add_argument("--max-model-len", type=int, default=256, help="context length (default 256)")
    vs.add_argument("--max-logprobs", type=int, default=20, help="largest prompt_logprobs k (default 20)")
    vs.add_argument(
        "--logprobs-mode", default="raw_logprobs", help="vLLM's --logprobs-mode (default raw_logprobs: OPD needs it)"
    )
    vs.add_argument(
        "--build",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="the vLLM environment's build (default auto: ask its python whether torch sees a GPU); a CPU build "
        "serves fp32, eager, in a 256 MiB KV cache, a GPU build in the checkpoint's dtype with CUDA graphs",
    )
    vs.add_argument(
        "--dtype",
        choices=VLLM_DTYPES,
        default=None,
        help="vLLM's --dtype (default: float32 on a CPU build, auto on a GPU build)",
    )
    vs.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="a GPU build's share of the GPU's memory (default 0.9, vLLM's; lower it beside a trainer)",
    )
    vs.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's --enforce-eager (default: on a CPU build, off on a GPU build)",
    )
    vs.add_argument("--log", default=None, help="write the server's output here (default: a temporary file)")
    vs.add_argument(
        "--rollout-engine",
        action="store_true",
        help="serve a student for opd.rollouts: engine (our weight-sync worker extension, dev mode, vLLM's own "
        "generation defaults, chunked prefill off)",
    )
    vs.set_defaults(func=_vllm_serve, command_line=[])  # `-- COMMAND ...` after the options: split off in main
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
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


if __name__ == "__main__":
    sys.exit(main())
