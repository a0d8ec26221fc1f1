"""dvc.yaml consistency, and `dvc repro` of the real stages in a temporary git copy of the repo."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import yaml

from micro import repo_copy, run_in, write_micro_params

REPO = Path(__file__).resolve().parents[1]


def _module_file(name: str) -> Path | None:
    """The file behind an ars_opd module or package name, or None (e.g. a function imported by name)."""
    base = REPO / name.replace(".", "/")
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            return file
    return None


def _type_checking_only(node: ast.AST) -> bool:
    """An ``if TYPE_CHECKING:`` block: imports for annotations alone, never run, so no output depends on them."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_nodes(tree: ast.AST):
    """Every node of ``tree`` but those inside ``if TYPE_CHECKING:`` blocks (their ``else`` runs and is kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _ars_imports(path: Path, seen: set[str]) -> set[str]:
    """ars_opd files imported (transitively, at any depth in the file, packages' __init__ included) by a
    Python file, as paths relative to the repo."""
    tree = ast.parse(path.read_text())
    for node in _run_time_nodes(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ars_opd"):
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("ars_opd")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ars_opd."):
            # a module started as a subprocess (python -m ars_opd.x): for a package, its __main__ runs
            names = [node.value, f"{node.value}.__main__"]
        for name in names:
            parts = name.split(".")
            for k in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__ and a/b/c
                file = _module_file(".".join(parts[:k]))
                rel = file and str(file.relative_to(REPO))
                if rel and rel not in seen:
                    seen.add(rel)
                    _ars_imports(file, seen)
    return seen


def test_each_stage_lists_exactly_the_library_modules_it_imports():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        entry = REPO / "stages" / f"{name}.py"
        assert stage["cmd"] == f"python -m stages.{name}"  # -m: the repo root (not site-packages) provides ars_opd
        imported = _ars_imports(entry, set())
        listed = {d for d in stage["deps"] if d.startswith("ars_opd/")}
        assert listed == imported, f"stage {name}: missing {imported - listed}, extra {listed - imported}"
        assert f"stages/{name}.py" in stage["deps"]


def test_stage_files_run_nothing_on_import():
    # stages/__init__.py is the exception by design: it checks the interpreter before any stage imports
    for entry in sorted(p for p in (REPO / "stages").glob("*.py") if p.name != "__init__.py"):
        tree = ast.parse(entry.read_text())
        for node in tree.body:
            assert isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.If, ast.Expr)), (
                f"{entry.name}: top-level {type(node).__name__} runs on import"
            )


def test_paths_are_written_once():
    """dvc.yaml takes every output path from params.yaml; no literal data/ path in dvc.yaml or code."""
    text = (REPO / "dvc.yaml").read_text()
    assert not re.search(r"(?<![\w/])data/", text.replace("# ", ""))  # ars_opd/data/ is the data package
    for py in list((REPO / "ars_opd").rglob("*.py")) + list((REPO / "stages").glob("*.py")):
        if py.name == "config.py":
            continue
        assert '"data/' not in py.read_text(), py


def test_the_control_stage_depends_on_opds_loop_and_nothing_else_of_opd():
    """sft_continued runs OPD's loop (continued_sft_config: the TrainLoopConfig fields of ``opd``) on SFT's data.
    dvc must rerun it when any of those fields changes (a missing one would leave a stale control) and only
    then (an OPD-only knob such as beta must not cost a control run)."""
    import dataclasses

    from ars_opd.config import OPDConfig, SFTConfig, TrainLoopConfig
    from ars_opd.training.worker import continued_sft_config

    params = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["sft_continued"]["params"]
    assert "opd" not in params
    listed = {p.removeprefix("opd.") for p in params if isinstance(p, str) and p.startswith("opd.")}
    assert listed == {f.name for f in dataclasses.fields(TrainLoopConfig)}
    sft, opd = SFTConfig(), OPDConfig()
    other = dataclasses.replace(
        opd, beta=0.0, sample_temperature=0.7, on_policy_fraction=0.5, loss_normalisation="sequence", temperature=2.0
    )
    assert continued_sft_config(sft, other) == continued_sft_config(sft, opd)
    for f in dataclasses.fields(TrainLoopConfig):  # and each loop field reaches it
        value = getattr(opd, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a Literal (nonfinite, precision) or None: the equality of the two field lists covers it
        changed = value + 1 if isinstance(value, int) else value * 0.5 + 1e-3
        assert getattr(continued_sft_config(sft, dataclasses.replace(opd, **{f.name: changed})), f.name) == changed


@pytest.mark.slow
@pytest.mark.ddp
def test_dvc_repro_whole_pipeline_then_noop_then_check(tmp_path):
    """The real stages through `dvc repro` on the micro config, in a temporary git copy of the repo."""
    work = repo_copy(tmp_path / "repo")
    write_micro_params(REPO, work / "params.yaml")
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci", "commit", "-qm", "micro"],
    ):
        assert run_in(cmd, work).returncode == 0
    dvc = str(Path(sys.executable).parent / "dvc")
    first = run_in([dvc, "repro"], work)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    stages = yaml.safe_load((work / "dvc.yaml").read_text())["stages"]
    for name in stages:
        assert f"Running stage '{name}'" in first.stdout, name
    paths = yaml.safe_load((work / "params.yaml").read_text())["paths"]
    stats = json.loads((work / paths["subset_stats"]).read_text())
    assert (stats["train"], stats["eval"]) == (50, 10)
    assert len((work / paths["subset_train"]).read_text().splitlines()) == 50
    assert (work / "dvc.lock").is_file()
    report = (work / paths["report_md"]).read_text()
    assert "## Did distillation work?" in report and "### sft: 6 steps, 2 workers" in report

    check = run_in([sys.executable, "-m", "ars_opd.cli", "check"], work)
    assert check.returncode == 0, check.stderr
    _teacher_data_cost_adds_up(work, yaml.safe_load((work / "params.yaml").read_text()))

    t0 = time.perf_counter()
    again = run_in([dvc, "repro"], work)
    elapsed = time.perf_counter() - t0
    assert again.returncode == 0, again.stderr
    assert "Running stage" not in again.stdout and "didn't change, skipping" in again.stdout
    assert elapsed < 60

    # an identical retrain of sft (no checkpoint to resume from) writes the same model and the same
    # timing-free log, so nothing downstream reruns
    shutil.rmtree(work / paths["sft_checkpoints"])
    retrain = run_in([dvc, "repro", "-f", "sft"], work)
    assert retrain.returncode == 0 and "Running stage 'sft'" in retrain.stdout, retrain.stderr
    status = run_in([dvc, "status"], work)
    assert status.returncode == 0 and "Data and pipelines are up to date" in status.stdout, status.stdout

    # a params change reruns only the stages that read it (and what depends on their outputs)
    text = (work / "params.yaml").read_text().replace("window: 4", "window: 5")
    (work / "params.yaml").write_text(text)
    third = run_in([dvc, "repro"], work)
    assert third.returncode == 0, third.stderr
    assert "Running stage 'report'" in third.stdout and "Running stage 'sft'" not in third.stdout

    # the check catches damaged outputs, naming each problem
    metrics = work / paths["eval_metrics"]
    m = json.loads(metrics.read_text())
    m["opd"]["reverse_kl"] = float("nan")
    metrics.write_text(json.dumps(m))
    (work / paths["teacher_dir"] / "failures.jsonl").unlink()
    steps = work / paths["sft_log"] / "steps.jsonl"
    steps.write_bytes(steps.read_bytes()[:-40])  # a torn last line
    bad = run_in([sys.executable, "-m", "ars_opd.cli", "check"], work)
    assert bad.returncode == 1
    assert "opd.reverse_kl: not finite (nan)" in bad.stderr
    assert "failures.jsonl: missing" in bad.stderr
    assert "steps.jsonl: last line has no newline" in bad.stderr and "steps.jsonl:6: not valid JSON" in bad.stderr


def _teacher_data_cost_adds_up(work: Path, params: dict) -> None:
    """The teacher's data cost of the micro run: the sft stage's budget holds, once per row its sampler drew
    (any rank, any step), the tokens the teacher generated for that row in teacher_gen's output (the
    completion, and EOS when it stopped); opd and the repeating control add nothing; the evaluation's third
    view adds 2·P_teacher FLOPs per such token, P_teacher counted from the teacher's weights file."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from ars_opd.evaluation.equal_budget import compare
    from ars_opd.seeding import derive_seed
    from ars_opd.training.batch_plan import BatchGeometry, step_indices

    paths, sft, ddp = params["paths"], params["sft"], params["ddp"]
    rows = [json.loads(line) for line in (work / paths["teacher_dir"] / "train.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(work / paths["models_dir"] / "tokenizer")
    tokens = [
        len(tok(r["completion"], add_special_tokens=False)["input_ids"]) + (r["finish_reason"] == "stop") for r in rows
    ]
    geometry = BatchGeometry.check(sft["global_batch_size"], ddp["workers"], sft["micro_batch_size"], "sft")
    seed = derive_seed(ddp["seed"], "sft")  # scenario S1-1: every rank's sampler seed is the stage seed
    drawn = {
        i
        for step in range(sft["steps"])
        for r in range(ddp["workers"])
        for i in step_indices(step, len(rows), geometry, seed, r)
    }
    budget = {
        s: json.loads((work / paths[f"{s}_model"] / "budget.json").read_text()) for s in ("sft", "opd", "sft_continued")
    }
    assert budget["sft"]["teacher_tokens"] == sum(tokens[i] for i in drawn) > 0
    assert (
        budget["opd"]["teacher_tokens"] == budget["sft_continued"]["teacher_tokens"] == budget["sft"]["teacher_tokens"]
    )
    ev = json.loads((work / paths["eval_metrics"]).read_text())
    teacher = load_file(str(work / paths["models_dir"] / "teacher" / "model.safetensors"))
    assert ev["teacher"]["matmul_parameters"] == sum(v.numel() for v in teacher.values())  # tied head: stored once
    cmp = compare(ev)
    extra = 2 * ev["teacher"]["matmul_parameters"] * budget["sft"]["teacher_tokens"]
    assert cmp["equal_total_flops"]["flops"] == cmp["equal_flops"]["flops"] + extra  # both arms carry SFT's cost


def test_type_checking_imports_are_not_run_time_deps(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if TYPE_CHECKING:\n    from ars_opd.serving.server import app\n"
        "else:\n    from ars_opd import seeding\n"
        "if typing.TYPE_CHECKING:\n    import ars_opd.rollouts.engines\n"
        "def f():\n    from ars_opd import artifacts\n"
    )
    found = _ars_imports(src, set())
    assert "ars_opd/seeding.py" in found and "ars_opd/artifacts.py" in found
    assert not any(p.startswith(("ars_opd/teacher/", "ars_opd/rollouts/")) for p in found)
