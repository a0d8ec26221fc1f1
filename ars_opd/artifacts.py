"""Writing stage outputs: all or nothing, JSON Lines with ``\\n`` endings, provenance beside artifacts.

A stage that fails halfway must not leave files that look finished (DVC would not cache them, but a
user or a later stage could read them). Outputs are therefore written to temporary siblings and renamed
into place only when every one of them is complete; a failure removes the temporaries.

Provenance deliberately holds no timestamps and no git commit: outputs of the same inputs stay
byte-identical, so DVC sees an unchanged output and downstream stages stay cached.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Iterator

_TRACKED_PACKAGES = ("torch", "transformers", "tokenizers", "datasets", "accelerate", "openai", "dvc", "ars-opd")


def provenance(config: dict[str, Any]) -> dict[str, Any]:
    """Resolved config plus the versions of Python and the libraries that shape the result."""
    versions = {"python": platform.python_version()}
    for name in _TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"config": config, "versions": versions}


def dumps_canonical(obj: Any) -> str:
    """Canonical JSON: sorted keys, fixed separators, UTF-8 kept (the form hashed for cache keys)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _hash_file(h, path: Path) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes, read in blocks."""
    import hashlib

    h = hashlib.sha256()
    _hash_file(h, Path(path))
    return h.hexdigest()


def files_sha256(directory: str | Path, suffixes: tuple[str, ...]) -> tuple[str, int]:
    """One sha256 over the files under ``directory`` with these suffixes (relative name, then bytes, in
    sorted order), and how many files went in."""
    import hashlib

    directory = Path(directory)
    h = hashlib.sha256()
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in suffixes)
    for p in files:
        h.update(str(p.relative_to(directory)).encode())
        _hash_file(h, p)
    return h.hexdigest(), len(files)


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSON Lines file written by a stage; a malformed line is an error naming file and line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return rows


@contextlib.contextmanager
def atomic_outputs(*targets: str | Path) -> Iterator[list[Path]]:
    """Yield temporary paths for ``targets``; move them all into place only if the block succeeds.

    Targets may be files or directories (whatever the block writes at the temporary path). Existing
    targets are replaced. Parent directories are created.
    """
    temps: list[Path] = []
    try:
        for t in targets:
            t = Path(t)
            t.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f".{t.name}.", suffix=".tmp", dir=t.parent)
            os.close(fd)
            os.unlink(name)  # the block creates a file or a directory here
            temps.append(Path(name))
        yield temps
        for tmp, t in zip(temps, targets):
            if not tmp.exists():
                raise FileNotFoundError(f"stage wrote nothing for {t}")
        for tmp, t in zip(temps, targets):
            t = Path(t)
            if t.is_dir() and not t.is_symlink():
                shutil.rmtree(t)
            elif t.exists() or t.is_symlink():
                t.unlink()
            os.replace(tmp, t)
    finally:
        for tmp in temps:
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            elif tmp.exists():
                tmp.unlink()
