"""The paragraph on the regime where OPD is expected to win quotes the seed study's measurement of it, read from
the study's long-horizon section of reports/distillation.md (ars_opd.evaluation.equal_budget.regime_paragraph):
the committed study gives the committed words, and other numbers in the study give other words."""

from __future__ import annotations

import re
from pathlib import Path

from ars_opd.evaluation.distillation import merge_family_section, refresh_regime
from ars_opd.evaluation.equal_budget import (
    REGIME_FAMILY,
    REGIME_LEAD,
    STUDY_FILE,
    compare,
    family_section,
    regime_note,
    regime_paragraph,
)
from test_arms import _evaluate

REPO = Path(__file__).resolve().parents[1]
STUDY = (REPO / STUDY_FILE).read_text()


def _paragraphs(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(REGIME_LEAD)]


def _with_row(section: str, heading: str, label: str, cell: str, regime: str | None = None) -> str:
    """``section`` with the OPD − control cell of row ``label`` under the first ``heading`` (after the regime's
    heading when given) replaced by ``cell``."""
    start = section.index(f"### Regime: {regime}") if regime else 0
    at = section.index(f"# {heading}\n", start)
    row = re.compile(rf"^(\| {re.escape(label)} \|[^|]*\|[^|]*\| )[^|]*( \|)$", re.M)
    match = row.search(section, at)
    return section[: match.start()] + match.group(1) + cell + match.group(2) + section[match.end() :]


def test_the_committed_study_gives_the_committed_paragraph_everywhere():
    """What the committed study file says in both its family sections, and what the report stage wrote before
    the paragraph was generated (the file's paragraphs are the report's, byte for byte), from its tables."""
    paragraph = regime_paragraph(STUDY)
    assert _paragraphs(STUDY) == [paragraph, paragraph]  # the default family's section and the long-horizon one
    assert refresh_regime(STUDY) == STUDY
    for quoted in ("5 seeds", "300 steps an arm", "+0.03 [-0.02, 0.07]", "-12 points [-25, +0.4]"):
        assert quoted in paragraph
    cmp = compare(_evaluate(1.0, 0.5))  # OPD behind the control: the report stage's verdict adds the paragraph
    assert regime_note(cmp, STUDY) == [paragraph, ""]


def test_the_paragraph_follows_the_studys_numbers():
    section = family_section(STUDY, REGIME_FAMILY)
    changed = section.replace("Seeds: [1, 2, 3, 4, 5]", "Seeds: [1, 2, 3]", 1)
    changed = changed.replace("each arm adds 300.", "each arm adds 1000.", 1)
    changed = changed.replace(
        "(308,736 parameters) and teacher (1,067,520", "(596,049,920 parameters) and teacher (1,720,574,976"
    )
    # OPD ahead at equal steps on exact match; nothing resolved at equal FLOPs
    changed = _with_row(changed, "At equal steps", "exact match", "12.4% [3.1%, 25.2%]")
    changed = _with_row(changed, "At equal FLOPs", "reverse KL to the teacher (per token)", "0.02 [-0.01, 0.05]")
    # the fresh control's lead on exact match with the teacher's cost counted is no longer resolved
    changed = _with_row(
        changed, "At equal FLOPs, the teacher's data cost counted", "exact match", "-7.7% [-20.1%, 4.6%]", "fresh"
    )
    study = STUDY.replace(section, changed)
    paragraph = regime_paragraph(study)
    assert "3 seeds from one SFT student, 1000 steps an arm" in paragraph
    assert "(a 1.7B-parameter teacher, a 596M student)" in paragraph
    assert (
        "OPD beat continued SFT there on some measures: at equal steps OPD's exact match was higher by 12 " in paragraph
    )
    assert "points [3, 25]" in paragraph
    assert (
        "at equal FLOPs no difference was resolved (reverse KL +0.02 [-0.01, 0.05], exact match -14 points" in paragraph
    )
    assert (
        "the teacher's cost of writing them counted, the control's reverse KL was lower by 0.09 [0.04, 0.15]"
        in paragraph
    )
    assert "did not appear" not in paragraph and "5 seeds" not in paragraph
    # a rerun of the long-horizon study (its section merged into the file) updates every section's paragraph
    merged = merge_family_section(STUDY, REGIME_FAMILY, "## Task family: " + REGIME_FAMILY + "\n" + changed)
    assert _paragraphs(merged) == [paragraph, paragraph]


def test_without_the_study_the_paragraph_quotes_no_numbers():
    paragraph = regime_paragraph("")
    assert paragraph.startswith(REGIME_LEAD) and "studies/long_horizon_sweep.sh" in paragraph
    assert not re.search(r"\d+ seeds|\[[-+]?\d", paragraph)
    assert regime_paragraph(STUDY.split("## Task family: " + REGIME_FAMILY)[0]) == paragraph  # no such section
