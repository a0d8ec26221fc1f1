"""The teacher-answer cache: append-only JSON Lines keyed by sha256, safe across crashes and reruns.

One JSON object per line, ``\\n``-terminated: ``{"key", "request", "response", ...}``. The same class keeps
the teacher_gen stage's refusals (``{"key", "request", "failure"}``: requests whose failure a rerun cannot
change), in a file of their own, so the answer cache holds answers only. Each answer is
appended and flushed as it arrives, and fsynced at intervals (``fsync_every`` records or
``fsync_interval_s`` seconds, and on close), so a crash loses at most the answers since the last fsync
of an OS crash, and nothing but a torn final line of a process crash. On open, a torn last line (no
newline, or not valid JSON) is detected, reported and cut off; an invalid line elsewhere means the file
was damaged otherwise and is an error naming the line.

With ``sorted_on_close``, closing rewrites the file in key order (a new file renamed over the old one, so a
crash mid-way leaves the old file whole; a rewrite that fails leaves it in arrival order, said on stderr):
answers arrive in the order asynchronous requests complete, and without it two identical runs write the same
lines in another order, so a pipeline that hashes the file (DVC) would see a change where there is none. The
lock is on the file opened, so an opener that locked a file since renamed over opens the path again.

Duplicates are impossible: keys already present are never appended again (the cache is the single
writer, guarded by an exclusive ``flock`` so two runs cannot interleave on one file), and a file that
somehow holds a key twice keeps the first answer.

The key is the sha256 of canonical JSON (sorted keys, fixed separators) of everything that determines the
answer: model name and revision, messages (system prompt included), sampling parameters. Secrets never
enter it, nor anything else in the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ars_opd.artifacts import dumps_canonical

OPEN_ATTEMPTS = 10
SORTING_SUFFIX = ".sorting"  # sorted_on_close's new file, renamed over the cache (git-ignored)


class CacheCorruptError(RuntimeError):
    """A line other than the last is not valid JSON: the file was damaged by something else than a crash."""


class CacheLockedError(RuntimeError):
    """Another process holds the cache open for writing."""


def cache_key(request: dict[str, Any]) -> str:
    """sha256 hex of the canonical JSON of ``request`` (everything that determines the answer)."""
    return hashlib.sha256(dumps_canonical(request).encode("utf-8")).hexdigest()


class TeacherCache:
    """Append-only answer cache; use as a context manager (holds the file lock while open)."""

    def __init__(
        self, path: str | Path, fsync_every: int = 64, fsync_interval_s: float = 2.0, sorted_on_close: bool = False
    ):
        self.path = Path(path)
        self.fsync_every, self.fsync_interval_s = fsync_every, fsync_interval_s
        self.sorted_on_close = sorted_on_close
        self._entries: dict[str, dict] = {}
        self._file = None
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self.dropped_torn_line = False
        self.duplicate_lines = 0
        self._appended = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def open(self) -> "TeacherCache":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(OPEN_ATTEMPTS):
            f = open(self.path, "a+b")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                raise CacheLockedError(
                    f"{self.path} is in use by another process (is another teacher_gen running?)"
                ) from None
            # a writer that sorted on close renamed a new file over the one opened here before unlocking it: the
            # lock is on a file no longer at the path, so open the path again
            if _same_file(f, self.path):
                break
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            f.close()
        else:
            raise CacheLockedError(f"{self.path} kept being replaced while it was opened (another writer?)")
        self._file = f
        self._load()
        return self

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self._sync()
            if self.sorted_on_close:
                try:
                    self._rewrite_sorted()
                except OSError as e:  # the unsorted file is a whole cache still: say so, do not fail the run
                    print(f"teacher cache: {self.path} left in arrival order ({e})", file=sys.stderr)
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> "TeacherCache":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------------
    def _load(self) -> None:
        f = self._file
        f.seek(0)
        data = f.read()
        good_end = 0  # byte offset just past the last complete, valid line
        lines = data.split(b"\n")
        offset = 0
        for i, raw in enumerate(lines):
            is_last_piece = i == len(lines) - 1
            end = offset + len(raw) + (0 if is_last_piece else 1)
            if is_last_piece:
                if raw.strip():  # bytes after the final newline: a torn write
                    self.dropped_torn_line = True
                break
            if raw.strip():
                try:
                    entry = json.loads(raw)
                    key = entry["key"]
                except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
                    if i == len(lines) - 2 and not lines[-1].strip():
                        # a complete-looking but invalid final line (e.g. zero-filled after a power loss)
                        self.dropped_torn_line = True
                        break
                    raise CacheCorruptError(
                        f"{self.path}:{i + 1}: not a valid cache entry; move the file aside or repair that line"
                    ) from None
                if key in self._entries:
                    self.duplicate_lines += 1
                else:
                    self._entries[key] = entry
            good_end = end
            offset = end
        if good_end < len(data):
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
        f.seek(0, os.SEEK_END)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> dict | None:
        return self._entries.get(key)

    def entries(self) -> Iterator[dict]:
        return iter(self._entries.values())

    # -- writing ---------------------------------------------------------------------------------
    def put(self, key: str, request: dict, response: dict, **extra: Any) -> bool:
        """Append one answer; returns False (and writes nothing) if the key is already cached."""
        return self.append({"key": key, "request": request, "response": response, **extra})

    def append(self, entry: dict) -> bool:
        """Append one entry (a JSON object with a ``key``); False (nothing written) if the key is present."""
        if self._file is None:
            raise RuntimeError("cache is not open")
        key = entry["key"]
        if key in self._entries:
            return False
        self._file.write(_line(entry))
        self._file.flush()
        self._entries[key] = entry
        self._appended += 1
        self._unsynced += 1
        if self._unsynced >= self.fsync_every or time.monotonic() - self._last_sync >= self.fsync_interval_s:
            self._sync()
        return True

    def _rewrite_sorted(self) -> None:
        """Replace the file by its entries in key order, under the lock still held on the old file: a new file
        beside it (its mode), fsynced, renamed over it, the directory fsynced so the rename survives a power loss.
        Nothing is written when the file is in key order already (nothing appended, no duplicate or torn line)."""
        keys = list(self._entries)
        if not self._appended and not self.duplicate_lines and not self.dropped_torn_line and keys == sorted(keys):
            return
        tmp = self.path.with_name(self.path.name + SORTING_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                for k in sorted(keys):
                    f.write(_line(self._entries[k]))
                f.flush()
                os.fchmod(f.fileno(), os.fstat(self._file.fileno()).st_mode & 0o7777)
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def _sync(self) -> None:
        if self._file is not None and self._unsynced:
            os.fsync(self._file.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()


def _same_file(f, path: Path) -> bool:
    """Whether the open file ``f`` is the file at ``path`` now (not one renamed over it since it was opened)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(f.fileno())
    return (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino)


def _line(entry: dict) -> bytes:
    return (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
