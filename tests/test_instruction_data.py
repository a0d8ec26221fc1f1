import json

import pytest

from ars_opd.config import DataConfig, SyntheticConfig
from ars_opd.data.normalise import RowError, normalise_row
from ars_opd.data.prompts import alpaca_user_message
from ars_opd.data.sources import DataSourceError
from ars_opd.data.subset import MalformedDataError, make_subset

SYNTH = SyntheticConfig()


def _cfg(source, **kw):
    kw.setdefault("subset_size", 0)
    kw.setdefault("eval_size", 2)
    return DataConfig(source=str(source), **kw)


ALPACA = [
    {"instruction": f"Say {i}.", "input": "" if i % 2 else f"ctx {i}", "output": f"answer {i}"} for i in range(20)
]


def test_alpaca_rendering():
    msgs, ref, task, fmt = normalise_row({"instruction": "Add.", "input": "1 + 2", "output": "3"}, "auto")
    assert fmt == "alpaca" and ref == "3" and task is None
    assert msgs == [{"role": "user", "content": "### Instruction:\nAdd.\n\n### Input:\n1 + 2"}]
    msgs, _, _, _ = normalise_row({"instruction": "Add.", "input": "", "output": "3"}, "alpaca", "sys")
    assert msgs == [{"role": "system", "content": "sys"}, {"role": "user", "content": "### Instruction:\nAdd."}]


def test_messages_sharegpt_and_prompt_rows():
    row = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
        ]
    }
    msgs, ref, _, fmt = normalise_row(row, "auto")
    assert fmt == "messages" and ref == "a" and [m["role"] for m in msgs] == ["system", "user"]
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    msgs, ref, _, fmt = normalise_row(row, "auto")
    assert fmt == "sharegpt" and ref == "yo" and msgs == [{"role": "user", "content": "hi"}]
    msgs, ref, _, fmt = normalise_row({"prompt": "p", "completion": "c"}, "auto")
    assert fmt == "prompt_response" and ref == "c"
    _, ref, _, _ = normalise_row({"prompt": "only a prompt"}, "auto")
    assert ref is None  # prompt-only rows are valid: the teacher writes the answer


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"instruction": "x", "output": 7}, "wrong_type:output"),
        ({"instruction": 3, "output": "y"}, "wrong_type:instruction"),
        ({"instruction": "  ", "output": "y"}, "empty_prompt"),
        ({"instruction": "x", "output": ""}, "empty_response"),
        ({"messages": [{"role": "assistant", "content": "a"}]}, "no_user_turn"),
        ({"messages": [{"role": "robot", "content": "a"}]}, "bad_role"),
        ({"messages": []}, "empty_conversation"),
        ({"text": "free text"}, "unknown_format"),
        ([1, 2], "not_an_object"),
    ],
)
def test_malformed_rows_have_reasons(row, reason):
    with pytest.raises(RowError) as e:
        normalise_row(row, "auto")
    assert e.value.reason == reason


def _write_all_formats(tmp_path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with open(tmp_path / "d.csv", "w") as f:
        f.write("instruction,input,output\n")
        for r in rows:
            f.write(f"{r['instruction']},{r['input']},{r['output']}\n")


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "d.csv"])
def test_every_local_loader_gives_the_same_subset(tmp_path, name):
    _write_all_formats(tmp_path, ALPACA)
    res = make_subset(_cfg(tmp_path / name), SYNTH, seed=3)
    ref = make_subset(_cfg(tmp_path / "d.jsonl"), SYNTH, seed=3)
    assert res.train == ref.train and res.eval == ref.eval
    assert len(res.train) == 18 and len(res.eval) == 2
    assert {r["reference"] for r in res.train + res.eval} == {r["output"] for r in ALPACA}


def test_saved_dataset_directory(tmp_path):
    import datasets

    datasets.Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "saved"))
    res = make_subset(_cfg(tmp_path / "saved"), SYNTH, seed=3)
    ref = make_subset(_cfg(_write_jsonl(tmp_path, ALPACA)), SYNTH, seed=3)
    assert res.train == ref.train


