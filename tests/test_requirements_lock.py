"""requirements.lock is what make setup installs requirements.txt under (uv, constrained to pip's resolution): a pin
of requirements.txt that the lock lacks or names at another version would make uv refuse, or install another
environment than the one the lock records, so the two are checked against each other here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s#;]+)")


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return out


def test_every_requirement_is_in_the_lock_at_its_pinned_version():
    wanted, locked = _pins(REPO / "requirements.txt"), _pins(REPO / "requirements.lock")
    assert wanted and len(locked) > len(wanted)
    for name, version in wanted.items():
        # the lock is a pip freeze: a local build carries its tag (torch 2.13.0+cpu for requirements' 2.13.0)
        assert name in locked, f"requirements.lock lacks {name} (regenerate it: its header says how)"
        assert locked[name].split("+")[0] == version, f"{name}: requirements.txt {version}, lock {locked[name]}"


def test_the_lock_pins_the_cpu_torch():
    """A lock without the +cpu tag would let uv take PyPI's torch, a multi-GB CUDA build."""
    assert _pins(REPO / "requirements.lock")["torch"].endswith("+cpu")


def test_the_lock_holds_only_exact_pins():
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert PIN.match(line), f"requirements.lock: not an exact pin: {line!r}"
