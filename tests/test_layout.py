"""The library's layout, read from its imports: every import points down (or within its own package), the
bundled server and the code that starts or talks to a server never import each other, and no module imports
another's private name.

A floor lists the modules that may import one another and anything below; a package's floor holds all its
modules. What is tested here is what ``import`` statements (at any depth in a file) say, as the dvc deps
test reads them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# lowest first
FLOORS = (
    (
        "ars_opd",
        "ars_opd.config",
        "ars_opd.artifacts",
        "ars_opd.seeding",
        "ars_opd.profiles",
        "ars_opd.resources",
        "ars_opd.params_reference",  # reads config.py and params.yaml only
        "ars_opd.student_t",  # plain math: the detector (training) and the intervals (evaluation) share it
    ),
    ("ars_opd.data",),
    ("ars_opd.lm",),
    ("ars_opd.models",),
    ("ars_opd.serving",),  # serves any model: the teacher's client and the rollout engine start it from above
    ("ars_opd.teacher",),
    ("ars_opd.rollouts",),
    ("ars_opd.training",),
    ("ars_opd.evaluation", "ars_opd.checks"),  # both read the stages' outputs (checks: the engine's log too)
    ("ars_opd.cli",),
)
SERVER = "ars_opd.serving.server"  # the bundled server, run as its own process
# what starts a server (the launchers: the rest of ars_opd.serving) or talks to one as a teacher
CLIENTS = ("ars_opd.serving", "ars_opd.teacher.client")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _floor(module: str) -> int:
    best = None
    for i, floor in enumerate(FLOORS):
        for prefix in floor:
            if (module == prefix or module.startswith(prefix + ".")) and prefix != "ars_opd":
                best = i
    if best is None and module == "ars_opd":
        return 0
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


def _imports(path: Path):
    """(imported module, names taken from it, line) for each ars_opd import of a file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ars_opd"):
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("ars_opd"):
                    yield a.name, [], node.lineno


def _library_files():
    return sorted((REPO / "ars_opd").rglob("*.py"))


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _side(module: str) -> str | None:
    """``server`` for the bundled server's modules, ``client`` for those that start a server (the launchers) or
    talk to a teacher's, None for the rest (the serving package's own ``__init__`` included)."""
    if _within(module, SERVER):
        return "server"
    if any(module.startswith(c + ".") for c in CLIENTS):
        return "client"
    return None


def test_every_import_points_down_or_within_its_package():
    up = []
    for path in _library_files():
        here = _module_name(path)
        for module, names, line in _imports(path):
            # ``from ars_opd.pkg import mod`` imports the module pkg.mod
            targets = [
                f"{module}.{n}"
                if (REPO / Path(*f"{module}.{n}".split("."))).with_suffix(".py").exists()
                or (REPO / Path(*f"{module}.{n}".split(".")) / "__init__.py").exists()
                else module
                for n in names
            ] or [module]
            for target in targets:
                if _floor(target) > _floor(here):
                    up.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not up, "imports that run back up a floor:\n" + "\n".join(sorted(set(up)))


def test_the_server_and_what_starts_or_talks_to_it_never_import_each_other():
    """A launcher names the server by its module path on a command line; the server runs without them."""
    crossing = []
    sides = {}
    for path in _library_files():
        here = _side(_module_name(path))
        sides.setdefault(here, []).append(_module_name(path))
        for module, _, line in _imports(path):
            there = _side(module)
            if here and there and here != there:
                crossing.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not crossing, "\n".join(crossing)
    # both sides are there to keep apart: the server's app and the launchers that start it beside the teacher's client
    assert f"{SERVER}.app" in sides["server"]
    assert {"ars_opd.serving.local_server", "ars_opd.serving.vllm_server", "ars_opd.teacher.client.chat"} <= set(
        sides["client"]
    )
    assert not list((REPO / "ars_opd" / "teacher").rglob("server/*.py"))  # what is served is not only a teacher


