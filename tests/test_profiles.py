"""Profiles (``ars_opd.profiles``): a YAML file of params overrides, run as ``dvc exp run -S key=value``.

The oracle for the overrides is DVC itself: applied by DVC's own override code to a copy of params.yaml they
must give exactly the profile merged into params.yaml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from ars_opd.config import ConfigError, load_params
from ars_opd.profiles import flatten, merged, profile_overrides, read_profile, render
from micro import committed_params_file

REPO = Path(__file__).resolve().parents[1]


def _apply_with_dvc(params: Path, overrides: list[str]) -> dict:
    from dvc.utils.hydra import apply_overrides

    apply_overrides(str(params), overrides)
    return yaml.safe_load(params.read_text())


def test_overrides_applied_by_dvc_give_the_merged_params(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(committed_params_file(), params)
    base = yaml.safe_load(params.read_text())
    profile = {
        "models": {"teacher": "inputs/x y/it's.gguf", "student": {"prune_from": "teacher", "keep_layers": [0, 2]}},
        "data": {"source": "a/b.jsonl", "subset_size": 0, "system_prompt": None, "max_malformed_fraction": 0.5},
        "synthetic": {"tasks": ["add", "reverse"]},
        "sft": {"packing": True, "lr": 2e-4},
    }
    overrides = flatten(base, profile)
    assert "models.student={prune_from: 'teacher', keep_layers: [0, 2]}" in overrides
    assert "sft.lr=0.0002" in overrides and "data.system_prompt=null" in overrides
    assert _apply_with_dvc(params, overrides) == merged(base, profile)


def test_render_writes_the_override_grammar():
    assert render("a'b\\c") == "'a\\'b\\\\c'"
    assert render([1, "x", None, True]) == "[1, 'x', null, true]"
    with pytest.raises(TypeError):
        render(object())


def test_a_bad_profile_is_refused_naming_the_key(tmp_path):
    shutil.copy(committed_params_file(), tmp_path / "params.yaml")
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "none").write_text("")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"sft": {"lr": 2.0}}))
    with pytest.raises(ConfigError, match=r"sft\.lr: must be in \(0, 1\)"):
        profile_overrides(bad, tmp_path / "params.yaml")
    bad.write_text(yaml.safe_dump({"sft": {"learning_rate": 0.1}}))
    with pytest.raises(ConfigError, match=r"sft\.learning_rate: unknown key"):
        profile_overrides(bad, tmp_path / "params.yaml")


def _committed_beside_inputs(tmp_path: Path) -> Path:
    """The committed params.yaml (whatever experiment the workspace has applied) in ``tmp_path``, beside a link
    to the repository's inputs/: a profile's local sources are relative to params.yaml's directory, as in the
    repository."""
    params = tmp_path / "params.yaml"
    shutil.copy(committed_params_file(), params)
    (tmp_path / "inputs").symlink_to(REPO / "inputs", target_is_directory=True)
    return params


def test_the_real_profile_is_valid_params(tmp_path):
    """profiles/real.yaml (make repro-real) passes every check a stage runs, with its GGUF input in place."""
    params = _committed_beside_inputs(tmp_path)
    overrides = profile_overrides(REPO / "profiles" / "real.yaml", params)
    applied = _apply_with_dvc(params, overrides)
    p = load_params(params, base=REPO)
    assert p.models.pruned_student is not None and p.models.teacher.endswith(".gguf")
    assert applied["inputs"]["teacher"] == applied["models"]["teacher"]


def test_the_cross_tokenizer_profile_is_valid_params_and_hashes_the_prune_source(tmp_path):
    """profiles/cross_tokenizer.yaml (studies/cross_tokenizer.py) passes every check a stage runs; its student is
    pruned from a GGUF file of its own, which inputs.student must mirror (DVC hashes it) and nothing else may."""
    params = _committed_beside_inputs(tmp_path)
    overrides = profile_overrides(REPO / "profiles" / "cross_tokenizer.yaml", params)
    applied = _apply_with_dvc(params, overrides)
    p = load_params(params, base=REPO)
    assert p.opd.cross_tokenizer and p.models.teacher == "builtin"
    assert applied["inputs"]["student"] == p.models.pruned_student.prune_from
    applied["inputs"]["student"] = "inputs/none"
    params.write_text(yaml.safe_dump(applied, sort_keys=False))
    with pytest.raises(ConfigError) as e:
        load_params(params, base=REPO)
    assert e.value.key == "inputs.student" and "prune_from" in str(e.value)


@pytest.mark.parametrize("name", ["larger_teacher", "qwen_pair"])
def test_the_qwen_profiles_are_valid_params_with_their_files_in_place(tmp_path, name):
    """profiles/larger_teacher.yaml and profiles/qwen_pair.yaml (after `make qwen-setup`) pass every check a stage
    runs. Nothing in the tests downloads the Qwen files, so empty files stand at their paths (the checks ask only that
    each exists and is mirrored by its inputs key). DVC applies the overrides as `ars-opd profile run` has it do, and
    the stage's reader gets opd.lr 5e-05 back as a number (DVC writes it without a dot)."""
    profile = read_profile(REPO / "profiles" / f"{name}.yaml")
    for path in {profile["models"]["teacher"], profile["models"]["student"], profile["data"]["source"]}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    params = tmp_path / "params.yaml"
    shutil.copy(committed_params_file(), params)
    applied = _apply_with_dvc(params, profile_overrides(REPO / "profiles" / f"{name}.yaml", params))
    p = load_params(params, base=tmp_path)
    assert p.models.teacher.startswith("inputs/qwen/") and p.models.teacher.endswith(".gguf")
    assert applied["inputs"]["teacher"] == p.models.teacher and applied["inputs"]["student"] == p.models.student
    assert isinstance(p.opd.lr, float) and p.opd.lr == profile["opd"]["lr"]
    if name == "larger_teacher":  # another family: the complete SmolLM2 student, scored span by span
        assert p.models.student.startswith("inputs/smollm2/") and p.models.pruned_student is None
        assert p.opd.cross_tokenizer and p.opd.loss == "sampled_token" and p.opd.span_baseline == "leave_one_out"
    else:  # one tokenizer: the full vocabulary, one GPU worker
        assert p.models.student.startswith("inputs/qwen/") and not p.opd.cross_tokenizer
        assert p.opd.loss == "full_vocab" and p.ddp.workers == 1
