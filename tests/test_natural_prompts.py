"""The natural prompt set: the committed file is the generator's output, its rows reach the subset stage with
their kind and reference, no prompt gives its answer away, and a held-out split of 300 holds >= 200 checkable
rows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ars_opd.config import TASK_NAMES, DataConfig, SyntheticConfig
from ars_opd.data import natural
from ars_opd.data.answers import is_checkable
from ars_opd.data.natural_check import CHECKABLE_KINDS, gives_away
from ars_opd.data.normalise import normalise_row
from ars_opd.data.subset import make_subset
from ars_opd.seeding import derive_seed

REPO = Path(__file__).resolve().parents[1]
FILE = REPO / natural.DEFAULT_OUT


def test_the_committed_file_is_the_generators_output(tmp_path):
    assert FILE.read_text(encoding="utf-8") == natural.render(natural.generate())
    assert FILE.stat().st_size < 1_000_000
    # the documented command writes the same bytes
    natural.main(["--out", str(tmp_path / "p.jsonl")])
    assert (tmp_path / "p.jsonl").read_bytes() == FILE.read_bytes()


def test_generation_is_seeded():
    assert natural.generate(0) == natural.generate(0)
    other = natural.generate(1)
    assert other != natural.generate(0)  # the arithmetic pairs are a seeded sample
    assert [r for r in other if r["task"] not in ("nl_sum", "nl_difference")] == [
        r for r in natural.generate(0) if r["task"] not in ("nl_sum", "nl_difference")
    ]


def test_size_kinds_and_references():
    rows = natural.generate()
    kinds = Counter(r["task"] for r in rows)
    assert len(rows) >= 1000 and len(kinds) >= 20 and set(kinds) == set(natural.KINDS)
    assert not set(kinds) & set(TASK_NAMES)  # a natural kind is never taken for a synthetic task
    checkable = [r for r in rows if r["response"] is not None]
    assert len(checkable) >= 200
    assert {r["task"] for r in checkable} == set(CHECKABLE_KINDS)
    assert all(r["response"] is None for r in rows if r["task"] in natural.OPEN_KINDS)
    for r in checkable:
        assert not gives_away(r["task"], r["response"], r["prompt"]), r
    for r in rows:  # the subset stage's reading: one user turn, the kind, the reference (or none)
        messages, reference, task, fmt = normalise_row(r, "auto")
        assert messages == [{"role": "user", "content": r["prompt"]}]
        assert (reference, task, fmt) == (r["response"], r["task"], "prompt_response")
    sums = [r for r in rows if r["task"] == "nl_sum"]
    for r in sums:  # the arithmetic is right
        a, b = (int(x) for x in r["prompt"].split("?")[0].removeprefix("What is ").split(" + "))
        assert int(r["response"]) == a + b


def test_the_held_out_split_of_the_real_subset_stage_has_200_checkable_rows():
    """With data.subset_size 0 (every row), data.eval_size 300 and base.seed 0, through make_subset itself."""
    cfg = DataConfig(source=str(FILE), subset_size=0, eval_size=300)
    result = make_subset(cfg, SyntheticConfig(), seed=derive_seed(0, "subset"))
    assert len(result.eval) == 300 and result.stats["malformed"] == 0 and result.stats["duplicates_dropped"] == 0
    assert len(result.train) + len(result.eval) == len(natural.generate())
    held_out = [r for r in result.eval if is_checkable(r)]
    assert len(held_out) >= 200
    # each checkable row keeps its reference, each open one has none
    by_prompt = {r["prompt"]: r for r in natural.generate()}
    for r in result.eval:
        src = by_prompt[r["messages"][-1]["content"]]
        assert (r["task"], r["reference"]) == (src["task"], src["response"])
        assert is_checkable(r) == (src["response"] is not None)
