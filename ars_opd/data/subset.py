"""Instruction datasets: load, normalise to chat messages, take a seeded subset, split train/eval.

Sources (``data.source``):

- ``synthetic``: the built-in checkable tasks (``ars_opd.data.synthetic``), generated with the subset seed;
- a local file: ``.jsonl``/``.json`` (a JSON list or JSON Lines), ``.parquet``, ``.csv``;
- a local directory: a dataset saved with ``save_to_disk``, else anything ``datasets.load_dataset`` reads;
- anything else is a Hugging Face hub dataset id, read with ``datasets.load_dataset``.

Row formats (``data.format``, or detected per row with ``auto``): Alpaca (instruction / input / output),
chat ``messages`` (role / content, the last assistant turn is the reference), ``prompt`` with an optional
``response``/``completion``/``output``, and ShareGPT ``conversations`` (from / value). Every row becomes
``{"id", "messages", "reference", "task", "source_index"}``: ``messages`` is the prompt (everything
before the reference answer), ``reference`` the dataset's answer or null, ``task`` the synthetic task
name or null. A prompt-only row is valid, since the teacher writes the completion: an Alpaca row without
``output`` (or with ``output: null``), a conversation that ends with a user turn, a ``prompt`` without a
response. An answer that is present but empty is malformed (``empty_response``).

Malformed rows are not fixed up: they are counted by reason, a few examples kept, and the stage fails
when their fraction of the rows examined exceeds ``data.max_malformed_fraction``. Selection walks a
seeded permutation of the source and stops when enough valid rows are found, so a large hub dataset is
not normalised in full.
"""

from __future__ import annotations

import csv
import hashlib
import json
import random
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ars_opd.data import synthetic
from ars_opd.artifacts import (
    JsonlLineError, atomic_outputs, dumps_canonical, file_sha256, files_sha256, iter_jsonl, provenance, write_json,
    write_jsonl,
)
from ars_opd.config import LOCAL_DATA_SUFFIXES, BaseConfig, DataConfig, PathsConfig, SyntheticConfig, to_dict
from ars_opd.seeding import derive_seed
from ars_opd.data.prompts import alpaca_messages

LOCAL_SUFFIXES = LOCAL_DATA_SUFFIXES
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
RESPONSE_KEYS = ("response", "completion", "output")


class DataSourceError(RuntimeError):
    """The configured dataset cannot be read."""


class MalformedDataError(ValueError):
    """Too many rows could not be normalised."""


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


# --------------------------------------------------------------------------------------------------
# normalisation


