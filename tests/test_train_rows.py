"""The control arm's data: rows held back from sft and opd, and which stage trains on which."""

from __future__ import annotations

import json

import pytest

from ars_opd.config import ConfigError, ControlConfig, PathsConfig
from ars_opd.training.train_rows import train_rows


def _paths(tmp_path, n: int) -> PathsConfig:
    paths = PathsConfig(teacher_dir="t")
    (tmp_path / "t").mkdir()
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"q{i}"}], "completion": f"a{i}"} for i in range(n)]
    (tmp_path / "t/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def test_held_back_rows_go_to_the_fresh_control_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = _paths(tmp_path, 10)
    every, ident = train_rows(paths, "sft", ControlConfig())
    assert [r["id"] for r in every] == [str(i) for i in range(10)] and ident["rows"] == 10
    held = ControlConfig(fresh_rows=4)
    fresh = ControlConfig(data="fresh", fresh_rows=4)
    for stage in ("sft", "opd", "sft_continued"):  # repeat: the control trains on what sft trained on
        assert [r["id"] for r in train_rows(paths, stage, held)[0]] == [str(i) for i in range(6)]
    for stage in ("sft", "opd"):  # the rows sft and opd read do not depend on what the control does
        assert train_rows(paths, stage, fresh)[0] == train_rows(paths, stage, held)[0]
    got, ident = train_rows(paths, "sft_continued", fresh)
    assert [r["id"] for r in got] == ["6", "7", "8", "9"]
    assert ident["held_back"] == {"rows": 4, "trains_on": "held back"}  # a fresh control resumes only as one
    assert train_rows(paths, "sft", held)[1]["held_back"]["trains_on"] == "the rest"


def test_holding_back_every_row_is_refused_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = _paths(tmp_path, 5)
    with pytest.raises(ConfigError) as e:
        train_rows(paths, "sft", ControlConfig(fresh_rows=5))
    assert e.value.key == "control.fresh_rows" and "data.subset_size" in str(e.value)
