"""Instruction-data sources: read the configured ``data.source`` into random-access raw rows.

Sources (``data.source``):

- ``synthetic``: the built-in checkable tasks (``ars_opd.data.synthetic``), generated with the subset seed
  by ``ars_opd.data.subset``, so it is not read here;
- a local file: ``.jsonl``/``.json`` (a JSON list or JSON Lines), ``.parquet``, ``.csv``;
- a local directory: a dataset saved with ``save_to_disk``, else anything ``datasets.load_dataset`` reads;
- anything else is a Hugging Face hub dataset id, read with ``datasets.load_dataset``.

Rows come back as the source holds them, not interpreted: a line that cannot be read at all becomes a
``Malformed`` row, counted downstream like any other malformed row, so a torn file does not abort the read.
``source_sha256`` identifies a local source by its bytes.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ars_opd.artifacts import JsonlLineError, file_sha256, files_sha256, iter_jsonl
from ars_opd.config import LOCAL_DATA_SUFFIXES, DataConfig

LOCAL_SUFFIXES = LOCAL_DATA_SUFFIXES


class DataSourceError(RuntimeError):
    """The configured dataset cannot be read."""


@dataclass(frozen=True)
class Malformed:
    """A source row that could not be read at all (e.g. a line of invalid JSON)."""

    reason: str
    detail: str


def _read_json_file(path: Path) -> list[Any]:
    data = path.read_bytes()
    try:
        whole = json.loads(data.decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        whole = None  # JSON Lines (possibly with a torn or invalid line), read line by line below
    if whole is not None:
        if isinstance(whole, list):
            return whole
        if isinstance(whole, dict):
            for key in ("data", "rows", "train"):
                if isinstance(whole.get(key), list):
                    return whole[key]
        raise DataSourceError(f"{path}: expected a JSON list of rows (or JSON Lines), got {type(whole).__name__}")
    rows: list[Any] = []
    for _, value in iter_jsonl(data):  # splits on "\n" only: U+2028 and friends stay inside their row
        if isinstance(value, JsonlLineError):
            reason = "invalid_utf8" if value.message.startswith("not valid UTF-8") else "invalid_json"
            value = Malformed(reason, f"line {value.lineno}: {value.message}: {value.text!r}")
        rows.append(value)
    return rows


def _read_local_file(path: Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return _read_json_file(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataSourceError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None
    if suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise DataSourceError(f"{path}: unsupported file type {suffix!r}; use one of {', '.join(LOCAL_SUFFIXES)}")


def _read_dataset_dir(path: Path, cfg: DataConfig) -> Sequence[Any]:
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if cfg.hub_split not in ds:
                raise DataSourceError(f"{path}: no split {cfg.hub_split!r}; splits: {list(ds)}")
            ds = ds[cfg.hub_split]
        return ds
    try:
        return datasets.load_dataset(str(path), name=cfg.hub_config, split=cfg.hub_split)
    except Exception as e:
        raise DataSourceError(f"{path}: datasets.load_dataset failed ({type(e).__name__}: {e})") from None


def _read_hub(cfg: DataConfig) -> Sequence[Any]:
    import datasets
    from huggingface_hub import constants

    try:
        return datasets.load_dataset(cfg.source, name=cfg.hub_config, split=cfg.hub_split, revision=cfg.hub_revision)
    except Exception as e:
        offline = constants.HF_HUB_OFFLINE
        hint = ("HF_HUB_OFFLINE is set and the dataset is not in the local datasets cache: download it on a "
                "connected machine or point data.source at a local file" if offline else
                "check the dataset id, data.hub_config / data.hub_split / data.hub_revision, and your network "
                "(or point data.source at a local file)")
        raise DataSourceError(
            f"cannot load hub dataset {cfg.source!r} (split {cfg.hub_split!r}): {type(e).__name__}: "
            f"{str(e)[:300]}. {hint}"
        ) from None


def load_source(cfg: DataConfig) -> Sequence[Any]:
    """Random-access rows of a non-synthetic source (a list or a ``datasets.Dataset``)."""
    path = Path(cfg.source).expanduser()
    if path.is_file():
        return _read_local_file(path)
    if path.is_dir():
        return _read_dataset_dir(path, cfg)
    if path.suffix.lower() in LOCAL_SUFFIXES or cfg.source.startswith((".", "/", "~")):
        raise DataSourceError(f"data.source {cfg.source!r}: no such file or directory")
    return _read_hub(cfg)


def source_sha256(cfg: DataConfig) -> str | None:
    """sha256 of a local source (a file's bytes; a directory's files, names and bytes); None for synthetic
    data and hub datasets (those are identified by their id and ``data.hub_revision``)."""
    if cfg.source == "synthetic":
        return None
    path = Path(cfg.source).expanduser()
    if path.is_file():
        return file_sha256(path)
    if path.is_dir():
        return files_sha256(path, None)[0]
    return None
