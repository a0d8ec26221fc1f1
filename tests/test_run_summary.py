"""``ars-opd summary``: the page is read from the run's own files, and what is missing is named, not dropped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ars_opd.config import PathsConfig
from ars_opd.evaluation.run_summary import render_summary

REPO = Path(__file__).resolve().parents[1]


def _write(path: str, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj))


def test_figures_come_from_the_files_and_missing_outputs_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = PathsConfig()
    _write(
        Path(p.models_dir) / "manifest.json",
        {
            "teacher": {
                "source": "gguf",
                "gguf_file": "/x/Model.Q4_1.gguf",
                "parameters": 134_515_008,
                "revision": "ab" * 32,
            },
            "student": {
                "source": "pruned",
                "keep_layers": "deep_block",
                "kept_layers": [0, 1, 2, 29],
                "parameters": 81_413_568,
                "files_sha256": "cd" * 32,
                "teacher_layers": 30,
            },
        },
    )
    metrics = {
        "examples": 300,
        "checkable_examples": 232,
        **{
            m: {"exact_match": 0.25 * i, "reverse_kl": 3.0 - i, "teacher_nll": 2.5 - 0.5 * i}
            for i, m in enumerate(("base", "sft", "opd", "teacher"))
        },
    }
    _write(p.eval_metrics, metrics)
    Path(p.stage_runs).parent.mkdir(parents=True, exist_ok=True)
    runs = [
        {"stage": "models", "started": 1.0e9, "wall_s": 90.0, "peak_rss_mb": 2048.0, "ok": True},
        {"stage": "sft", "started": 1.0e9, "wall_s": 600.0, "peak_rss_mb": 3072.0, "ok": False},
        {"stage": "sft", "started": 1.0e9 + 700, "wall_s": 300.0, "peak_rss_mb": 1536.0, "ok": True},
    ]
    Path(p.stage_runs).write_text("".join(json.dumps(r) + "\n" for r in runs))

    page = render_summary(p, "make repro-real", "T")

    assert "`make repro-real`" in page and page.startswith("# T\n")
    assert "`Model.Q4_1.gguf` | 134.5M | 30 |" in page
    assert "layers [0, 1, 2, 29] (`keep_layers: deep_block`) | 81.4M | 4 |" in page
    assert "| opd | 50.0% | 1.0000 | 1.5000 |" in page and "232 checkable rows of the 300" in page
    assert "| sft_continued |" not in page.split("## Training")[0]  # no made-up row for a model not evaluated
    # the failed sft run is not the one reported; the total adds the successful runs only
    assert "| models | 1.5 min | 2.00 GiB |" in page and "| sft | 5.0 min | 1.50 GiB |" in page
    assert "| all stages | 6.5 min |" in page
    assert "| teacher_gen | not recorded |" in page and "| opd | missing |" in page
    assert f"subset stage's metrics ({p.subset_metrics}) are missing" in page


def test_the_command_writes_the_page_and_refuses_bad_params(tmp_path):
    out = tmp_path / "r" / "page.md"
    ok = subprocess.run(
        [sys.executable, "-m", "ars_opd.cli", "summary", "--out", str(out), "--command", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert out.read_text().startswith("# Pipeline run\n")
    bad = tmp_path / "params.yaml"
    bad.write_text("paths: {nonsense: 1}\n")
    no = subprocess.run(
        [sys.executable, "-m", "ars_opd.cli", "summary", "--out", str(out), "--command", "x", "--file", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert no.returncode == 2 and "paths.nonsense" in no.stderr