class RowError(ValueError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _text(row: Mapping, key: str, required: bool = True) -> str | None:
    if key not in row or row[key] is None:
        if required:
            raise RowError(f"missing_field:{key}")
        return None
    value = row[key]
    if not isinstance(value, str):
        raise RowError(f"wrong_type:{key}")
    return value


def detect_format(row: Mapping) -> str:
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "prompt" in row:
        return "prompt_response"
    raise RowError("unknown_format")


def _chat_turns(turns: Any, role_key: str, content_key: str, role_map: Mapping[str, str]) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise RowError("empty_conversation")
    out = []
    for t in turns:
        if not isinstance(t, Mapping) or role_key not in t or content_key not in t:
            raise RowError("bad_turn")
        role = role_map.get(t[role_key]) if isinstance(t[role_key], str) else None
        if role is None:
            raise RowError("bad_role")
        if not isinstance(t[content_key], str):
            raise RowError("wrong_type:content")
        out.append({"role": role, "content": t[content_key]})
    return out


def _split_conversation(turns: list[dict]) -> tuple[list[dict], str | None]:
    reference = None
    if turns[-1]["role"] == "assistant":
        reference = turns[-1]["content"]
        turns = turns[:-1]
    if not any(t["role"] == "user" for t in turns):
        raise RowError("no_user_turn")
    if turns[-1]["role"] != "user":
        raise RowError("prompt_not_ending_with_user")
    if any(t["role"] == "system" for t in turns[1:]):
        raise RowError("system_not_first")
    return turns, reference


def normalise_row(row: Any, fmt: str, system_prompt: str | None = None) -> tuple[list[dict], str | None, str | None, str]:
    """Normalise one raw row -> (prompt messages, reference or None, task or None, format).

    Raises ``RowError(reason)`` for a malformed row.
    """
    if isinstance(row, Malformed):
        raise RowError(row.reason)
    if not isinstance(row, Mapping):
        raise RowError("not_an_object")
    fmt = detect_format(row) if fmt == "auto" else fmt
    task = row.get("task") if isinstance(row.get("task"), str) else None
    if fmt == "alpaca":
        instruction = _text(row, "instruction")
        inp = _text(row, "input", required=False)
        reference = _text(row, "output", required=False)  # absent or null: a prompt-only row
        if not instruction.strip():
            raise RowError("empty_prompt")
        messages = alpaca_messages(instruction, inp, None)
    elif fmt == "messages":
        messages, reference = _split_conversation(_chat_turns(row.get("messages"), "role", "content",
                                                              {r: r for r in ROLES}))
    elif fmt == "sharegpt":
        messages, reference = _split_conversation(_chat_turns(row.get("conversations"), "from", "value",
                                                              SHAREGPT_ROLES))
    elif fmt == "prompt_response":
        prompt = _text(row, "prompt")
        if not prompt.strip():
            raise RowError("empty_prompt")
        reference = None
        for key in RESPONSE_KEYS:
            if key in row:
                reference = _text(row, key, required=False)
                break
        messages = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if any(not m["content"].strip() for m in messages):
        raise RowError("empty_prompt")
    if reference is not None and not reference.strip():
        raise RowError("empty_response")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages, reference, task, fmt


def row_id(messages: list[dict], reference: str | None) -> str:
    return hashlib.sha256(dumps_canonical({"messages": messages, "reference": reference}).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# subset


@dataclass
class SubsetResult:
    train: list[dict]
    eval: list[dict]
    stats: dict = field(default_factory=dict)


def _length_stats(values: list[int]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0, "p95": 0, "max": 0}
    s = sorted(values)
    return {"mean": round(statistics.fmean(s), 2), "p50": s[len(s) // 2],
            "p95": s[min(len(s) - 1, int(0.95 * len(s)))], "max": s[-1]}


def _snippet(row: Any) -> str:
    if isinstance(row, Malformed):
        return row.detail
    try:
        return json.dumps(row, ensure_ascii=False, default=str)[:120]
    except Exception:
        return repr(row)[:120]


def make_subset(cfg: DataConfig, synth: SyntheticConfig, seed: int) -> SubsetResult:
    """Load, normalise, select and split; raises ``MalformedDataError`` above the malformed threshold."""
    if cfg.source == "synthetic":
        spec = synthetic.TaskSpec(max_operand=synth.max_operand, min_len=synth.min_len, max_len=synth.max_len)
        # twice the rows asked for: small task spaces repeat prompts, and duplicates are dropped below
        rows: Sequence[Any] = synthetic.generate(2 * cfg.subset_size, seed=seed, tasks=synth.tasks, spec=spec)
        fmt = "alpaca"
    else:
        rows = load_source(cfg)
        fmt = cfg.format
    n_total = len(rows)
    if n_total == 0:
        raise DataSourceError(f"data.source {cfg.source!r} has no rows")
    order = list(range(n_total))
    random.Random(seed).shuffle(order)
    want = cfg.subset_size or n_total  # 0: every valid row, so nothing can fall short of the request

    selected: list[dict] = []
    seen: set[str] = set()
    malformed: Counter = Counter()
    duplicates = 0
    examples: dict[str, list[dict]] = defaultdict(list)
    formats: Counter = Counter()
    examined = 0
    for idx in order:
        if len(selected) >= want:
            break
        examined += 1
        raw = rows[idx]
        try:
            messages, reference, task, row_fmt = normalise_row(raw, fmt, cfg.system_prompt)
        except RowError as e:
            malformed[e.reason] += 1
            if len(examples[e.reason]) < 3:
                examples[e.reason].append({"index": idx, "row": _snippet(raw)})
            continue
        rid = row_id(messages, reference)
        if rid in seen and cfg.drop_duplicates:
            duplicates += 1
            continue
        seen.add(rid)
        formats[row_fmt] += 1
        selected.append({"id": rid, "messages": messages, "reference": reference, "task": task,
                         "source_index": idx})

    n_malformed = sum(malformed.values())
    fraction = n_malformed / examined if examined else 0.0
    if fraction > cfg.max_malformed_fraction:
        shown = "; ".join(f"{reason} x{count} (e.g. row {examples[reason][0]['index']}: {examples[reason][0]['row']})"
                          for reason, count in malformed.most_common(5))
        raise MalformedDataError(
            f"{n_malformed} of {examined} rows examined ({fraction:.1%}) are malformed, above "
            f"data.max_malformed_fraction = {cfg.max_malformed_fraction:.1%}: {shown}"
        )
    if len(selected) <= cfg.eval_size:
        raise MalformedDataError(
            f"only {len(selected)} valid rows in {cfg.source!r} ({n_total} rows, {n_malformed} malformed, "
            f"{duplicates} duplicates); need more than data.eval_size = {cfg.eval_size}"
        )
    eval_rows, train_rows = selected[: cfg.eval_size], selected[cfg.eval_size:]
    stats = {
        "source": cfg.source,
        "rows_in_source": n_total,
        "rows_examined": examined,
        "source_sha256": source_sha256(cfg),
        "requested": cfg.subset_size or None,  # null: data.subset_size 0, every valid row
        "selected": len(selected),
        "short_of_request": max(0, cfg.subset_size - len(selected)) if cfg.subset_size else 0,
        "train": len(train_rows),
        "eval": len(eval_rows),
        "malformed": n_malformed,
        "malformed_fraction": round(fraction, 6),
        "duplicates_dropped": duplicates,
        "malformed_by_reason": dict(sorted(malformed.items())),
        "malformed_examples": dict(sorted(examples.items())),
        "formats": dict(sorted(formats.items())),
        "with_reference": sum(r["reference"] is not None for r in selected),
        "tasks": dict(sorted(Counter(r["task"] for r in selected if r["task"]).items())),
        "prompt_chars": _length_stats([sum(len(m["content"]) for m in r["messages"]) for r in selected]),
        "reference_chars": _length_stats([len(r["reference"]) for r in selected if r["reference"] is not None]),
    }
    return SubsetResult(train=train_rows, eval=eval_rows, stats=stats)


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


def write_subset(base: BaseConfig, cfg: DataConfig, synth: SyntheticConfig, paths: PathsConfig) -> dict:
    """Run the subset stage: write train/eval JSONL, stats and metrics, all or nothing; return stats."""
    result = make_subset(cfg, synth, seed=derive_seed(base.seed, "subset"))
    stats = {**result.stats, "provenance": provenance({"data": to_dict(cfg), "synthetic": to_dict(synth),
                                                      "base": to_dict(base)})}
    metrics = {k: result.stats[k] for k in ("train", "eval", "selected", "malformed", "malformed_fraction",
                                            "duplicates_dropped", "short_of_request")}
    with atomic_outputs(paths.subset_train, paths.subset_eval, paths.subset_stats, paths.subset_metrics) as tmp:
        write_jsonl(tmp[0], result.train)
        write_jsonl(tmp[1], result.eval)
        write_json(tmp[2], stats)
        write_json(tmp[3], metrics)
    if result.stats["short_of_request"]:
        print(f"warning: asked for {result.stats['requested']} rows but only {result.stats['selected']} valid "
              f"rows exist in {cfg.source!r}", file=sys.stderr)
    return result.stats
