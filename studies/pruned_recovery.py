"""The pruned-recovery study: does on-policy distillation recover a depth-pruned real model better than SFT?

From one start, the real profile's SFT'd pruned SmolLM2 (the workspace's ``paths.distill_init``), per training
seed: the control (``sft_continued``, more SFT on the teacher's completions) and one ``opd`` stage run per arm,
all with the same steps, batch, schedule and clipping; then the evaluate stage for each arm against its seed's
control. The arms (``ars_opd.evaluation.recovery.ARMS``) differ in the opd section only:

- ``kd``: supervised KD, full-vocabulary forward KL on the teacher's completions (β = 0, λ = 0);
- ``opd``: reverse KL on the student's samples (β = 1, λ = 1);
- ``gkd``: JSD(β = 0.5) with λ = 0.5;
- ``opd_sampled``: the sampled-token reverse-KL estimator.

Every run is the pipeline's own stage (``python -m stages.<stage>``) in a directory of its own under ``--root``,
with a params.yaml of the workspace's params (or ``--profile`` merged onto them) plus the study's overrides,
and links to the workspace's models, subset, teacher completions and SFT stage outputs (read-only). A run that
finished with the same params is not run again, so a killed study resumes where it stopped (one whose params
changed runs again, and so does everything that reads its outputs). Evaluations share ``ARS_OPD_EVAL_CACHE``:
the base student, the SFT model and the teacher are scored by the first and read back by the others.
``--jobs`` runs that many stage processes at once (on a GPU they share it). The page,
``reports/pruned_recovery.md``, is written by ``ars_opd.evaluation.recovery`` from the runs' own outputs;
``--report-only`` writes it again from a finished root (e.g. one copied back from a GPU machine).

    python studies/pruned_recovery.py --seeds 1 2 3 --steps 120 --jobs 1            # the workspace's real profile
    python studies/pruned_recovery.py --profile profiles/real.yaml --set ddp.workers=1 --jobs 15   # a GPU machine
    python studies/pruned_recovery.py --report-only --root build/pruned-recovery
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ars_opd.artifacts import read_jsonl  # noqa: E402
from ars_opd.config import ConfigError, load_params, read_params_file  # noqa: E402
from ars_opd.evaluation.distillation import param  # noqa: E402
from ars_opd.evaluation.recovery import ARMS, CONTROL, SAME_TOKENIZER_ARMS, cross_tokenizer_arm  # noqa: E402

# what every run reads from the workspace (linked, never written): the models, the prompts, the teacher's
# completions and the SFT stage's model (the start, with its snapshots) and log
SHARED = ("models_dir", "subset_train", "subset_eval", "teacher_dir", "distill_init", "sft_model", "sft_log")
CONTROL_OUTPUTS = ("sft_continued_model", "sft_continued_log")
DONE = ".done"


def set_dotted(params: dict, dotted: str, value) -> None:
    node = params
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def parse_set(items: list[str]) -> list[tuple[str, object]]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. ddp.workers=1")
        value = yaml.safe_load(raw)
        if isinstance(value, str):  # YAML 1.1 reads 2e-5 (no dot) as a string; a number is meant
            try:
                value = float(value)
            except ValueError:
                pass
        out.append((key, value))
    return out


def base_params(profile: str | None) -> dict:
    params = read_params_file(REPO / "params.yaml")
    if profile:
        from ars_opd.profiles import merged, read_profile

        params = merged(params, read_profile(REPO / profile))
    return params


def study_overrides(args) -> list[tuple[str, object]]:
    """What every run of the study sets, before the arm's own keys."""
    return [
        ("opd.steps", args.steps),
        ("opd.snapshot_every", args.snapshot_every),
        ("opd.checkpoint_every", max(args.steps // 2, 1)),
        ("evaluate.curve_examples", args.curve_examples),
        *parse_set(args.set),
    ]


def run_params(base: dict, overrides: list[tuple[str, object]], seed: int, arm: str) -> dict:
    params = json.loads(json.dumps(base))
    for key, value in overrides:
        set_dotted(params, key, value)
    set_dotted(params, "ddp.seed", seed)
    for key, value in (ARMS[arm][2] or {}).items():
        set_dotted(params, f"opd.{key}", value)
    return params


def link(root: Path, rel: str, src: Path) -> None:
    if not src.exists():
        raise SystemExit(f"{src} is missing: run the real profile's models, subset, teacher_gen and sft first")
    dst = root / rel
    if dst.is_symlink():
        if dst.resolve() == src.resolve():
            return
        dst.unlink()  # left by an earlier study from another source (the workspace, or a --prepare start)
    elif dst.exists():
        raise SystemExit(f"{dst} exists and is not a link to {src}: remove it or use another --root")
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


class _Absent:
    """A key a params.yaml does not have (told apart from an explicit null)."""

    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


def study_keys(overrides: list[tuple[str, object]], arm: str) -> list[str]:
    """The params keys the study itself sets in a run of ``arm`` (``run_params``): what a kept run must agree on.
    The control's run trains only (its evaluation is each arm's evaluate stage, with the arm's params), so its
    ``evaluate`` keys are not among them: a study whose evaluation settings changed keeps its controls."""
    keys = [k for k, _ in overrides] + ["ddp.seed"] + [f"opd.{k}" for k in ARMS[arm][2] or {}]
    return [k for k in keys if not (arm == CONTROL and k.startswith("evaluate."))]


def prepare_run(
    root: Path,
    params: dict,
    source: Path,
    control_dir: Path | None,
    keep_params: bool = False,
    keys: list[str] = (),
) -> bool:
    """``root``'s params.yaml and its links to ``source`` (the workspace, or the study's own start) and, for an
    arm, to its seed's control. With ``keep_params`` a run that has a params.yaml keeps it as it is (a study
    finished by newer code: keys the params gained since would change its sha and retrain it), provided it agrees
    with ``params`` on ``keys`` (the study's own: its steps, its --set, the seed, the arm's keys), else the study
    stops naming them; returns whether it was kept."""
    root.mkdir(parents=True, exist_ok=True)
    kept = keep_params and (root / "params.yaml").is_file()
    if kept:
        have = yaml.safe_load((root / "params.yaml").read_text()) or {}
        pairs = {k: (param(have, k, ABSENT), param(params, k, ABSENT)) for k in keys}
        differ = {k: (there, here) for k, (there, here) in pairs.items() if there != here}
        if differ:
            raise SystemExit(
                f"--keep-params: {root / 'params.yaml'} differs from this study's command on "
                + ", ".join(f"{k} ({there!r} there, {here!r} here)" for k, (there, here) in differ.items())
                + ": run the command it was trained with, or remove the run to train it again"
            )
    else:
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (root / "inputs").exists():  # the params' local sources, before the checks that look for them
        (root / "inputs").symlink_to(REPO / "inputs", target_is_directory=True)
    paths = load_params(root / "params.yaml", base=root).paths  # every check a stage runs, before anything runs
    source_paths = load_params(source / "params.yaml", base=source, sections=("paths",)).paths
    for name in SHARED:
        link(root, getattr(paths, name), source / getattr(source_paths, name))
    if control_dir is not None:  # the control's outputs: linked before the control has run (evaluate reads them)
        for name in CONTROL_OUTPUTS:
            dst = root / getattr(paths, name)
            if not dst.is_symlink():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(control_dir / getattr(paths, name), target_is_directory=True)
    return kept


def params_sha(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "params.yaml").read_bytes()).hexdigest()


def finished(run_dir: Path, stage: str) -> bool:
    """Whether ``stage`` finished in ``run_dir`` with the params it has now (its marker names their sha256)."""
    try:
        return json.loads((run_dir / f"{DONE}-{stage}").read_text())["params_sha256"] == params_sha(run_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return False


class Runner:
    """Stage processes, ``jobs`` at a time; each run's output in ``<run>/<stage>.log``. A stage that finished
    with the run's present params (its marker file) is skipped; one that runs drops the markers of the stages
    that read its outputs (``invalidates``), so they run again."""

    def __init__(self, jobs: int, threads: int | None):
        self.jobs = jobs
        self.threads = threads
        self.lock = threading.Lock()
        self.failed: list[str] = []
        self.ran: set[tuple[Path, str]] = set()
        self.t0 = time.perf_counter()

    def stage(self, run_dir: Path, stage: str, env: dict) -> float:
        marker = run_dir / f"{DONE}-{stage}"
        if finished(run_dir, stage):
            return float(json.loads(marker.read_text())["seconds"])
        marker.unlink(missing_ok=True)
        t = time.perf_counter()
        with open(run_dir / f"{stage}.log", "w") as log:
            rc = subprocess.run(
                [sys.executable, "-m", f"stages.{stage}"], cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT
            ).returncode
        seconds = time.perf_counter() - t
        with self.lock:
            where = f"{run_dir.relative_to(run_dir.parents[1])}:{stage}"
            if rc != 0:
                self.failed.append(where)
                print(
                    f"[{time.perf_counter() - self.t0:7.0f} s] FAILED {where} (exit {rc}): {run_dir / stage}.log",
                    file=sys.stderr,
                    flush=True,
                )
                return seconds
            print(
                f"[{time.perf_counter() - self.t0:7.0f} s] {where} done in {seconds:.0f} s", file=sys.stderr, flush=True
            )
        marker.write_text(json.dumps({"seconds": round(seconds, 3), "params_sha256": params_sha(run_dir)}))
        with self.lock:
            self.ran.add((run_dir, stage))
        return seconds

    def env(self, cache: Path) -> dict:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
        env["ARS_OPD_EVAL_CACHE"] = str(cache)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def map(self, fn, items) -> None:
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            list(pool.map(fn, items))


def seed_teacher_cache(start: Path, cache: Path) -> bool:
    """``--teacher-cache``: an earlier start's teacher answers (its ``paths.teacher_cache`` file) put where this
    start's teacher_gen stage looks first, so that it asks the teacher only for prompts the file lacks. An answer
    is read back only under its request's sha256 (the teacher file's own sha256, the prompt, the sampling), so a
    file from another teacher or other settings costs nothing but its reading. A start that already has a cache
    keeps it (the stage resumes from it). Returns whether the file was put in place."""
    if not cache.is_file():
        raise SystemExit(f"--teacher-cache {cache}: no such file")
    target = start / load_params(start / "params.yaml", base=start, sections=("paths",)).paths.teacher_cache
    if target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(cache, tmp)
    os.replace(tmp, target)
    return True


def prepare_start(
    root: Path,
    base: dict,
    sets: list[tuple[str, object]],
    runner: "Runner",
    env: dict,
    own_data: bool = False,
    teacher_cache: Path | None = None,
) -> Path:
    """``--prepare``: the start the arms share, made here by the pipeline's own stages (models, then sft) in
    ``<root>/start``, with the prompts and the teacher's completions linked from the workspace where they are
    (a machine without the teacher endpoint's client brings them along) and made by their stages otherwise, or
    always made here with ``own_data`` (a profile whose data or teacher is not the workspace's)."""
    start = root / "start"
    start.mkdir(parents=True, exist_ok=True)
    params = json.loads(json.dumps(base))
    for key, value in sets:
        set_dotted(params, key, value)
    (start / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (start / "inputs").exists():
        (start / "inputs").symlink_to(REPO / "inputs", target_is_directory=True)
    paths = load_params(start / "params.yaml", base=start).paths
    workspace = load_params(REPO / "params.yaml", sections=("paths",)).paths
    stages = ["models"]
    for stage, names in (("subset", ("subset_train", "subset_eval")), ("teacher_gen", ("teacher_dir",))):
        if not own_data and all((REPO / getattr(workspace, n)).exists() for n in names):
            for n in names:
                link(start, getattr(paths, n), REPO / getattr(workspace, n))
        else:
            stages.append(stage)
    if teacher_cache is not None and "teacher_gen" in stages and seed_teacher_cache(start, teacher_cache):
        print(f"{start}: teacher answers seeded from {teacher_cache}", file=sys.stderr)
    for stage in [*stages, "sft"]:
        runner.stage(start, stage, env)
        if runner.failed:
            raise SystemExit(f"the start could not be made: {runner.failed}")
    return start


def register_extra_arms(specs: list[str]) -> dict[str, str]:
    """``--extra-arm NAME:KEY=VALUE,KEY=VALUE``: arms of the opd section's overrides beside ``recovery.ARMS`` (a
    screening sweep's), registered for this process; returns {name: spec} for study.json, which ``--report-only``
    registers again."""
    out = {}
    for spec in specs:
        name, sep, rest = spec.partition(":")
        if not sep or not name or name in ARMS:
            raise SystemExit(f"--extra-arm {spec!r}: expected NAME:KEY=VALUE,... with a NAME not among {list(ARMS)}")
        overrides = dict(parse_set([kv for kv in rest.split(",") if kv]))
        ARMS[name] = (name, f"the opd section with {rest}", overrides)
        out[name] = spec
    return out


def run_study(args) -> dict:
    root = Path(args.root).resolve()
    base = base_params(args.profile)
    overrides = study_overrides(args)
    if args.jobs > 1:
        overrides.append(("base.threads", args.threads))
    arms = [a for a in args.arms if a != CONTROL]
    runner = Runner(args.jobs, args.threads if args.jobs > 1 else None)
    env = runner.env(root / "eval-cache")
    t0 = time.perf_counter()
    if args.start:  # a start made earlier (a --prepare root's start/): its stages' outputs, as they are
        source = Path(args.start).resolve()
    elif args.prepare:
        cache = Path(args.teacher_cache) if args.teacher_cache else None
        source = prepare_start(root, base, parse_set(args.set), runner, env, args.own_data, cache)
    else:
        source = REPO
    t_start = time.perf_counter() - t0
    controls = {s: root / f"seed-{s}" / CONTROL for s in args.seeds}
    kept = []
    for s in args.seeds:
        for arm in [CONTROL, *arms]:
            run = root / f"seed-{s}" / arm
            control = None if arm == CONTROL else controls[s]
            keys = study_keys(overrides, arm)
            if prepare_run(run, run_params(base, overrides, s, arm), source, control, args.keep_params, keys):
                kept.append(f"seed-{s}/{arm}")
    if kept:
        print(f"--keep-params: {len(kept)} run(s) keep the params they have: {', '.join(kept)}", file=sys.stderr)
    train = [] if args.train_only else [(controls[s], "sft_continued") for s in args.seeds]
    train += [(root / f"seed-{s}" / a, "opd") for s in args.seeds for a in arms]
    runner.map(lambda job: runner.stage(job[0], job[1], env), train)
    t_train = time.perf_counter() - t0 - t_start
    # an arm is evaluated once its training and its seed's control finished; one trained again (or whose control
    # was) is evaluated again
    evals = []
    # short runs read for their step logs alone (--train-only: the collapse diagnosis) are not evaluated
    for s in [] if args.train_only else args.seeds:
        for a in arms:
            run = root / f"seed-{s}" / a
            if (run, "opd") in runner.ran or (controls[s], "sft_continued") in runner.ran:
                (run / f"{DONE}-evaluate").unlink(missing_ok=True)
            if finished(run, "opd") and finished(controls[s], "sft_continued"):
                evals.append(run)
    # one evaluation first, alone: it scores the base student, the SFT model and the teacher into the shared
    # store, which the others then read instead of scoring them side by side
    if evals:
        runner.stage(evals[0], "evaluate", env)
        runner.map(lambda d: runner.stage(d, "evaluate", env), evals[1:])
    seconds = time.perf_counter() - t0
    meta = {
        "command": " ".join(["python", command_name(), *sys.argv[1:]]),
        "seeds": args.seeds,
        "arms": arms,
        "steps": args.steps,
        "seconds": seconds,
        "start_seconds": t_start,
        "train_seconds": t_train,
        "start": "the sft stage's model"
        + (
            f" (made by the models and sft stages in `{args.start}`)"
            if args.start
            else " (made by the study's own models and sft stages)"
            if args.prepare
            else " (the workspace's)"
        ),
        "jobs": args.jobs,
        "overrides": [f"{k}={v}" for k, v in overrides],
        "device": device_words(),
        "commit": git_commit(),
        "failed": runner.failed,
        "extra_arms": args.extra_specs,
        "kept_params": kept,
        "profile": args.profile,
        "title": args.title,
    }
    (root / "study.json").write_text(json.dumps(meta, indent=1))
    return meta


def command_name() -> str:
    """The script the user ran (studies/cross_tokenizer.py runs this one with its own defaults), repo-relative."""
    path = Path(sys.argv[0]).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "studies/pruned_recovery.py"


def device_words() -> str:
    import torch

    if torch.cuda.is_available():
        return f"one {torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"{os.cpu_count()} CPU cores (torch {torch.__version__})"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def collect(root: Path) -> tuple[dict, dict, dict]:
    """(by_arm, logs, meta) from a study root: each arm's per-seed evaluation and opd step log."""
    import pandas as pd

    meta = json.loads((root / "study.json").read_text())
    for name, spec in (meta.get("extra_arms") or {}).items():
        if name not in ARMS:
            register_extra_arms([spec])
    by_arm: dict[str, list[dict]] = {}
    logs: dict[str, list] = {}
    for s in meta["seeds"]:
        for arm in meta["arms"]:
            run = root / f"seed-{s}" / arm
            if not (run / f"{DONE}-evaluate").exists():
                meta.setdefault("missing", []).append(f"seed-{s}/{arm}")
                continue
            p = load_params(run / "params.yaml", base=run, sections=("paths",)).paths
            by_arm.setdefault(arm, []).append(
                {"name": f"{arm}-seed-{s}", "seed": s, "evaluate": json.loads((run / p.eval_metrics).read_text())}
            )
            steps = run / p.opd_log / "steps.jsonl"
            logs.setdefault(arm, []).append(pd.DataFrame(read_jsonl(steps)) if steps.is_file() else pd.DataFrame())
    return by_arm, logs, meta


def base_label(params_file: Path) -> str:
    """The base student's name on the page: a pruned copy of the teacher (``models.student`` a mapping with
    ``prune_from``) or a complete model, scored before any training."""
    student = (read_params_file(params_file).get("models") or {}).get("student")
    return "pruned base" if isinstance(student, dict) else "base student (complete, before any training)"


def write_report(
    root: Path, out: Path, commit: str | None = None, notes: Path | None = None, diagnosis: Path | None = None
) -> dict:
    from ars_opd.evaluation import recovery

    by_arm, logs, meta = collect(root)
    if notes is not None:
        meta["notes"] = notes.read_text()
    if diagnosis is not None:
        meta["diagnosis"] = read_jsonl(diagnosis)
    if commit:
        meta["commit"] = commit
    if "profile" not in meta and "--profile" in meta.get("command", "").split():  # a study.json older than the key
        words = meta["command"].split()
        meta["profile"] = words[words.index("--profile") + 1]
    if not by_arm:
        raise SystemExit(f"{root}: no arm has a finished evaluation")
    first = root / f"seed-{meta['seeds'][0]}" / next(iter(by_arm))
    p = load_params(first / "params.yaml", base=first, sections=("paths", "opd"))
    meta.setdefault("base", base_label(first / "params.yaml"))
    meta.setdefault("start", f"`{p.paths.distill_init}`")
    meta.setdefault("batch", p.opd.global_batch_size)
    meta.setdefault("rollouts", p.opd.rollouts + (f" ({p.opd.engine.server})" if p.opd.rollouts == "engine" else ""))
    fig_dir = out.parent / out.stem
    fig_dir.mkdir(parents=True, exist_ok=True)
    figures = {}
    for x_key in ("steps", "flops"):
        recovery.curves_figure(by_arm, x_key, fig_dir / f"curves_{x_key}.png")
        figures[x_key] = f"{out.stem}/curves_{x_key}.png"
    out.write_text(recovery.render(by_arm, logs, meta, figures))
    return {arm: len(runs) for arm, runs in by_arm.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument(
        "--arms",
        nargs="+",
        default=list(SAME_TOKENIZER_ARMS),
        choices=list(ARMS),
        help="the xtok_* arms distil across tokenizers (studies/cross_tokenizer.py runs them)",
    )
    ap.add_argument("--steps", type=int, default=120, help="optimiser steps of every arm (opd.steps)")
    ap.add_argument("--snapshot-every", type=int, default=20, help="learning-curve points (opd.snapshot_every)")
    ap.add_argument("--curve-examples", type=int, default=64, help="held-out prompts of each curve point")
    ap.add_argument("--profile", help="a profile merged onto params.yaml (default: the workspace's params as they are)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override for every run")
    ap.add_argument("--jobs", type=int, default=1, help="stage processes at once")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each process when --jobs > 1")
    ap.add_argument("--root", default="build/pruned-recovery")
    ap.add_argument("--out", default="reports/pruned_recovery.md")
    ap.add_argument("--report-only", action="store_true", help="write the page from a finished --root")
    ap.add_argument("--commit", help="the commit the runs' code was (default: this checkout's HEAD when run)")
    ap.add_argument(
        "--keep-params",
        action="store_true",
        help="runs that have a params.yaml keep it (finish a study begun by older code without retraining it)",
    )
    ap.add_argument(
        "--prepare", action="store_true", help="make the start here (models and sft stages) instead of the workspace's"
    )
    ap.add_argument("--own-data", action="store_true", help="with --prepare: make the prompts and teacher completions")
    ap.add_argument(
        "--teacher-cache",
        help="with --prepare: an earlier start's teacher answers (e.g. reports/larger_teacher/runs/start/"
        "teacher_answers.jsonl), so teacher_gen asks only for what it lacks",
    )
    ap.add_argument("--start", help="a start made earlier (e.g. another study root's start/), used as it is")
    ap.add_argument("--title", help="the page's first line (markdown)")
    ap.add_argument("--notes", help="a markdown file of the study's reading, put after the verdict")
    ap.add_argument("--diagnosis", help="studies/opd_collapse.py's JSON lines, rendered as the diagnosis section")
    ap.add_argument(
        "--train-only",
        action="store_true",
        help="train the arms (not the control) and stop: short runs read for their step logs (opd_collapse.py)",
    )
    ap.add_argument(
        "--extra-arm",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="an arm of opd-section overrides beside the named ones (a screening sweep), e.g. opd_lr:lr=2e-5",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = [a.split("=", 1)[1] for a in argv if a.startswith("--extra-arm=")]
    extra += [argv[i + 1] for i, a in enumerate(argv) if a == "--extra-arm" and i + 1 < len(argv)]
    extra_specs = register_extra_arms(extra)  # before parsing: --arms' choices include them
    ap._option_string_actions["--arms"].choices = list(ARMS)
    args = ap.parse_args(argv)
    args.extra_specs = extra_specs
    if args.steps < 2 or args.jobs < 1 or len(set(args.seeds)) != len(args.seeds):
        ap.error("--steps must be >= 2, --jobs >= 1, and the seeds distinct")
    if not [a for a in args.arms if a != CONTROL]:
        ap.error("--arms needs at least one arm besides the control")
    if len({cross_tokenizer_arm(a) for a in args.arms if a != CONTROL}) > 1:
        ap.error("--arms: the xtok_* arms need cross-tokenizer models, the others a shared tokenizer; run them apart")
    root = Path(args.root).resolve()
    if not args.report_only:
        try:
            run_study(args)
        except ConfigError as e:  # a bad --set or profile: one line naming the key, as a stage says it
            print(f"pruned_recovery: params: {e}", file=sys.stderr)
            return 2
        if args.train_only:
            print(json.dumps({"kind": "pruned_recovery", "root": str(root), "train_only": True}))
            return 0
    counts = write_report(
        root,
        REPO / args.out,
        args.commit,
        Path(args.notes) if args.notes else None,
        Path(args.diagnosis) if args.diagnosis else None,
    )
    print(json.dumps({"kind": "pruned_recovery", "root": str(root), "out": args.out, "seeds_per_arm": counts}))
    failed = json.loads((root / "study.json").read_text()).get("failed") or []
    if failed:
        print(f"{len(failed)} run(s) failed (the page lists what it lacks): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
