"""Writing stage outputs: all or nothing, JSON Lines with ``\\n`` endings, provenance beside artifacts.

A stage that fails halfway must not leave files that look finished (DVC would not cache them, but a
user or a later stage could read them). Outputs are therefore written to temporary siblings and renamed
into place only when every one of them is complete; a failure removes the temporaries.

JSON Lines are read by one routine, ``iter_jsonl``, which splits on ``b"\\n"`` only. ``str.splitlines()``
and Python's universal-newline text mode also break lines at characters that JSON writes raw inside
strings with ``ensure_ascii=False`` (U+2028, U+2029, U+0085, and ``\\r`` in text mode), which would turn
one valid row into several invalid ones.

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


def listed_files(directory: str | Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """The files under ``directory`` (recursively, sorted) whose suffix is in ``suffixes`` (None: every file)."""
    return sorted(p for p in Path(directory).rglob("*") if p.is_file() and (suffixes is None or p.suffix in suffixes))


def files_sha256(directory: str | Path, suffixes: tuple[str, ...] | None) -> tuple[str, int]:
    """One sha256 over the files under ``directory`` with these suffixes (None: all files; relative name,
    then bytes, in sorted order), and how many files went in."""
    import hashlib

    directory = Path(directory)
    h = hashlib.sha256()
    files = listed_files(directory, suffixes)
    for p in files:
        h.update(str(p.relative_to(directory)).encode())
        _hash_file(h, p)
    return h.hexdigest(), len(files)


def code_fingerprint() -> str:
    """sha256 over this package's Python sources (relative names and bytes, sorted): what a stored result keyed
    by it was computed with (checkpoints, the evaluate stage's stored scores)."""
    return files_sha256(Path(__file__).resolve().parent, (".py",))[0]


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


class JsonlLineError(ValueError):
    """One line of a JSON Lines file that is not valid UTF-8 JSON (``lineno`` counts from 1)."""

    def __init__(self, lineno: int, message: str, text: str):
        super().__init__(f"line {lineno}: {message}")
        self.lineno, self.message, self.text = lineno, message, text


def iter_jsonl(data: bytes) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line of JSON Lines ``data``, split on ``b"\\n"`` only.

    A line that is not valid JSON or not valid UTF-8 yields a ``JsonlLineError`` as its value, so each
    caller decides whether that is fatal, a counted malformed row or a reported problem. A UTF-8 byte
    order mark and a ``\\r`` before the ``\\n`` (Windows line endings) are accepted.
    """
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield (
                lineno,
                JsonlLineError(lineno, f"not valid UTF-8 (byte {e.start})", raw[:80].decode("utf-8", "replace")),
            )
            continue
        try:
            yield lineno, json.loads(text)
        except json.JSONDecodeError as e:
            yield lineno, JsonlLineError(lineno, f"not valid JSON ({e.msg})", text[:80])


def read_jsonl(path: str | Path) -> list[Any]:
    """Read a JSON Lines file written by a stage; a malformed line is an error naming file and line."""
    rows = []
    for _, value in iter_jsonl(Path(path).read_bytes()):
        if isinstance(value, JsonlLineError):
            raise ValueError(f"{path}:{value.lineno}: {value.message}") from None
        rows.append(value)
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
