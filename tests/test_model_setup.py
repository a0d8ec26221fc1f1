import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ars_opd.config import ModelsConfig, parse_section
from ars_opd.data import synthetic
from ars_opd.data.prompts import alpaca_messages, encode_prompts
from ars_opd.lm.generation import generate_token_ids
from ars_opd.models.loading import ModelSourceError, load_model, load_tokenizer, read_manifest, resolve_pretrained
from ars_opd.models.prepare import TeacherTooWeakError
from micro import MICRO_OVERRIDES
from tiny_models import TINY, prepare_local_models, save_tiny_model


def _micro_models(**over) -> ModelsConfig:
    raw = json.loads(json.dumps(MICRO_OVERRIDES["models"]))
    for k, v in over.items():
        raw.setdefault(k, {}).update(v) if isinstance(v, dict) else raw.__setitem__(k, v)
    return parse_section(ModelsConfig, raw, "models")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return root, prepare_local_models(root, _micro_models(), metrics="metrics/models.json")  # a directory to create


@pytest.mark.slow
def test_models_stage_writes_loadable_pinned_models(built):
    root, metrics = built
    d = root / "models"
    assert sorted(p.name for p in d.iterdir()) == [
        "manifest.json",
        "student",
        "teacher",
        "teacher_train_log.json",
        "tokenizer",
    ]
    manifest = read_manifest(d)
    assert manifest["teacher"]["source"] == "builtin" and len(manifest["teacher"]["revision"]) == 64
    assert manifest["tokenizer"]["vocab_size"] == metrics["tokenizer_vocab_size"]
    assert manifest["provenance"]["versions"]["torch"].startswith("2.13")
    on_disk = json.loads((root / "metrics" / "models.json").read_text())
    assert on_disk == metrics and 0.0 <= metrics["teacher_exact_match"] <= 1.0
    assert metrics["teacher_params"] > metrics["student_params"]
    tok = load_tokenizer(d)
    for role in ("teacher", "student"):
        m = load_model(d, role)
        assert m.config.vocab_size == len(tok)
        assert (d / role / "model.safetensors").exists()
        # each model directory is self-contained (the bundled server loads it alone)
        assert AutoTokenizer.from_pretrained(d / role).get_vocab() == tok.get_vocab()


@pytest.mark.slow
def test_models_stage_is_deterministic(built, tmp_path):
    root, metrics = built
    again = prepare_local_models(tmp_path, _micro_models())
    first, second = read_manifest(root / "models"), read_manifest(tmp_path / "models")
    assert first["teacher"]["revision"] == second["teacher"]["revision"]
    assert first["student"]["revision"] == second["student"]["revision"]
    assert again["teacher_exact_match"] == metrics["teacher_exact_match"]


