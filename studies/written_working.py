"""Does the teacher's bare-number arithmetic cost the student its sums? An intervention on the teacher's text.

In the cross-family study (docs/larger-teacher.md) the complete SmolLM2-135M-Instruct writes the operation out
("4 + 7 = 11") and is right on 22 of the 54 held-out sums and differences; after SFT on Qwen2.5-Coder-0.5B's
completions, which follow the prompts' "Answer with just the number", it answers with the bare number and is right
on 11. The reading was that the student copies the teacher's form without its skill. This study tests it by
changing only the form: the same teacher completions, with each arithmetic answer rewritten as the operation from
its prompt followed by the teacher's own number ("11" -> "4 + 7 = 11"; a wrong number stays wrong). Every other
row, the steps, the learning rate and the seed are the start's.

Arms, per training seed (``ddp.seed``; the start's own seed is the start's SFT itself, not trained again):

- ``teacher_text``: SFT on the teacher's completions as they are (the study's start);
- ``written_out``: SFT on the same completions with the arithmetic answers written out.

Each SFT model, and the base student as the reference the rewrite aims back at, answers the held-out sums and
differences greedily (``studies/natural_teacher.py``: the evaluate stage's prompts, generation and checker, on
these rows alone), and the study prints one JSON object: per model the number right and the number written
out, per seed the paired difference in points, and its mean with a t-interval over seeds. The positive control
is the instrument's: the base student against the start on the same prompts.

    python studies/written_working.py --start build/larger-teacher/start --root build/written-working --seeds 0 1 2

``--start``: a study start made by ``studies/cross_tokenizer.py --profile profiles/larger_teacher.yaml`` (its
models, subset, teacher completions and SFT). Each SFT run takes about 7 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "studies"))

import pruned_recovery as pr  # noqa: E402

from ars_opd.artifacts import read_jsonl, write_jsonl  # noqa: E402
from ars_opd.evaluation.stats import mean_ci  # noqa: E402

ARMS = ("teacher_text", "written_out")
OPERATIONS = {"nl_sum": "+", "nl_difference": "-"}
QUESTION = re.compile(r"What is (-?\d+) ([-+]) (-?\d+)\?")
INTEGER = re.compile(r"-?\d+")
WRITTEN = re.compile(r"-?\d+\s*[-+]\s*-?\d+\s*=")  # an answer that writes the operation out


def written_out(row: dict) -> tuple[dict, bool]:
    """``row`` (a teacher_gen output row) with its completion rewritten as the prompt's operation and the
    teacher's first integer, and whether it was rewritten: only arithmetic rows whose prompt names the operation
    and whose completion holds a number; the number is the teacher's, right or wrong."""
    if row.get("task") not in OPERATIONS:
        return row, False
    question = QUESTION.search(row["messages"][-1]["content"])
    number = INTEGER.search(row["completion"])
    if question is None or number is None:
        return row, False
    a, op, b = question.groups()
    return {**row, "completion": f"{a} {op} {b} = {number.group()}"}, True


def write_teacher(source: Path, dest: Path) -> dict:
    """The teacher directory ``source`` (teacher_gen's ``<split>.jsonl`` files) written to ``dest`` with every
    arithmetic completion written out; returns per split how many rows were rewritten of how many arithmetic."""
    dest.mkdir(parents=True, exist_ok=True)
    counts = {}
    for path in sorted(source.glob("*.jsonl")):
        rows, rewritten, arithmetic = [], 0, 0
        for row in read_jsonl(path):
            new, changed = written_out(row)
            rows.append(new)
            arithmetic += row.get("task") in OPERATIONS
            rewritten += changed
        write_jsonl(dest / path.name, rows)
        counts[path.stem] = {"rewritten": rewritten, "arithmetic": arithmetic, "rows": len(rows)}
    return counts


