"""The params reference page (docs/reference/params.md) covers every key and field, and is what a fresh generation
writes.

The page is generated from ``ars_opd/config.py`` and ``params.yaml`` (``ars_opd.params_reference``). The keys
are walked here independently of the generator: every key of params.yaml, recursively, from PyYAML's parse, and
every field of the section dataclasses, recursively, a mapping form of a field (``models.student``'s pruned
student) included. Each must have its entry on the committed page, with a description under it. A field added
to ``ars_opd/config.py`` without a docstring, or a page not regenerated after a change, fails here with the
command that fixes it.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest
import yaml

from ars_opd import config
from ars_opd.params_reference import REFERENCE_PAGE, REGENERATE, generate, read_yaml_keys, reference_entries
from micro import committed_params_file

REPO = Path(__file__).resolve().parents[1]
PARAMS = committed_params_file()  # the defaults the page documents, not an experiment applied in the workspace
PAGE = REPO / REFERENCE_PAGE


def _yaml_keys(node: object, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return []
    keys = []
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else name
        keys += [key, *_yaml_keys(value, key)]
    return keys


def _field_keys(cls: type, prefix: str) -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        keys.append(key)
        tp = hints[f.name]
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        for option in options:
            if dataclasses.is_dataclass(option):
                keys += _field_keys(option, key)
    return keys


def _entries(page: str) -> dict[str, str]:
    """Each key's entry on the page: the text under its heading, up to the next heading."""
    parts = re.split(r"^#{2,3} `([^`]+)`\n", page, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _description(body: str) -> str:
    """The entry's description: its paragraphs other than the facts line and the params.yaml comment."""
    paragraphs = [p.strip() for p in body.split("\n\n") if p.strip()]
    return " ".join(p for p in paragraphs[1:] if not p.startswith("In params.yaml:"))


@pytest.fixture(scope="module")
def committed() -> dict[str, str]:
    assert PAGE.exists(), f"{REFERENCE_PAGE} is missing: run `{REGENERATE}` and commit it"
    return _entries(PAGE.read_text())


def test_every_params_yaml_key_has_a_described_entry(committed):
    keys = _yaml_keys(yaml.safe_load(PARAMS.read_text()))
    assert len(keys) > 200  # the walk reached the nested sections (opd.engine.bundled.threads, ...)
    missing = [k for k in keys if k not in committed]
    assert not missing, f"params.yaml keys without an entry in {REFERENCE_PAGE}: {missing}; run `{REGENERATE}`"
    for key in (k for k in keys if "." in k):
        assert _description(committed[key]), f"{key}: no description in {REFERENCE_PAGE}"


def test_every_dataclass_field_has_a_described_entry(committed):
    keys = [k for section, cls in config.SECTIONS.items() for k in _field_keys(cls, section)]
    assert "models.student.keep_layers" in keys and "opd.engine.bundled.threads" in keys
    missing = [k for k in keys if k not in committed]
    assert not missing, f"config fields without an entry in {REFERENCE_PAGE}: {missing}; run `{REGENERATE}`"
    undescribed = [k for k in keys if not _description(committed[k])]
    assert not undescribed, f"fields without a docstring in ars_opd/config.py: {undescribed}"


def test_the_committed_page_is_a_fresh_generation():
    assert PAGE.read_text() == generate(PARAMS), (
        f"{REFERENCE_PAGE} differs from what ars_opd/config.py and params.yaml give: run `{REGENERATE}` and commit it"
    )


def test_a_field_without_a_docstring_is_refused():
    """What happens when a field is added to config.py without its docstring: the generator names it."""
    source = Path(config.__file__).read_text()
    undocumented, n = re.subn(r'(\n    max_lag: [^\n]*\n)    """.*?"""\n', r"\1", source, count=1, flags=re.S)
    assert n == 1
    entries = reference_entries(PARAMS.read_text(), undocumented)
    assert [e.key for e in entries if "." in e.key and not e.doc] == ["opd.engine.max_lag"]


def test_a_params_yaml_key_that_is_no_field_has_no_description():
    text = PARAMS.read_text().replace("\nsft:\n", "\nsft:\n  chunk_sise: 256\n", 1)
    entries = {e.key: e for e in reference_entries(text, Path(config.__file__).read_text())}
    assert entries["sft.chunk_sise"].doc == ""


def test_params_yaml_comments_are_read_with_their_keys():
    keys = read_yaml_keys(
        "# the file's header\n\n"
        "# about the section\n"
        "opd:\n"
        "  # above the key\n"
        "  loss: full_vocab   # at the end of its line\n"
        "  engine:            # a mapping\n"
        "    server: 'http://h:1/#x'  # a '#' inside quotes is the value's\n"
        "  steps: 3\n"
        "  stages:\n"
        "  - sft   # a block list\n"
        "  - opd\n"
    )
    assert list(keys) == ["opd", "opd.loss", "opd.engine", "opd.engine.server", "opd.steps", "opd.stages"]
    assert keys["opd.stages"].value == "[sft, opd]"
    assert keys["opd"].comments == ("about the section",)
    assert keys["opd.loss"] == type(keys["opd.loss"])("full_vocab", ("above the key", "at the end of its line"))
    assert keys["opd.engine"].value is None and keys["opd.engine"].comments == ("a mapping",)
    assert keys["opd.engine.server"].value == "'http://h:1/#x'"
    assert keys["opd.steps"].comments == ()
