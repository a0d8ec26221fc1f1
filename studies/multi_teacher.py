"""The several-teachers study: does one student distilled from two specialists, each prompt routed to the teacher
that knows it, get both specialties, and at what cost to each?

The start, made here by the pipeline's own stages in ``<root>/start``: the models stage builds three teachers of one
size (``models.teacher_arch``): ``arith`` trained on add, sort_digits and length, ``words`` on reverse and uppercase
(``teachers.named``, source builtin, their ``tasks``, ``--specialist-steps`` each), and ``general``, the models
stage's own teacher, trained on all five (``--teacher-steps``: by default as many steps as the two specialists
together, so the routed pair and the single teacher cost the same to train); teacher_gen answers each prompt with
its specialist (the route by task); the sft stage trains the student on those completions. Per training seed
(``ddp.seed``): one OPD run per arm of ``ars_opd.evaluation.multi_teacher.ARMS`` (the route alone differs: routed,
arith_only, words_only, general) from the start; then the evaluate stage for each arm in a directory of its own with
the specialists' route (each held-out row against the specialist that knows it), the arm's OPD model linked in. The
arms are compared with each other; no control arm (more SFT) is run, and each evaluation's control slot holds the
start. Every run is the pipeline's own stage in a directory of its own (``studies/pruned_recovery.py``'s runner: a
stage that finished with the same params is not run again, so a killed study resumes), one process at a time, at
``--threads`` torch threads each; the evaluations share ``ARS_OPD_EVAL_CACHE``. Prints the study's numbers as JSON
and writes ``reports/multi_teacher.md`` (``ars_opd.evaluation.multi_teacher``).

    OMP_NUM_THREADS=1 python studies/multi_teacher.py                  # build/multi-teacher, reports/multi_teacher.md
    python studies/multi_teacher.py --report-only                      # the page again from a finished root
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "studies"))

from pruned_recovery import (  # noqa: E402
    DONE,
    Runner,
    device_words,
    finished,
    git_commit,
    link,
    parse_set,
    set_dotted,
)

from ars_opd.config import load_params  # noqa: E402
from ars_opd.evaluation import multi_teacher  # noqa: E402

ARITH, WORDS = ("add", "sort_digits", "length"), ("reverse", "uppercase")
TEACHERS = {
    "named": [
        {"name": "arith", "source": "builtin", "tasks": list(ARITH)},
        {"name": "words", "source": "builtin", "tasks": list(WORDS)},
        {"name": "general", "source": "teacher"},
    ],
    "route_by": "task",
    "route": {**{t: "arith" for t in ARITH}, **{t: "words" for t in WORDS}},
    "default": None,
}
# what the arms' runs read from the start (linked, never written)
SHARED = ("models_dir", "subset_train", "subset_eval", "teacher_dir", "distill_init", "sft_model", "sft_log")
ARM_OUTPUTS = ("opd_model", "opd_log")


def study_params(args) -> dict:
    """The start's params: the workspace's with the study's teachers and budgets."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    teachers = json.loads(json.dumps(TEACHERS))
    for t in teachers["named"]:
        if t["source"] == "builtin":  # the specialists: each its own training length
            t["steps"] = args.specialist_steps
    sets = [
        ("teachers", teachers),
        ("models.teacher_training.steps", args.teacher_steps),
        ("sft.steps", args.sft_steps),
        ("sft.snapshot_every", 0),
        ("ddp.workers", 1),
        ("ddp.threads_per_worker", args.threads),
        ("base.threads", args.threads),
        ("teacher_gen.server.threads", args.threads),
        ("evaluate.threads", args.threads),
        ("evaluate.curve_examples", args.curve_examples),
        ("opd.steps", args.steps),
        ("opd.snapshot_every", args.snapshot_every),
        ("opd.checkpoint_every", args.steps),
        *parse_set(args.set),
    ]
    for key, value in sets:
        set_dotted(params, key, value)
    return params


