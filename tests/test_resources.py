"""A stage's wall time and its process tree's peak memory (``ars_opd.resources``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ars_opd.resources import PeakMemory, latest_runs, timed, tree_rss_bytes

ALLOCATE = (
    "import time; b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); time.sleep(30)"
)


def test_the_peak_counts_memory_held_by_a_child_process():
    """A child holding 300 MB (every page touched) shows in the tree's resident set, and in the peak."""
    n = 300 * 2**20
    before = tree_rss_bytes(__import__("os").getpid())
    with PeakMemory(interval=0.05) as memory:
        child = subprocess.Popen([sys.executable, "-c", ALLOCATE.format(n=n)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.3)  # several samples while the child holds its memory
        finally:
            child.kill()
            child.wait()
    assert memory.proc
    assert memory.peak_bytes >= before + n, (memory.peak_bytes, before)


def test_runs_are_recorded_also_when_they_fail_and_the_latest_good_one_is_read(tmp_path):
    log = tmp_path / "logs" / "runs.jsonl"
    timed("sft", lambda: None, log)
    with pytest.raises(ValueError):
        timed("sft", lambda: (_ for _ in ()).throw(ValueError("boom")), log)
    timed("opd", lambda: time.sleep(0.05), log)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["stage"], x["ok"]) for x in lines] == [("sft", True), ("sft", False), ("opd", True)]
    assert lines[2]["wall_s"] >= 0.05 and lines[2]["peak_rss_mb"] > 0
    with open(log, "a") as f:
        f.write('{"stage": "evaluate", "ok": tr')  # a run killed while writing its line
    latest = latest_runs(log)
    assert set(latest) == {"sft", "opd"} and latest["sft"]["started"] == lines[0]["started"]
    assert latest_runs(tmp_path / "absent.jsonl") == {}
