import fcntl
import json
import os

import pytest

from ars_opd.teacher.client.cache import CacheCorruptError, CacheLockedError, TeacherCache, cache_key


def test_key_is_canonical_and_sensitive_to_every_field():
    a = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "sampling": {"temperature": 0.0, "top_p": 1.0}}
    b = {"sampling": {"top_p": 1.0, "temperature": 0.0}, "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    assert cache_key(a) == cache_key(b)
    assert len(cache_key(a)) == 64
    for changed in (
        {**a, "model": "m2"},
        {**a, "sampling": {"temperature": 0.5, "top_p": 1.0}},
        {**a, "messages": [{"role": "user", "content": "hi "}]},
    ):
        assert cache_key(changed) != cache_key(a)


def test_put_get_reopen_and_no_duplicates(tmp_path):
    p = tmp_path / "c.jsonl"
    with TeacherCache(p) as c:
        assert c.put("k1", {"q": 1}, {"content": "a"})
        assert not c.put("k1", {"q": 1}, {"content": "other"})
        assert c.put("k2", {"q": 2}, {"content": "b"})
    lines = p.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 3  # every record newline-terminated
    with TeacherCache(p) as c:
        assert len(c) == 2 and c.get("k1")["response"]["content"] == "a"
        assert not c.dropped_torn_line


def test_torn_last_line_is_dropped_and_truncated(tmp_path):
    p = tmp_path / "c.jsonl"
    with TeacherCache(p) as c:
        c.put("k1", {}, {"content": "a"})
    good = p.read_bytes()
    p.write_bytes(good + b'{"key": "k2", "request": {}, "resp')
    with TeacherCache(p) as c:
        assert c.dropped_torn_line and len(c) == 1 and "k2" not in c
        c.put("k3", {}, {"content": "c"})
    assert p.read_bytes().startswith(good)
    with TeacherCache(p) as c:
        assert sorted(e["key"] for e in c.entries()) == ["k1", "k3"] and not c.dropped_torn_line


def test_invalid_final_line_with_newline_is_treated_as_torn(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"key": "k1", "request": {}, "response": {}}\n\x00\x00\x00\n')
    with TeacherCache(p) as c:
        assert c.dropped_torn_line and len(c) == 1


def test_damage_in_the_middle_is_an_error_naming_the_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(
        '{"key": "k1", "request": {}, "response": {}}\nnot json\n{"key": "k2", "request": {}, "response": {}}\n'
    )
    with pytest.raises(CacheCorruptError, match=r"c.jsonl:2"):
        TeacherCache(p).open()


def test_duplicate_lines_keep_the_first(tmp_path):
    p = tmp_path / "c.jsonl"
    rows = [{"key": "k", "request": {}, "response": {"content": x}} for x in ("first", "second")]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with TeacherCache(p) as c:
        assert c.get("k")["response"]["content"] == "first" and c.duplicate_lines == 1


def test_second_writer_is_refused(tmp_path):
    p = tmp_path / "c.jsonl"
    with TeacherCache(p):
        with pytest.raises(CacheLockedError):
            TeacherCache(p).open()
    with TeacherCache(p):  # released on close
        pass


def test_fsync_cadence(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    with TeacherCache(tmp_path / "c.jsonl", fsync_every=3, fsync_interval_s=1e9) as c:
        for i in range(7):
            c.put(f"k{i}", {}, {})
        assert len(calls) == 2
    assert len(calls) == 3  # the last record is synced on close


def test_sorted_on_close_makes_the_bytes_independent_of_arrival_order(tmp_path):
    """Asynchronous answers arrive in any order; with sorted_on_close two runs that cache the same answers write
    the same bytes (the stage's DVC output hash), and the file still reads back whole."""
    entries = [(f"k{i}", {"q": i}, {"content": f"answer {i}"}) for i in (3, 1, 4, 0, 2)]
    written = {}
    for name, order in (("forward", entries), ("reverse", entries[::-1])):
        p = tmp_path / f"{name}.jsonl"
        with TeacherCache(p, sorted_on_close=True) as c:
            for key, request, response in order:
                c.put(key, request, response)
        written[name] = p.read_bytes()
        with TeacherCache(p) as c:
            assert len(c) == 5 and c.get("k4")["response"]["content"] == "answer 4"
    assert written["forward"] == written["reverse"]
    assert [json.loads(line)["key"] for line in written["forward"].splitlines()] == [f"k{i}" for i in range(5)]
    assert not list(tmp_path.glob("*.sorting"))
    # without it the file keeps arrival order (what made two identical runs differ)
    p = tmp_path / "plain.jsonl"
    with TeacherCache(p) as c:
        for key, request, response in entries:
            c.put(key, request, response)
    assert [json.loads(line)["key"] for line in p.read_bytes().splitlines()] == [e[0] for e in entries]


def test_sorted_on_close_appends_after_reopen_and_sorts_again(tmp_path):
    p = tmp_path / "c.jsonl"
    with TeacherCache(p, sorted_on_close=True) as c:
        c.put("b", {}, {"content": "b"})
    with TeacherCache(p, sorted_on_close=True) as c:
        c.put("a", {}, {"content": "a"})
        c.put("c", {}, {"content": "c"})
    assert [json.loads(line)["key"] for line in p.read_bytes().splitlines()] == ["a", "b", "c"]


def test_a_failed_sort_keeps_the_cache_whole_and_releases_the_lock(tmp_path, monkeypatch, capsys):
    """A rewrite that cannot finish (here: the rename fails, as on a full disk) leaves the file in arrival order,
    whole, no half-written file beside it, and the lock released; closing says so instead of failing the run."""
    import ars_opd.teacher.client.cache as cache_module

    p = tmp_path / "c.jsonl"
    c = TeacherCache(p, sorted_on_close=True).open()
    for key in ("b", "a"):
        c.put(key, {}, {"content": key})

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_module.os, "replace", no_space)
    c.close()
    monkeypatch.undo()
    assert "left in arrival order" in capsys.readouterr().err
    assert [json.loads(line)["key"] for line in p.read_bytes().splitlines()] == ["b", "a"]
    assert list(tmp_path.iterdir()) == [p]
    with TeacherCache(p) as again:  # not locked
        assert len(again) == 2


def test_an_opener_that_locked_the_replaced_file_opens_the_new_one(tmp_path, monkeypatch):
    """B opens the path, then A (sorting on close) renames its sorted file over it and unlocks: B's lock is then on
    a file no longer at the path. B must open the path again, or its answers go to a file nobody reads."""
    import ars_opd.teacher.client.cache as cache_module

    p = tmp_path / "c.jsonl"
    a = TeacherCache(p, sorted_on_close=True).open()
    a.put("z", {}, {"content": "z"})
    a.put("y", {}, {"content": "y"})
    real_flock = cache_module.fcntl.flock
    state = {"closed_a": False}

    def flock(fd, op):
        if op & fcntl.LOCK_EX and not state["closed_a"]:  # B's first attempt: A finishes in between
            state["closed_a"] = True
            a.close()
        return real_flock(fd, op)

    monkeypatch.setattr(cache_module.fcntl, "flock", flock)
    b = TeacherCache(p).open()
    monkeypatch.undo()
    assert state["closed_a"] and len(b) == 2  # B sees A's answers: it holds the file at the path
    b.put("x", {}, {"content": "x"})
    b.close()
    with TeacherCache(p) as c:
        assert {e["key"] for e in c.entries()} == {"x", "y", "z"}


def test_sorted_on_close_does_not_rewrite_a_sorted_file(tmp_path):
    p = tmp_path / "c.jsonl"
    with TeacherCache(p, sorted_on_close=True) as c:
        c.put("b", {}, {"content": "b"})
        c.put("a", {}, {"content": "a"})
    inode = os.stat(p).st_ino
    with TeacherCache(p, sorted_on_close=True):
        pass
    assert os.stat(p).st_ino == inode