def write_run(root: Path, params: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (root / "inputs").exists():
        (root / "inputs").symlink_to(REPO / "inputs", target_is_directory=True)
    load_params(root / "params.yaml", base=root)  # every check a stage runs, before anything runs


def link_from(root: Path, source: Path, names: tuple[str, ...]) -> None:
    paths = load_params(root / "params.yaml", base=root, sections=("paths",)).paths
    src = load_params(source / "params.yaml", base=source, sections=("paths",)).paths
    for name in names:
        dst = root / getattr(paths, name)
        if dst.is_symlink() or dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to((source / getattr(src, name)).resolve(), target_is_directory=True)


def link_shared(root: Path, start: Path) -> None:
    paths = load_params(root / "params.yaml", base=root, sections=("paths",)).paths
    start_paths = load_params(start / "params.yaml", base=start, sections=("paths",)).paths
    for name in SHARED:
        link(root, getattr(paths, name), start / getattr(start_paths, name))


def link_start_as_control(root: Path, start: Path) -> None:
    """The evaluate stage scores a control arm beside OPD; this study compares OPD arms with each other and runs no
    control, so the control's slot holds the start itself (the SFT model and log: scored once, then read back from
    the score store)."""
    paths = load_params(root / "params.yaml", base=root, sections=("paths",)).paths
    src = load_params(start / "params.yaml", base=start, sections=("paths",)).paths
    for name, source in (("sft_continued_model", "sft_model"), ("sft_continued_log", "sft_log")):
        dst = root / getattr(paths, name)
        if not (dst.is_symlink() or dst.exists()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to((start / getattr(src, source)).resolve(), target_is_directory=True)


def arm_params(base: dict, arm: str, seed: int) -> dict:
    params = json.loads(json.dumps(base))
    set_dotted(params, "ddp.seed", seed)
    over = multi_teacher.ARMS[arm][2]
    if over["route"] is not None:
        set_dotted(params, "teachers.route", over["route"])
        set_dotted(params, "teachers.default", over["default"])
    return params


def run_study(args) -> dict:
    root = Path(args.root).resolve()
    runner = Runner(1, None)
    env = runner.env(root / "eval-cache")
    env["OMP_NUM_THREADS"] = str(args.threads)
    t0 = time.perf_counter()
    base = study_params(args)
    start = root / "start"
    write_run(start, base)
    for stage in ("models", "subset", "teacher_gen", "sft"):
        runner.stage(start, stage, env)
        if runner.failed:
            raise SystemExit(f"the start could not be made: {runner.failed}")
    start_s = time.perf_counter() - t0
    for seed in args.seeds:
        for arm in args.arms:
            run = root / f"seed-{seed}" / arm
            write_run(run, arm_params(base, arm, seed))
            link_shared(run, start)
            runner.stage(run, "opd", env)
            ev = root / f"seed-{seed}" / f"{arm}-eval"  # the specialists' route: the same reference for every arm
            write_run(ev, arm_params(base, multi_teacher.REFERENCE, seed))
            link_shared(ev, start)
            link_from(ev, run, ARM_OUTPUTS)
            link_start_as_control(ev, start)
            if (run, "opd") in runner.ran:
                (ev / f"{DONE}-evaluate").unlink(missing_ok=True)
            if finished(run, "opd"):
                runner.stage(ev, "evaluate", env)
    meta = {
        "command": " ".join(["python", "studies/multi_teacher.py", *sys.argv[1:]]),
        "seeds": args.seeds,
        "arms": args.arms,
        "steps": args.steps,
        "teacher_steps": args.teacher_steps,
        "specialist_steps": args.specialist_steps,
        "sft_steps": args.sft_steps,
        "threads": args.threads,
        "seconds": time.perf_counter() - t0,
        "start_seconds": start_s,
        "device": device_words(),
        "commit": git_commit(),
        "failed": runner.failed,
        "overrides": args.set,
    }
    (root / "study.json").write_text(json.dumps(meta, indent=1))
    return meta


def collect(root: Path) -> tuple[dict[int, dict[str, dict]], dict[int, dict], dict]:
    """({seed: {arm: evaluate metrics}}, {seed: the SFT start's values by half}, the study's record)."""
    meta = json.loads((root / "study.json").read_text())
    by_seed: dict[int, dict[str, dict]] = {}
    start: dict[int, dict] = {}
    for seed in meta["seeds"]:
        for arm in meta["arms"]:
            ev = root / f"seed-{seed}" / f"{arm}-eval"
            if not (ev / f"{DONE}-evaluate").exists():
                meta.setdefault("missing", []).append(f"seed-{seed}/{arm}")
                continue
            p = load_params(ev / "params.yaml", base=ev, sections=("paths",)).paths
            metrics = json.loads((ev / p.eval_metrics).read_text())
            by_seed.setdefault(seed, {})[arm] = metrics
            start[seed] = multi_teacher.final_values(metrics, "sft")
    return by_seed, start, meta


def teachers_record(root: Path) -> dict:
    """The teachers' own scores per task, from the start's models stage metrics."""
    start = root / "start"
    p = load_params(start / "params.yaml", base=start)
    m = json.loads((start / p.paths.models_metrics).read_text())
    per_task = {"general (every task)": m.get("teacher_exact_match_per_task", {})}
    for name, t in (m.get("teachers") or {}).items():
        per_task[f"{name} ({', '.join(t['tasks'])})"] = t["exact_match_per_task"]
    return {"params": f"{m.get('teacher_params', 0):,}", "per_task": per_task, "eval_examples": m.get("eval_examples")}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} minutes"


def stage_seconds(root: Path) -> float:
    """The seconds every finished stage under ``root`` took, from its marker: the study's cost however many times it
    was resumed (a resumed invocation's own wall time leaves out what an earlier one ran)."""
    total = 0.0
    for marker in root.rglob(f"{DONE}-*"):
        try:
            total += float(json.loads(marker.read_text())["seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return total


def write_report(root: Path, out: Path) -> dict:
    by_seed, start, meta = collect(root)
    if not by_seed:
        raise SystemExit(f"{root}: no arm has a finished evaluation")
    s = multi_teacher.summary(by_seed, start)
    p = load_params(root / "start" / "params.yaml", base=root / "start")
    meta_page = {
        **meta,
        "wall": (
            f"{_minutes(stage_seconds(root))} of stage time (each finished stage's own time, one at a time, "
            f"summed over every invocation; the last one ran {_minutes(meta['seconds'])})"
        ),
        "start_wall": "of which the start (three teachers, teacher_gen, SFT) "
        + _minutes(stage_seconds(root / "start")),
        "teachers": teachers_record(root),
        "setup": (
            f"{p.data.subset_size - p.data.eval_size} training prompts and {p.data.eval_size} held out "
            f"(`data.subset_size`, the five default tasks); SFT {p.sft.steps} steps; OPD {p.opd.steps} steps of "
            f"{p.opd.global_batch_size} rollouts (reverse KL over the full vocabulary, `opd` defaults otherwise), "
            f"one worker, {meta['threads']} thread(s); learning-curve snapshots every {p.opd.snapshot_every} steps "
            f"scored on the first {p.evaluate.curve_examples} held-out prompts. The control (`sft_continued`, more "
            "SFT on the specialists' completions) runs per seed too; its numbers are in each evaluation, not on this "
            "page's tables."
        ),
    }
    out.write_text(multi_teacher.render(s, meta_page))
    return {
        **s,
        "wall_seconds": meta["seconds"],
        "start_seconds": meta["start_seconds"],
        "missing": meta.get("missing"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--arms", nargs="+", default=list(multi_teacher.ARMS), choices=list(multi_teacher.ARMS))
    ap.add_argument("--steps", type=int, default=80, help="OPD steps of every arm (opd.steps)")
    ap.add_argument("--snapshot-every", type=int, default=40, help="learning-curve points (opd.snapshot_every)")
    ap.add_argument("--curve-examples", type=int, default=100, help="held-out prompts of each curve point")
    ap.add_argument(
        "--teacher-steps", type=int, default=1000, help="training steps of the single teacher (models.teacher)"
    )
    ap.add_argument(
        "--specialist-steps",
        type=int,
        default=500,
        help="training steps of each specialist (the two together: "
        "as many as the single teacher's at the default settings)",
    )
    ap.add_argument("--sft-steps", type=int, default=600, help="the start's SFT steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each stage process")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a params override for every run")
    ap.add_argument("--root", default="build/multi-teacher")
    ap.add_argument("--out", default="reports/multi_teacher.md")
    ap.add_argument("--report-only", action="store_true", help="write the page from a finished --root")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    if not args.report_only:
        meta = run_study(args)
        if meta["failed"]:
            print(f"failed: {meta['failed']}", file=sys.stderr)
    result = write_report(root, Path(args.out))
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
