"""The package as pip installs it (not editable): the wheel holds every module of the source tree, and a fresh
environment that has the wheel installed, and the editable checkout nowhere on its path, imports every
subpackage and runs the ``ars-opd`` console script.

The fresh environment is ``python -m venv --without-pip`` (seconds, no network), the wheel is installed into
it by this environment's pip (``pip --python``), and the dependencies (torch and all) come from this
environment's site-packages through a ``.pth`` file that holds only that directory's path. A path line in a
``.pth`` file is added to ``sys.path`` without processing the ``.pth`` files found there, so the editable
install's finder (``__editable__.ars_opd-*.pth``) never runs; the test asserts that ``ars_opd`` is imported
from the fresh environment all the same, so an editable checkout that leaked in would fail it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what the wheel is built from: pyproject.toml's readme and the package, nothing else
SOURCES = ("pyproject.toml", "README.md", "ars_opd")


def _source_modules() -> list[str]:
    """Every .py file of the package, relative to the repo root (ars_opd/lm/head.py, ...)."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "ars_opd").rglob("*.py") if "__pycache__" not in p.parts)


def _subpackages() -> list[str]:
    """Every package of the source tree by module name, found on disk: a new subpackage is covered as is."""
    return sorted(
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "ars_opd").rglob("__init__.py")
        if "__pycache__" not in p.parts
    )


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


def test_every_directory_of_the_package_is_a_regular_package():
    """pyproject.toml finds regular packages only: a directory of modules without __init__.py would be left
    out of the wheel (the editable install would still see it, so nothing else would notice)."""
    dirs = {p.parent for p in (REPO / "ars_opd").rglob("*.py") if "__pycache__" not in p.parts}
    assert [str(d.relative_to(REPO)) for d in sorted(dirs) if not (d / "__init__.py").exists()] == []


@pytest.mark.slow
def test_wheel_installs_a_complete_working_package(tmp_path):
    # build from a copy of the sources: the build writes build/ and *.egg-info next to them, which must not
    # land in the shared working tree
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    pip = [sys.executable, "-m", "pip"]
    _run(
        pip
        + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
        tmp_path,
        env,
    )
    (wheel,) = (tmp_path / "dist").glob("ars_opd-*.whl")
    with zipfile.ZipFile(wheel) as z:
        packaged = sorted(n for n in z.namelist() if n.startswith("ars_opd/") and n.endswith(".py"))
    assert packaged == _source_modules()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    _run(
        pip + ["--python", str(python), "install", "--no-deps", "--no-index", "--no-compile", "-q", str(wheel)],
        tmp_path,
        env,
    )
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env
        ).stdout.strip()
    )
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # this environment's
    (site / "ars_opd_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))

    # -P: the working directory is not put on sys.path (run from tmp_path anyway)
    probe = (
        "import importlib, json, sys; mods = {n: importlib.import_module(n).__file__ for n in sys.argv[1:]}; "
        "print(json.dumps({'files': mods, 'editable': [m for m in sys.modules if m.startswith('__editable__')]}))"
    )
    found = json.loads(_run([str(python), "-P", "-c", probe, *_subpackages()], tmp_path, env).stdout)
    assert found["editable"] == []
    assert set(found["files"]) == set(_subpackages()) and "ars_opd.training" in found["files"]
    for name, file in found["files"].items():
        assert Path(file).resolve().is_relative_to(site.resolve()), (name, file)

    # the console script, from the repo root as a user runs it: it finds ./params.yaml (the CLI's default) and
    # imports the installed package (a script's sys.path starts at its own bin/, not at the working directory)
    shown = json.loads(_run([str(venv / "bin" / "ars-opd"), "params"], REPO, env).stdout)
    from ars_opd.config import load_params, to_dict

    assert shown == json.loads(json.dumps(to_dict(load_params(REPO / "params.yaml"))))
