"""Every row of a Markdown table in the committed pages has as many cells as its header.

Markdown renders a row with a missing ``|`` without complaint: its cells slide one column to the left, so a figure
reads under another arm's heading. The study notes are written by hand and spliced into the rendered pages, and a
row of them once lost a separator this way; this test reads every table of the README, the docs, the reports and
the studies' and benchmarks' READMEs.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/*.md", "reports/*.md", "studies/*.md", "bench/*.md"]


def cells(row: str) -> int:
    """The cells of one table row as Markdown counts them: code spans and escaped pipes are not separators, the
    outer pipes are optional."""
    row = re.sub(r"`[^`]*`", "code", row).replace("\\|", "")
    row = row.strip()
    row = row[1:] if row.startswith("|") else row
    row = row[:-1] if row.endswith("|") else row
    return row.count("|") + 1


def ragged_rows(markdown: str) -> list[tuple[int, int, int]]:
    """(line number, header cells, row cells) of every row whose count differs from its table's header. A table
    is a run of lines starting with ``|`` outside fenced code."""
    out, header, fenced = [], None, False
    for number, line in enumerate(markdown.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            header = None
            continue
        n = cells(line)
        if header is None:
            header = n
        elif n != header:
            out.append((number, header, n))
    return out


def test_every_committed_table_row_has_its_headers_cells():
    pages = sorted({p for pattern in PAGES for p in REPO.glob(pattern)})
    assert len(pages) > 20 and any(p.name == "pruned_recovery.md" for p in pages)
    ragged = {str(p.relative_to(REPO)): r for p in pages if (r := ragged_rows(p.read_text()))}
    assert not ragged, f"table rows whose cells do not match their header (line, header, row): {ragged}"


def test_the_counter_sees_a_missing_separator_and_not_a_piped_code_span():
    good = "| arm | a | b |\n|---|---|---|\n| x | `p|q` | 2 \\| 3 |\n"
    assert ragged_rows(good) == []
    bad = "| arm | a | b |\n|---|---|---|\n| x | 1  2 |\n\ntext\n| c | d |\n|---|---|\n"
    assert ragged_rows(bad) == [(3, 3, 2)]
    assert ragged_rows("```\n| a | b |\n| c |\n```\n") == []