def _write_jsonl(tmp_path, rows, extra_lines=()):
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return p


def test_seeded_subset_and_split():
    cfg = DataConfig(source="synthetic", subset_size=100, eval_size=10)
    a = make_subset(cfg, SYNTH, seed=1)
    assert a.train == make_subset(cfg, SYNTH, seed=1).train
    assert a.train != make_subset(cfg, SYNTH, seed=2).train
    assert len(a.train) == 90 and len(a.eval) == 10
    assert not {r["id"] for r in a.train} & {r["id"] for r in a.eval}
    assert all(r["task"] and r["reference"] for r in a.train)


def test_malformed_rows_counted_and_threshold_names_examples(tmp_path):
    bad = [{"instruction": "x", "output": 7}] * 2
    p = _write_jsonl(tmp_path, ALPACA + bad, extra_lines=['{"instruction": "torn', "\n"])
    res = make_subset(_cfg(p, max_malformed_fraction=0.2), SYNTH, seed=0)
    assert res.stats["malformed_by_reason"] == {"invalid_json": 1, "wrong_type:output": 2}
    assert res.stats["rows_in_source"] == 23 and res.stats["selected"] == 20
    assert res.stats["malformed_examples"]["invalid_json"][0]["row"].startswith("line 23")
    with pytest.raises(MalformedDataError, match=r"3 of 23 .*wrong_type:output x2"):
        make_subset(_cfg(p, max_malformed_fraction=0.1), SYNTH, seed=0)


def test_duplicates_dropped_and_counted(tmp_path):
    p = _write_jsonl(tmp_path, ALPACA + ALPACA[:5])
    res = make_subset(_cfg(p), SYNTH, seed=0)
    assert res.stats["duplicates_dropped"] == 5 and res.stats["selected"] == 20
    res = make_subset(_cfg(p, drop_duplicates=False), SYNTH, seed=0)
    assert res.stats["selected"] == 25


def test_too_few_rows_is_an_error(tmp_path):
    p = _write_jsonl(tmp_path, ALPACA[:2])
    with pytest.raises(MalformedDataError, match="need more than data.eval_size"):
        make_subset(_cfg(p, eval_size=2), SYNTH, seed=0)


def test_missing_file_and_hub_unreachable_are_clear(tmp_path, monkeypatch):
    with pytest.raises(DataSourceError, match="no such file"):
        make_subset(_cfg(tmp_path / "absent.jsonl"), SYNTH, seed=0)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(DataSourceError, match="cannot load hub dataset 'tatsu-lab/alpaca'"):
        make_subset(_cfg("tatsu-lab/alpaca"), SYNTH, seed=0)


# -- rows the first real-data trial got wrong: Unicode line breaks, prompt-only rows, a subset of all ------------

# JSON writes these raw inside strings (ensure_ascii=False), and str.splitlines() breaks lines at them
LINE_BREAKERS = "\u2028\u2029\u0085\x1c\x1d\x1e\x0b\x0c"
ISSUE_ROW = {
    "instruction": "Join these lines:\u2028first\u2028second",
    "input": "caf\u00e9\u0085next",
    "output": "first second",
}


