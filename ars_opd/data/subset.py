"""Instruction datasets: take a seeded subset of normalised rows, split train/eval, write the subset stage.

Every selected row is ``{"id", "messages", "reference", "task", "source_index"}``: sources are read by
``ars_opd.data.sources`` and rows normalised by ``ars_opd.data.normalise``; ``id`` is the hash of the
normalised prompt and reference, so duplicates are found whatever the source format.

Malformed rows are not fixed up: they are counted by reason, a few examples kept, and the stage fails
when their fraction of the rows examined exceeds ``data.max_malformed_fraction``. Selection walks a
seeded permutation of the source and stops when enough valid rows are found, so a large hub dataset is
not normalised in full.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from ars_opd.data import synthetic
from ars_opd.artifacts import atomic_outputs, provenance, write_json, write_jsonl
from ars_opd.config import BaseConfig, DataConfig, PathsConfig, SyntheticConfig, to_dict
from ars_opd.seeding import derive_seed
from ars_opd.data.normalise import RowError, normalise_row, row_id
from ars_opd.data.sources import DataSourceError, Malformed, load_source, source_sha256


class MalformedDataError(ValueError):
    """Too many rows could not be normalised."""


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