def test_no_module_imports_another_modules_private_name():
    private = []
    for path in _library_files() + sorted((REPO / "stages").glob("*.py")):
        for module, names, line in _imports(path):
            private += [
                f"{path.relative_to(REPO)}:{line} takes {n} from {module}"
                for n in names
                if n.startswith("_") and not n.startswith("__")
            ]
    assert not private, "\n".join(private)


def test_the_floors_cover_every_library_module():
    for path in _library_files():
        _floor(_module_name(path))  # raises for a module on no floor


def test_benchmarks_and_studies_import_nothing_from_the_tests():
    """A benchmark or a study is run on its own (``python -m bench.x``, ``python studies/x.py``): it may use the
    library and its siblings, never the test suite's helpers, which are not part of what a user runs."""
    helpers = {p.stem for p in (REPO / "tests").glob("*.py")}
    found = []
    for path in sorted([*(REPO / "bench").glob("*.py"), *(REPO / "studies").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                top = name.split(".")[0]
                if top == "tests" or top in helpers:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)


def test_every_study_is_in_the_studies_index():
    """studies/README.md is where a user finds which study answers what: every script there names itself in it
    (``rollout_health.py`` once went missing)."""
    index = (REPO / "studies" / "README.md").read_text()
    scripts = [p.name for p in sorted((REPO / "studies").iterdir()) if p.suffix in (".py", ".sh")]
    assert len(scripts) > 10
    missing = [name for name in scripts if f"`{name}`" not in index]
    assert not missing, missing


def _dvc_stages() -> dict:
    import yaml

    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_the_training_stages_are_listed_once_and_dvc_yaml_agrees():
    """``ars_opd.config.TRAINING_STAGES`` is the one list: the training stages of dvc.yaml (those that keep
    resumable checkpoints, ``${paths.<stage>_checkpoints}``) are it, in pipeline order, each run as
    ``python -m stages.<stage>``; the lists of checks, evaluation and stages/ are derived from it."""
    from ars_opd import checks
    from ars_opd.config import TRAINING_STAGES
    from ars_opd.evaluation import arms

    stages = _dvc_stages()
    assert set(TRAINING_STAGES) <= set(stages)
    outs = {
        name: [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]
        for name, stage in stages.items()
    }
    training = tuple(name for name, o in outs.items() if f"${{paths.{name}_checkpoints}}" in o)
    assert training == TRAINING_STAGES
    for name in TRAINING_STAGES:
        assert stages[name]["cmd"] == f"python -m stages.{name}"
        assert (REPO / "stages" / f"{name}.py").is_file()
    assert tuple(stages) == checks.STAGES  # every stage, in dvc.yaml's order
    assert arms.TRAINED == TRAINING_STAGES


def _parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> int:
    a = fn.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if in_class and names and names[0].arg in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


MAX_PARAMETERS = 6
NARROW = ("ars_opd/training", "ars_opd/serving/server")


def wide_functions(limit: int = MAX_PARAMETERS, roots: tuple[str, ...] = NARROW) -> list[str]:
    """``path:line name (n parameters)`` for every function of ``roots`` taking more than ``limit`` parameters
    (positional, keyword and keyword-only; ``*args`` and ``**kwargs`` one each; not ``self``/``cls``)."""
    found = []

    def visit(node, path, in_class):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _parameter_count(child, in_class)
                if n > limit:
                    found.append(f"{path.relative_to(REPO)}:{child.lineno} {child.name} ({n} parameters)")
                visit(child, path, False)
            elif isinstance(child, ast.ClassDef):
                visit(child, path, True)
            else:
                visit(child, path, in_class)

    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            visit(ast.parse(path.read_text()), path, False)
    return found


def test_no_engine_or_server_function_takes_more_than_six_parameters():
    """A wide signature is a value threaded by hand: the engine and the teacher's server pass records
    (``Trainer``, ``Checkpoints``, ``TrainingJob``, ``ServerOptions``) instead."""
    wide = wide_functions()
    assert not wide, f"functions over {MAX_PARAMETERS} parameters:\n" + "\n".join(wide)