def _unicode_rows() -> list[dict]:
    rows = [ISSUE_ROW] + [
        {
            "instruction": f"Say {i}{LINE_BREAKERS[i % len(LINE_BREAKERS)]}now.",
            "input": f"x{LINE_BREAKERS}y" if i % 2 else "",
            "output": f"a\u2029{i}",
        }
        for i in range(12)
    ]
    assert "\n".join(json.dumps(r, ensure_ascii=False) for r in rows).count("\n") == len(rows) - 1
    return rows


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_local_files_with_unicode_line_separators_load_with_no_malformed_rows(tmp_path, suffix):
    rows = _unicode_rows()
    p = tmp_path / f"alpaca{suffix}"
    text = (
        json.dumps(rows, ensure_ascii=False)
        if suffix == ".json"
        else "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    )
    p.write_text(text, encoding="utf-8")
    res = make_subset(_cfg(p), SYNTH, seed=0)
    assert res.stats["malformed"] == 0 and res.stats["rows_in_source"] == len(rows) == res.stats["selected"]
    # every row arrives whole: its instruction and reference, separators included (independent rendering)
    got = {r["reference"]: r["messages"][-1]["content"] for r in res.train + res.eval}
    assert got == {r["output"]: alpaca_user_message(r["instruction"], r["input"]) for r in rows}
    assert "first\u2028second" in got["first second"] and "caf\u00e9\u0085next" in got["first second"]


def test_jsonl_line_numbers_count_newlines_only(tmp_path):
    p = tmp_path / "rows.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) for r in _unicode_rows()[:3]]
    p.write_bytes(
        ("\ufeff" + lines[0] + "\r\n" + lines[1] + "\n\n" + '{"instruction": "tor' + "\n" + lines[2] + "\n").encode()
        + b'{"instruction": "\xff"}\n'
    )
    res = make_subset(_cfg(p, eval_size=1, max_malformed_fraction=0.5), SYNTH, seed=0)
    assert res.stats["malformed_by_reason"] == {"invalid_json": 1, "invalid_utf8": 1}
    assert res.stats["malformed_examples"]["invalid_json"][0]["row"].startswith("line 4: not valid JSON")
    assert res.stats["malformed_examples"]["invalid_utf8"][0]["row"].startswith("line 6: not valid UTF-8")
    assert res.stats["selected"] == 3  # BOM and CRLF accepted


def test_prompt_only_alpaca_rows_are_valid(tmp_path):
    msgs, ref, _, fmt = normalise_row({"instruction": "Write a haiku.", "input": ""}, "auto")
    assert fmt == "alpaca" and ref is None and msgs == [{"role": "user", "content": "### Instruction:\nWrite a haiku."}]
    assert normalise_row({"instruction": "Write.", "output": None}, "alpaca")[1] is None
    rows = [{"instruction": f"Write {i}.", "input": ""} for i in range(10)]
    res = make_subset(_cfg(_write_jsonl(tmp_path, rows)), SYNTH, seed=0)
    assert res.stats["malformed"] == 0 and res.stats["with_reference"] == 0 and res.stats["selected"] == 10


def test_subset_size_zero_keeps_every_valid_row_without_a_shortfall(tmp_path, capsys, monkeypatch):
    from ars_opd.config import BaseConfig, PathsConfig
    from ars_opd.data.subset import write_subset

    bad = [{"instruction": "x", "output": 7}]
    p = _write_jsonl(tmp_path, ALPACA + bad)
    monkeypatch.chdir(tmp_path)
    paths = PathsConfig()
    stats = write_subset(BaseConfig(), _cfg(p), SYNTH, paths)
    assert stats["selected"] == 20 and stats["malformed"] == 1
    assert stats["short_of_request"] == 0 and stats["requested"] is None
    assert "warning" not in capsys.readouterr().err
    # a real shortfall is still reported
    stats = write_subset(BaseConfig(), _cfg(p, subset_size=30), SYNTH, paths)
    assert stats["short_of_request"] == 10 and "asked for 30 rows but only 20" in capsys.readouterr().err


def test_stats_record_the_local_source_sha256(tmp_path):
    import hashlib

    p = _write_jsonl(tmp_path, ALPACA)
    res = make_subset(_cfg(p), SYNTH, seed=0)
    assert res.stats["source_sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    p.write_text(p.read_text() + json.dumps({"instruction": "new", "output": "row"}) + "\n")
    assert make_subset(_cfg(p), SYNTH, seed=0).stats["source_sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert make_subset(DataConfig(subset_size=20, eval_size=2), SYNTH, seed=0).stats["source_sha256"] is None
