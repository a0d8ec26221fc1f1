"""Engine rollouts on a student whose output embedding has more rows than its tokenizer has ids (as Qwen's
151,936 rows against 151,665 ids), and on a vLLM that caches prefixes.

- **vLLM's prefix cache across a load.** With prefix caching on (vLLM's default), rollouts after a load alone
  reuse KV blocks of the old weights for a shared prefix while the probe passes; the stage's sync resets the
  cache after every load, and the lag-0 check would refuse the stale rollouts.
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
from ars_opd.rollouts.verify import StaleEngineError, probe_bound, probe_ids, trainer_logprobs
from ars_opd.serving.server import app as server_app
from ars_opd.serving.server.options import ServerOptions
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
    server = ServerThread(server_app.create_app(str(padded_dir), opts))
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


# ---- a real vLLM: the padded student, served with prefix caching on ------------------------------------------


@pytest.fixture(scope="module")
def padded_vllm(padded_dir, tmp_path_factory):
    """One vLLM for the module, a rollout engine (our extension, dev mode) serving the padded student WITH
    prefix caching (vLLM's default, not the flags the stage starts it with); an error, never a skip."""
    from ars_opd.serving.vllm_server import VLLMOptions, VLLMServer

    opts = VLLMOptions(
        served_model_name="student",
        weight_sync=True,
        prefix_caching=True,
        max_model_len=512,
        one_process=True,
    )
    server = VLLMServer(padded_dir, opts, log_path=tmp_path_factory.mktemp("vllm-padded") / "vllm.log")
    try:
        server.start()
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.vllm
def test_vllm_normalises_over_every_row_and_the_probe_follows_it(padded_vllm, padded_dir, char_tokenizer, tmp_path):
    vocab = len(char_tokenizer)
    model = load_hf(padded_dir)
    client = EngineClient(padded_vllm.url, "student")
    rows = _syncs(client, model, vocab, tmp_path / "sync", range(3))
    assert all(r["probe_max_abs_diff"] <= r["probe_tolerance"] for r in rows), rows
    from safetensors.torch import save_file

    from ars_opd.rollouts.weights import engine_state_dict

    save_file(engine_state_dict(model), str(tmp_path / "v0.safetensors"))
    assert client.load_weights(str(tmp_path / "v0.safetensors"))["vocab"] == vocab + PADDING_ROWS


def _dlogp(client, model, prompts: list[list[int]], seeds: list[int]) -> float:
    """Rollouts from the engine (temperature 1), and the mean |engine − trainer| log-probability of their sampled
    tokens, the trainer's normalised over every output row as vLLM's are."""
    from ars_opd.rollouts.engine_api import SamplingSpec

    rollouts = client.generate(prompts, SamplingSpec(1.0, 1.0, 8, ()), seeds)
    diffs = []
    for prompt, r in zip(prompts, rollouts):
        ids = torch.tensor([prompt + r.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double(), -1)
        mine = logp.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        diffs.append((mine - torch.tensor(r.logprobs, dtype=torch.float64)).abs())
    return float(torch.cat(diffs).mean())


@pytest.mark.vllm
def test_every_load_resets_vllms_prefix_cache(padded_vllm, padded_dir, char_tokenizer, tmp_path):
    """Rollouts sharing a prefix longer than a KV block (128 tokens on vLLM CPU) fill the prefix cache under
    version 0. After a load alone, the same prompts reuse those blocks: their log-probabilities are version 0's
    context under version 1's weights, far from the trainer's (what the lag-0 check refuses), while the probe,
    whose requests skip reading the cache, would pass. After the stage's sync (the load, then the reset), they
    are version 1's."""
    from safetensors.torch import save_file

    from ars_opd.rollouts.weights import engine_state_dict
    from tiny_models import perturbed

    v0 = load_hf(padded_dir)
    v1 = perturbed(v0, 1)
    save_file(engine_state_dict(v1), str(tmp_path / "v1.safetensors"))
    text = "Reverse the word and then sort the letters of the result, keeping the case of each: " * 3
    prefix = char_tokenizer(text, add_special_tokens=False)["input_ids"][:160]
    assert len(prefix) == 160
    prompts = [prefix + char_tokenizer(w, add_special_tokens=False)["input_ids"] for w in ("cat", "dog", "sun", "sky")]
    seeds = [1, 2, 3, 4]
    client = EngineClient(padded_vllm.url, "student")
    plan = RolloutPlan(3, 0, 1, tmp_path / "sync", seed=0, rollout_seed=0, vocab=len(char_tokenizer))
    rollouts = EngineRollouts(client, plan, spec=None, rank=0, world=1)
    try:
        rollouts._publish(0, v0, torch.device("cpu"))
        at_v0 = _dlogp(client, v0, prompts, seeds)  # fills the prefix cache with version 0's blocks
        client.load_weights(str(tmp_path / "v1.safetensors"))  # the load alone
        stale = _dlogp(client, v1, prompts, seeds)
        rollouts._publish(1, v1, torch.device("cpu"))  # the stage's sync
        fresh = _dlogp(client, v1, prompts, seeds)
    finally:
        rollouts.close()
    tau = rollouts.tolerance
    print(f"mean |engine - trainer| log p: version 0 {at_v0:.3g}, a load alone {stale:.3g}, the sync {fresh:.3g}")
    print(f"tolerance {tau:.3g}")
    assert at_v0 <= tau and fresh <= tau < stale
    from ars_opd.rollouts.version_check import check_lag0

    with pytest.raises(StaleEngineError, match="at step 1 the rollout engine"):  # what a lag-0 step would do
        check_lag0(1, stale, tau, client.url, "refuse")
