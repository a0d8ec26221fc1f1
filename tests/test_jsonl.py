"""One JSON Lines reader everywhere: lines end at "\\n" only, so characters JSON writes raw stay in their row."""

import json
from pathlib import Path

import pytest

from ars_opd.artifacts import JsonlLineError, iter_jsonl, read_jsonl, write_jsonl

# every character str.splitlines() treats as a line boundary besides \n and \r (which JSON always escapes)
SPLITLINES_ONLY = "\u2028\u2029\u0085\x1c\x1d\x1e"
ROWS = [
    {
        "step": i,
        "text": f"row{i}{SPLITLINES_ONLY[i % len(SPLITLINES_ONLY)]}end",
        "all": SPLITLINES_ONLY,
        "loss": 0.5 + i,
    }
    for i in range(7)
]


def test_these_characters_really_break_str_splitlines():
    # the premise: written raw by json.dumps(ensure_ascii=False), they break lines for splitlines
    raw = json.dumps(ROWS[0], ensure_ascii=False)
    assert "\n" not in raw and len(raw.splitlines()) > 1


def test_iter_jsonl_splits_on_newline_only(tmp_path):
    path = tmp_path / "rows.jsonl"
    assert write_jsonl(path, ROWS) == len(ROWS)
    assert read_jsonl(path) == ROWS
    parsed = list(iter_jsonl(path.read_bytes()))
    assert [n for n, _ in parsed] == list(range(1, len(ROWS) + 1)) and [v for _, v in parsed] == ROWS


def test_iter_jsonl_reports_bad_lines_by_number_and_accepts_bom_and_crlf():
    data = (
        b"\xef\xbb\xbf"
        + json.dumps(ROWS[0], ensure_ascii=False).encode()
        + b"\r\n\n  \n"
        + b'{"torn": '
        + b"\n"
        + b'{"bad": "\xff"}\n'
        + json.dumps(ROWS[1], ensure_ascii=False).encode()
    )
    out = list(iter_jsonl(data))
    assert [n for n, _ in out] == [1, 4, 5, 6]
    assert out[0][1] == ROWS[0] and out[3][1] == ROWS[1]  # a last line without "\n" is still read
    assert isinstance(out[1][1], JsonlLineError) and out[1][1].message.startswith("not valid JSON")
    assert isinstance(out[2][1], JsonlLineError) and out[2][1].message.startswith("not valid UTF-8")
    with pytest.raises(ValueError, match=r"rows.jsonl:4: not valid JSON"):
        read_jsonl_bytes(data)


def read_jsonl_bytes(data: bytes):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "rows.jsonl"
        p.write_bytes(data)
        return read_jsonl(p)


def test_every_reader_of_stage_outputs_keeps_the_rows_whole(tmp_path):
    """ars-opd check and the report's step log (and, through read_jsonl, the checkpoint's) read whole rows."""
    from ars_opd.checks import Problems, _read_jsonl
    from ars_opd.evaluation.report import load_steps

    path = tmp_path / "steps.jsonl"
    write_jsonl(path, ROWS)
    problems = Problems()
    assert _read_jsonl(path, problems, ("step", "text")) == ROWS and problems == []
    frame = load_steps(path)
    assert len(frame) == len(ROWS) and list(frame["text"]) == [r["text"] for r in ROWS]


def test_check_names_the_line_of_a_damaged_row(tmp_path):
    from ars_opd.checks import Problems, _read_jsonl

    path = tmp_path / "rows.jsonl"
    write_jsonl(path, ROWS)
    data = path.read_bytes().split(b"\n")
    data[2] = data[2][:-5]
    path.write_bytes(b"\n".join(data))
    problems = Problems()
    rows = _read_jsonl(path, problems, ("step",))
    assert len(rows) == len(ROWS) - 1 and len(problems) == 1 and f"{path}:3: not valid JSON" in problems[0]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_rows_with_line_separators_go_through_subset_and_teacher_gen_and_pass_the_check(tmp_path, monkeypatch, suffix):
    """The issue's reproduction: a local Alpaca file with U+2028/U+2029/U+0085 inside strings."""
    from ars_opd.checks import check_outputs
    from ars_opd.config import BaseConfig, DataConfig, PathsConfig, SyntheticConfig, TeacherGenConfig, parse_section
    from ars_opd.data.subset import write_subset
    from ars_opd.teacher.client.generate import generate_teacher_completions
    from fake_endpoint import FakeEndpoint

    rows = [
        {
            "instruction": f"Join these lines:\u2028first {i}\u2028second",
            "input": f"caf\u00e9\u0085next {i}",
            "output": f"first second {i}\u2029",
        }
        for i in range(30)
    ]
    source = tmp_path / f"alpaca{suffix}"
    source.write_text(
        json.dumps(rows, ensure_ascii=False)
        if suffix == ".json"
        else "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    paths = PathsConfig()
    stats = write_subset(
        BaseConfig(), DataConfig(source=str(source), subset_size=0, eval_size=5), SyntheticConfig(), paths
    )
    assert stats["malformed"] == 0 and stats["selected"] == 30
    with FakeEndpoint() as ep:
        cfg = parse_section(TeacherGenConfig, {"endpoint": ep.base_url, "model": "fake-teacher"}, "teacher_gen")
        m = generate_teacher_completions(cfg, paths, progress=False)
    assert m["failed"] == 0 and m["train_rows"] + m["eval_rows"] == 30
    assert "\u2028" in Path(paths.completions("train")).read_text("utf-8")  # written raw, as JSON allows
    assert check_outputs(paths, ("subset", "teacher_gen")) == []
