"""User-provided models and data stay pinned: inputs mirrored as DVC deps, model pins verified at every load."""

import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from ars_opd.config import (
    INPUT_PLACEHOLDER,
    ConfigError,
    ModelsConfig,
    load_params,
    parse_section,
)
from ars_opd.models import loading
from ars_opd.models.loading import ModelPinError, load_model, model_path, read_manifest
from micro import MICRO_OVERRIDES, committed_params, load_committed_params
from tiny_models import prepare_local_models, save_tiny_model

REPO = Path(__file__).resolve().parents[1]


def _params(tmp_path: Path, data: dict | None = None, models: dict | None = None, inputs: dict | None = None) -> Path:
    raw = committed_params()
    for section, over in (("data", data), ("models", models), ("inputs", inputs)):
        raw[section].update(over or {})
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _error(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_params(path)
    return e.value


def test_inputs_must_mirror_every_local_source(tmp_path):
    data = tmp_path / "alpaca.jsonl"
    data.write_text('{"instruction": "x"}\n')
    model = tmp_path / "qwen"
    model.mkdir()
    load_committed_params()  # the default: synthetic data, built-in models, placeholders

    e = _error(_params(tmp_path, data={"source": str(data)}))
    assert e.key == "inputs.data" and f"set inputs.data: '{data}'" in str(e) and "data.source" in str(e)
    load_params(_params(tmp_path, data={"source": str(data)}, inputs={"data": str(data)}))
    # relative paths start at the repository root (the params file's directory), as for DVC
    load_params(_params(tmp_path, data={"source": "alpaca.jsonl"}, inputs={"data": "./alpaca.jsonl"}))

    e = _error(_params(tmp_path, data={"source": "tatsu-lab/alpaca"}, inputs={"data": str(data)}))
    assert e.key == "inputs.data" and f"set inputs.data: {INPUT_PLACEHOLDER}" in str(e)
    e = _error(_params(tmp_path, data={"source": "./absent.jsonl"}, inputs={"data": "./absent.jsonl"}))
    assert e.key == "data.source" and "no such file" in str(e)

    hub = {"teacher": str(model), "student": "Qwen/Qwen3-0.6B"}
    e = _error(_params(tmp_path, models=hub))
    assert e.key == "inputs.teacher" and f"set inputs.teacher: '{model}'" in str(e) and "models stage" in str(e)
    load_params(_params(tmp_path, models=hub, inputs={"teacher": str(model)}))
    e = _error(_params(tmp_path, models=hub, inputs={"teacher": str(model), "student": str(model)}))
    assert e.key == "inputs.student" and "Qwen/Qwen3-0.6B" in str(e)
    e = _error(_params(tmp_path, inputs={"teacher": "~/models/qwen"}))
    assert e.key == "inputs.teacher" and "DVC does not expand '~'" in str(e)


@pytest.fixture
def local_pair(tmp_path, char_tokenizer):
    """A local teacher directory pinned by the models stage, in tmp_path/models."""
    teacher = save_tiny_model(tmp_path / "teacher_dir", char_tokenizer)
    prepare_local_models(
        tmp_path, parse_section(ModelsConfig, {"teacher": str(teacher), "student": str(teacher)}, "models")
    )
    return tmp_path / "models", teacher


def test_a_changed_local_model_is_refused_at_load(local_pair, monkeypatch):
    models_dir, teacher = local_pair
    ref = read_manifest(models_dir)["teacher"]
    assert set(ref["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    reference = load_model(models_dir, "teacher")

    # fast path: sizes and mtimes as pinned, so nothing is hashed
    real_hash = loading.sha256_of_files
    calls = []
    monkeypatch.setattr(loading, "sha256_of_files", lambda d, *a: calls.append(d) or real_hash(d, *a))
    assert model_path(models_dir, "teacher") == str(teacher.resolve()) and calls == []

    # touched but identical: rehashed, accepted
    weights = teacher / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert model_path(models_dir, "teacher") == str(teacher.resolve()) and len(calls) == 1

    # new weights under the same name: refused, naming the file and the fix
    with torch.no_grad():
        reference.model.embed_tokens.weight.add_(1.0)
    reference.save_pretrained(teacher)
    with pytest.raises(
        ModelPinError, match=r"teacher model directory .* changed after the models stage pinned it"
    ) as e:
        load_model(models_dir, "teacher")
    assert re.search(r"; size or time changed: [^;]*model.safetensors", str(e.value)) and "Run `dvc repro`" in str(
        e.value
    )


def test_teacher_gen_refuses_a_changed_teacher_before_asking(tmp_path, local_pair, monkeypatch):
    from ars_opd.config import PathsConfig, TeacherGenConfig
    from ars_opd.teacher.client import generate

    models_dir, teacher = local_pair
    monkeypatch.chdir(tmp_path)
    paths = PathsConfig(models_dir="models")
    for split in ("train", "eval"):
        Path(getattr(paths, f"subset_{split}")).parent.mkdir(parents=True, exist_ok=True)
        Path(getattr(paths, f"subset_{split}")).write_text("")
    (teacher / "config.json").write_text((teacher / "config.json").read_text().replace("}", ',"x": 1}', 1))
    monkeypatch.setattr(generate, "local_server", lambda *a, **k: pytest.fail("server started"))
    with pytest.raises(ModelPinError, match="size or time changed: config.json"):
        generate.generate_teacher_completions(TeacherGenConfig(), paths, progress=False)


def test_a_changed_builtin_model_is_refused(tmp_path):
    over = {
        **MICRO_OVERRIDES["models"],
        "teacher_training": {**MICRO_OVERRIDES["models"]["teacher_training"], "steps": 0},
    }
    prepare_local_models(tmp_path, parse_section(ModelsConfig, over, "models"))
    load_model(tmp_path / "models", "student")
    cfg = tmp_path / "models" / "student" / "config.json"
    cfg.write_text(cfg.read_text().replace("}", ',"x": 1}', 1))
    with pytest.raises(ModelPinError, match="built-in student .* was changed after the models stage pinned it"):
        load_model(tmp_path / "models", "student")
