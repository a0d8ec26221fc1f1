"""Profiles: named sets of params overrides (a YAML file of the sections and keys that differ from params.yaml),
run as a DVC experiment with ``dvc exp run -S key=value`` for each override.

Why not a second params file: DVC tracks the params of ``params.yaml`` alone, so a stage reading another file
would escape DVC's rerun rules and ``dvc exp show``; and editing params.yaml by hand loses the default. An
experiment applies the overrides to the workspace's params.yaml, DVC records them, ``dvc exp show`` compares the
run with the default, and ``git checkout params.yaml dvc.lock && dvc checkout`` returns to it.

A profile's keys nest as params.yaml's do. A mapping is followed key by key where params.yaml holds a mapping
there, and set whole where params.yaml holds a plain value (``models.student: {prune_from: teacher, ...}``
replaces ``builtin``). Values are written in the override grammar DVC uses (Hydra's): strings quoted, lists in
brackets, mappings in braces. Before anything runs, the merged params pass ``load_params`` (every check a stage
runs), so a bad profile fails in a second, naming the key.
"""

from __future__ import annotations

import copy
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

import yaml

from ars_opd.config import PARAMS_FILE, ConfigError, load_params, read_params_file


def read_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"profile {path} not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError("", f"profile {path}: top level must be a mapping of params sections")
    return dict(raw)


def merged(base: Mapping, profile: Mapping) -> dict:
    """params.yaml's mapping with the profile's values applied (as ``flatten``'s overrides do)."""
    out = copy.deepcopy(dict(base))
    for key, value in profile.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def render(value: Any) -> str:
    """``value`` in the override grammar of ``dvc exp run -S`` (Hydra's): what it parses back to ``value``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {render(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a params override")


def flatten(base: Mapping, profile: Mapping, prefix: str = "") -> list[str]:
    """The ``key=value`` overrides that turn ``base`` into ``merged(base, profile)``."""
    out = []
    for key, value in profile.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            out += flatten(base[key], value, f"{name}.")
        else:
            out.append(f"{name}={render(value)}")
    return out


def profile_overrides(profile_path: str | Path, params_path: str | Path = PARAMS_FILE) -> list[str]:
    """The profile's overrides of ``params_path``, after checking that the merged params are valid."""
    base = read_params_file(params_path)
    profile = read_profile(profile_path)
    with tempfile.NamedTemporaryFile("w", prefix="profile-check-", suffix=".yaml") as check:
        check.write(yaml.safe_dump(merged(base, profile), sort_keys=False))
        check.flush()
        # relative paths in the params (local sources) start at params.yaml's directory
        load_params(check.name, base=Path(params_path).resolve().parent)
    return flatten(base, profile)


def run_profile(profile_path: str | Path, name: str | None, extra: list[str]) -> int:
    """``dvc exp run [-n name] -S ... [extra]`` in this directory; returns dvc's exit status."""
    cmd = ["dvc", "exp", "run"] + (["-n", name] if name else [])
    for override in profile_overrides(profile_path):
        cmd += ["-S", override]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd + list(extra)).returncode
