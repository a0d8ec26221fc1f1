"""Engine rollouts on a student whose output embedding has more rows than its tokenizer has ids (as Qwen's
151,936 rows against 151,665 ids), and on a vLLM that caches prefixes.

- **The probe's vocabulary.** The probe draws its ids from the tokenizer's (the bundled server refuses an id
  beyond them with a 400), and the trainer normalises its log-probabilities over exactly the ids the engine
  normalises over: the bundled server's tokenizer ids, vLLM's every output row (its logits processor keeps
  ``org_vocab_size``, the checkpoint's ``vocab_size``). The student's padding rows are as large as its other
  rows, so the two normalisations are far apart (the control).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ars_opd.rollouts.engine_api import EngineClient
from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan
from ars_opd.rollouts.verify import probe_bound, probe_ids, trainer_logprobs
from ars_opd.teacher.server import app as teacher_server
from ars_opd.teacher.server.options import ServerOptions
from server_thread import ServerThread

PADDING_ROWS = 13


def save_padded_student(directory: Path, tokenizer, seed: int = 0) -> Path:
    """A one-layer Llama (heads of 32: vLLM CPU serves them) with ``PADDING_ROWS`` output rows beyond the
    tokenizer's ids and tied embeddings; the padding rows larger than the others (an untrained row can hold
    any value), so that they hold a share of the probability."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer) + PADDING_ROWS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        rows = model.get_input_embeddings().weight
        rows.normal_(0, 0.25)
        rows[len(tokenizer) :].mul_(4.0)  # padding that holds mass: the two normalisations differ by far
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_hf(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, char_tokenizer) -> Path:
    return save_padded_student(tmp_path_factory.mktemp("padded_student"), char_tokenizer)


def _syncs(client, model, vocab: int, sync_dir: Path, seeds) -> list[dict]:
    """Version 0 published and checked once per probe seed, as the stage's first sync does."""
    rows = []
    for seed in seeds:
        plan = RolloutPlan(1, 0, 1, sync_dir, seed=seed, rollout_seed=0, vocab=vocab)
        rollouts = EngineRollouts(client, plan, spec=None, rank=0, world=1)
        try:
            rows.append(rollouts._publish(0, model, torch.device("cpu")))
        finally:
            rollouts.close()
    return rows


def test_a_padded_vocabulary_is_probed_over_the_bundled_engines_tokenizer_ids(padded_dir, char_tokenizer, tmp_path):
    vocab = len(char_tokenizer)
    model = load_hf(padded_dir)
    assert model.get_output_embeddings().weight.shape[0] == vocab + PADDING_ROWS
    opts = ServerOptions(model_name="student", max_batch_size=8, max_wait_ms=1, weight_updates=True)
    server = ServerThread(teacher_server.create_app(str(padded_dir), opts))
    try:
        rows = _syncs(EngineClient(server.url, "student"), model, vocab, tmp_path / "sync", range(20))
    finally:
        server.close()
    assert all(r["probe_max_abs_diff"] <= r["probe_bound"] for r in rows), rows
    # the control: normalised over every row instead, the same probe is far outside the bound
    ids = probe_ids(vocab, 32, seed=0)
    ours, top = trainer_logprobs(model, ids, torch.device("cpu"), vocab)
    rows_lp, _ = trainer_logprobs(model, ids, torch.device("cpu"))
    bound = probe_bound(model.config, len(ids) - 1, top, vocab)
    assert float((ours - rows_lp).abs().max()) > 10 * bound
