"""Every relative link in README.md points at a file of the repository.

README.md is the front page: it links into docs/ and reports/, which move and get renamed. The docs pages'
own links (between pages, and to their headings) are checked by the docs build itself, ``mkdocs build --strict``
in ``make test``, whose validation settings in mkdocs.yml make a missing page, a missing anchor or a page left
out of the navigation an error.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlparse

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# inline links and images [text](target "title"), and reference definitions [label]: target
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def relative_links(markdown: str) -> list[str]:
    """The link targets that point into the repository: not a URL, not a mailto, not an anchor of the page
    itself. Fenced code blocks are skipped, since a bracket there is code, not a link."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    targets = INLINE.findall(text) + REFERENCE.findall(text)
    return [t for t in targets if not urlparse(t).scheme and not t.startswith("#")]


def test_every_relative_readme_link_resolves_to_a_file():
    links = relative_links(README.read_text())
    assert any(t.startswith("docs/") for t in links) and any(t.startswith("reports/") for t in links)
    missing = [t for t in links if not (REPO / unquote(t.split("#")[0])).is_file()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_link_reader_sees_what_markdown_sees():
    text = (
        "[a](docs/a.md) ![b](reports/b.png) [c](https://x.org/c) [d](#local) [e](docs/e.md#part)\n"
        "```\n[not](a/link.md)\n```\n"
        "[ref]: reports/ref.md\n"
    )
    assert relative_links(text) == ["docs/a.md", "reports/b.png", "docs/e.md#part", "reports/ref.md"]