def prepare(start: Path, root: Path, seeds: list[int]) -> tuple[list[tuple[int, str, Path]], dict]:
    """A run directory per seed and arm with its params (the start's, ``ddp.seed`` set) and links to the start's
    models and subset and to the teacher text of its arm; the start's own seed links the start's SFT model."""
    params = pr.read_params_file(start / "params.yaml")
    paths = pr.load_params(start / "params.yaml", base=start, sections=("paths",)).paths
    counts = write_teacher(start / paths.teacher_dir, root / "written_teacher")
    start_seed = (params.get("ddp") or {}).get("seed", 0)
    runs = []
    for seed in seeds:
        for arm in ARMS:
            run = root / f"seed-{seed}" / arm
            run.mkdir(parents=True, exist_ok=True)
            mine = json.loads(json.dumps(params))
            pr.set_dotted(mine, "ddp.seed", seed)
            (run / "params.yaml").write_text(yaml.safe_dump(mine, sort_keys=False))
            if not (run / "inputs").exists():
                (run / "inputs").symlink_to(start / "inputs", target_is_directory=True)
            for name in ("models_dir", "subset_train", "subset_eval"):
                pr.link(run, getattr(paths, name), start / getattr(paths, name))
            teacher = start / paths.teacher_dir if arm == "teacher_text" else root / "written_teacher"
            pr.link(run, paths.teacher_dir, teacher)
            if arm == "teacher_text" and seed == start_seed:
                pr.link(run, paths.sft_model, start / paths.sft_model)
            runs.append((seed, arm, run))
    return runs, {"rewritten": counts, "start_seed": start_seed}


def score(model: Path, rows: Path, answers: Path, max_new_tokens: int, threads: int) -> dict:
    """Greedy answers of ``model`` on ``rows`` through natural_teacher.py; right and written-out counts."""
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "studies" / "natural_teacher.py"),
            "--model",
            str(model),
            "--rows",
            str(rows),
            "--max-new-tokens",
            str(max_new_tokens),
            "--threads",
            str(threads),
            "--answers",
            str(answers),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)),
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    given = list(read_jsonl(answers))
    return {
        "correct": result["correct"],
        "n": result["examples"],
        "written_out": sum(bool(WRITTEN.search(a["answer"])) for a in given),
        "per_kind": result["per_kind"],
    }


def summary(scores: dict, seeds: list[int]) -> dict:
    """Per seed the paired difference written_out − teacher_text in points, and its mean and t-interval."""
    diffs = []
    for s in seeds:
        a, b = scores[f"seed-{s}/written_out"], scores[f"seed-{s}/teacher_text"]
        diffs.append(100 * (a["correct"] / a["n"] - b["correct"] / b["n"]))
    m, lo, hi = mean_ci(diffs)
    base, start = scores["base"], scores[f"seed-{seeds[0]}/teacher_text"]
    return {
        "written_out_minus_teacher_text_points": {"per_seed": diffs, "mean": m, "ci95": [lo, hi], "n": len(diffs)},
        "positive_control_base_minus_start_points": 100 * (base["correct"] / base["n"] - start["correct"] / start["n"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", required=True, help="a study start (studies/cross_tokenizer.py --prepare's start/)")
    ap.add_argument("--root", default="build/written-working")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    start, root = Path(args.start).resolve(), Path(args.root).resolve()
    runs, meta = prepare(start, root, args.seeds)
    runner = pr.Runner(1, None)
    env = runner.env(root / "eval-cache")
    for _, _, run in runs:
        if not (run / pr.load_params(run / "params.yaml", base=run, sections=("paths",)).paths.sft_model).is_symlink():
            runner.stage(run, "sft", env)
    if runner.failed:
        raise SystemExit(f"SFT failed: {runner.failed}")
    paths = pr.load_params(start / "params.yaml", base=start, sections=("paths",)).paths
    max_new_tokens = pr.load_params(start / "params.yaml", base=start, sections=("evaluate",)).evaluate.max_new_tokens
    rows = root / "arithmetic_eval.jsonl"
    write_jsonl(rows, [r for r in read_jsonl(start / paths.subset_eval) if r.get("task") in OPERATIONS])
    scores = {
        "base": score(
            start / paths.models_dir / "student", rows, root / "base.answers.jsonl", max_new_tokens, args.threads
        )
    }
    for seed, arm, run in runs:
        model = run / paths.sft_model
        scores[f"seed-{seed}/{arm}"] = score(
            model, rows, run / "arithmetic.answers.jsonl", max_new_tokens, args.threads
        )
    result = {"start": str(start), "seeds": args.seeds, **meta, "scores": scores, **summary(scores, args.seeds)}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