@pytest.mark.slow
def test_weak_teacher_gate_fails_and_writes_nothing(tmp_path):
    cfg = _micro_models(teacher_training={"min_accuracy": 0.99})
    with pytest.raises(TeacherTooWeakError, match="min_accuracy"):
        prepare_local_models(tmp_path, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_batched_greedy_generation_equals_one_by_one(built):
    root, _ = built
    tok, model = load_tokenizer(root / "models"), load_model(root / "models", "teacher")
    rows = synthetic.generate(12, seed=5)
    prompts = encode_prompts(tok, [alpaca_messages(r["instruction"], r["input"]) for r in rows])
    assert len({len(p) for p in prompts}) > 1  # ragged, so left padding is exercised
    batched = generate_token_ids(model, tok, prompts, max_new_tokens=8, batch_size=12)
    single = [generate_token_ids(model, tok, [p], max_new_tokens=8, batch_size=1)[0] for p in prompts]
    assert batched == single


def test_local_model_directory_is_pinned_by_file_hash(tmp_path, char_tokenizer):
    from ars_opd.models.builtin import build_causal_lm

    save_tiny_model(tmp_path / "m", char_tokenizer, seed=0)
    ref = resolve_pretrained(str(tmp_path / "m"))
    assert ref.source == "local" and len(ref.revision) == 64
    assert resolve_pretrained(str(tmp_path / "m")).revision == ref.revision
    m2 = AutoModelForCausalLM.from_pretrained(ref.path)
    m = build_causal_lm(TINY, char_tokenizer, seed=0)  # what was saved: the build is a function of the seed
    assert torch.equal(m2.model.embed_tokens.weight, m.model.embed_tokens.weight)


def test_pretrained_pair_with_different_tokenizers_is_refused(tmp_path, char_tokenizer):
    from ars_opd.models.tokenizer import TokenizerMismatchError, build_char_word_tokenizer

    other_tok = build_char_word_tokenizer(["Zebra"])
    for name, tok in (("t", char_tokenizer), ("s", other_tok)):
        save_tiny_model(tmp_path / name, tok)
    cfg = parse_section(ModelsConfig, {"teacher": str(tmp_path / "t"), "student": str(tmp_path / "s")}, "models")
    with pytest.raises(TokenizerMismatchError, match="do not share a tokenizer"):
        prepare_local_models(tmp_path, cfg, out="out")
    assert not (tmp_path / "out").exists()

    # the same tokenizer on both sides passes and pins both local directories
    cfg = parse_section(ModelsConfig, {"teacher": str(tmp_path / "t"), "student": str(tmp_path / "t")}, "models")
    prepare_local_models(tmp_path, cfg, out="out")
    manifest = read_manifest(tmp_path / "out")
    assert manifest["teacher"]["source"] == "local" and manifest["teacher"]["path"] == str((tmp_path / "t").resolve())
    assert load_model(tmp_path / "out", "student").config.vocab_size == len(char_tokenizer)


def _resolve_in_fresh_process(tmp_path, **env) -> str:
    """huggingface_hub reads its settings at import, so each case runs in its own interpreter."""
    import os
    import subprocess
    import sys

    full_env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), **env}
    code = (
        "from ars_opd.models.loading import resolve_pretrained, ModelSourceError\n"
        "try:\n    resolve_pretrained('Qwen/Qwen3-0.6B')\n"
        "except ModelSourceError as e:\n    print('ModelSourceError:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    return out.stdout + out.stderr


def test_hub_id_offline_and_absent_is_a_clear_error(tmp_path):
    out = _resolve_in_fresh_process(tmp_path, HF_HUB_OFFLINE="1")
    assert "ModelSourceError: Qwen/Qwen3-0.6B is not in the local Hugging Face cache and HF_HUB_OFFLINE" in out


def test_hub_unreachable_is_a_clear_error(tmp_path):
    # online mode, but the endpoint is a closed port on loopback: no traffic leaves the machine
    out = _resolve_in_fresh_process(
        tmp_path,
        HF_HUB_OFFLINE="0",
        HF_ENDPOINT="http://127.0.0.1:9",
        HF_HUB_ETAG_TIMEOUT="2",
        HF_HUB_DOWNLOAD_TIMEOUT="2",
    )
    assert (
        "ModelSourceError: cannot load Qwen/Qwen3-0.6B: not in the local Hugging Face cache and the hub "
        "could not be reached" in out
    )
    assert "Connect" in out  # the underlying cause is named


def test_missing_local_directory():
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_pretrained("./no/such/model")


def test_weak_teacher_error_names_the_params_that_fix_it(tmp_path):
    # steps 0: no training at all, so the gate must fail, and the message must say which params to change
    cfg = _micro_models(teacher_training={"steps": 0, "min_accuracy": 0.5})
    with pytest.raises(TeacherTooWeakError) as e:
        prepare_local_models(tmp_path, cfg)
    message = str(e.value)
    assert "after models.teacher_training.steps = 0 steps" in message
    assert "below models.teacher_training.min_accuracy = 50.0%" in message
    assert "raise models.teacher_training.steps" in message and "lower models.teacher_training.min_accuracy" in message
    assert not (tmp_path / "models").exists()
