"""The exact identity of the weights an engine computes with (``ars_opd.rollouts.fingerprint``).

- One hash function on every side: the bundled server's (which the trainer uses) and the vLLM worker
  extension's copy give the same digest, -0.0 written as +0.0, for fp32 and bf16, contiguous or not; the
  extension imports only the standard library at the top (vLLM's environment has no ``ars_opd``).
- The comparison names every tensor that differs, counts what the engine could not show as left to the probe,
  checks a tied head (which the trainer does not publish) against the embedding it is tied to, and hashes a
  tensor cast to the engine's dtype where the engine holds another.
- The bundled server's ``ars_opd_fingerprint`` answers, after a load, exactly the published tensors' hashes;
  under the fault option that keeps the old weights, every tensor the update moved differs.
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ars_opd.rollouts import vllm_extension
from ars_opd.rollouts.engine_api import EngineClient
from ars_opd.rollouts.fingerprint import TrainerHashes, compare, tensor_sha256
from ars_opd.rollouts.weights import engine_state_dict, tied_aliases
from ars_opd.serving.server import app as server_app
from ars_opd.serving.server.options import ServerOptions
from server_thread import ServerThread
from tiny_models import perturbed, sync_student

EXTENSION = Path(vllm_extension.__file__)


@pytest.fixture
def student(char_tokenizer):
    return sync_student(char_tokenizer)


def test_the_extension_hashes_as_the_trainer_does_and_imports_only_the_standard_library():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)
    x[0, 0], x[1, 1] = -0.0, 0.0
    for t in (x, x.t(), x.to(torch.bfloat16), x[:, 1:3]):
        assert vllm_extension._sha256(t) == tensor_sha256(t)
    assert tensor_sha256(torch.tensor([-0.0])) == tensor_sha256(torch.tensor([0.0]))
    assert tensor_sha256(torch.tensor([1.0])) != tensor_sha256(torch.tensor([1.0 + 2**-23]))  # one ulp
    top = [n for n in ast.parse(EXTENSION.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= set(sys.stdlib_module_names), names


def test_the_comparison_names_what_differs_and_checks_the_tied_head(student):
    state = engine_state_dict(student)
    aliases = tied_aliases(student)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"} and "lm_head.weight" not in state
    from ars_opd.serving.server.weights import state_fingerprint

    engine = {"tensors": state_fingerprint(student)}
    ok = compare(engine, TrainerHashes(state, aliases))
    assert (ok.verified, ok.unread, ok.mismatched) == (len(state) + 1, [], [])
    # a stale head: the engine's head keeps the old embedding while the embedding moved
    newer = perturbed(student, 3)
    new_state = engine_state_dict(newer)
    stale_head = {"tensors": {**state_fingerprint(newer), "lm_head.weight": engine["tensors"]["lm_head.weight"]}}
    bad = compare(stale_head, TrainerHashes(new_state, aliases))
    assert bad.mismatched == ["lm_head.weight"] and bad.verified == len(state)
    assert bad.message().startswith(f"1 of its {len(state) + 1} tensors are not the published ones (lm_head.weight)")
    # what the engine cannot show is left to the probe; an engine without the method shows nothing
    partial = {"tensors": {k: v for k, v in engine["tensors"].items() if "mlp" not in k}}
    some = compare(partial, TrainerHashes(state, aliases))
    assert some.unread == [n for n in state if "mlp" in n] and not some.mismatched
    assert compare(None, TrainerHashes(state, aliases)).unread == [*state, "lm_head.weight"]


def test_an_engine_in_another_dtype_is_compared_with_the_cast_it_loaded(student):
    state = engine_state_dict(student)
    bf16 = copy.deepcopy(student).to(torch.bfloat16)  # what a bf16 engine holds after copy_ of the fp32 file
    from ars_opd.serving.server.weights import state_fingerprint

    result = compare({"tensors": state_fingerprint(bf16)}, TrainerHashes(state, tied_aliases(student)))
    assert result.verified == len(state) + 1 and not result.mismatched


@pytest.mark.parametrize("fault", [False, True])
def test_the_bundled_server_fingerprints_what_it_loaded(student, char_tokenizer, tmp_path, fault):
    directory = tmp_path / "student"
    student.save_pretrained(directory)
    char_tokenizer.save_pretrained(directory)
    newer = engine_state_dict(perturbed(student, 1))
    save_file(newer, str(tmp_path / "v1.safetensors"))
    opts = ServerOptions(model_name="student", weight_updates=True, ignore_weight_updates=fault)
    server = ServerThread(server_app.create_app(str(directory), opts))
    try:
        client = EngineClient(server.url, "student")
        client.load_weights(str(tmp_path / "v1.safetensors"))
        answer = client.fingerprint()
    finally:
        server.close()
    assert answer["vocab"] == len(char_tokenizer)
    result = compare(answer, TrainerHashes(newer, tied_aliases(student)))
    if fault:  # every tensor the update moved (all of them, the tied head included) is named
        assert result.verified == 0 and len(result.mismatched) == len(newer) + 1
    else:
        assert result.verified == len(newer) + 1 and not result.mismatched and not result.unread
