"""FSDP + LoRA + on-policy OPD: the combination the README says composes.

Under LoRA the sharded root is peft's ``PeftModel``, whose ``generate`` runs the HF model inside it; that model
calls its own forward, not the root's, so FSDP's root hooks (which gather the embedding, the final norm and
the tied head) did not run for the rollouts, and the opd stage died at its first one ("aten.embedding.default
got mixed torch.Tensor and DTensor"). ``ars_opd.training.sharding.register_generate`` makes the root's
``generate`` a forward method of FSDP's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from ars_opd.artifacts import read_jsonl
from ars_opd.config import ConfigError, load_params
from micro import committed_params, distill_workspace, run_stage_here
from test_fsdp import SAME_TRAINING, _rel, _set

REPO = Path(__file__).resolve().parents[1]
# a tied head trained whole beside the adapter (the reviewer's configuration): the root then holds the trained
# copy of the embedding, which the rollouts read first
ADAPTER = {
    "kind": "lora",
    "r": 4,
    "alpha": 8.0,
    "target_modules": ["q_proj", "v_proj"],
    "modules_to_save": ["embed_tokens"],
}


@pytest.mark.slow
@pytest.mark.ddp
def test_fsdp_lora_opd_steps_equal_ddp_lora_opd_steps(tmp_path):
    """20 on-policy OPD steps (transformers' generate, the dynamic cache) of a LoRA student at K = 2, sharded
    and replicated: the same rollouts, and losses and merged weights within the bound tests/test_fsdp.py holds
    the two strategies to (``SAME_TRAINING``; the strategies sum the same gradients in another order, and
    training carries that rounding forward, so it is a statement about 20 steps, not a rounding bound)."""
    opd = {"steps": 20, "checkpoint_every": 0, "snapshot_every": 0, "on_policy_fraction": 1.0}
    runs = {}
    for strategy in ("ddp", "fsdp"):
        root = tmp_path / strategy
        distill_workspace(REPO, root, opd, workers=2)
        _set(root, ddp={"strategy": strategy}, models={"student_adapter": ADAPTER})
        run_stage_here(root, "opd")
        runs[strategy] = (
            read_jsonl(root / "data/opd/log/steps.jsonl"),
            load_file(str(root / "data/opd/model/model.safetensors")),
        )
    (a, wa), (b, wb) = runs["ddp"], runs["fsdp"]
    assert len(a) == len(b) == 20 and all(r["task/on_policy"] == 1.0 for r in b)  # every step a rollout
    assert [r["task/response_length"] for r in a] == [r["task/response_length"] for r in b]  # the same rollouts
    assert max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)) <= SAME_TRAINING
    assert _rel(wa, wb) <= SAME_TRAINING
    assert all(len(r["consistency/worker_grad_norm"]) == 2 for r in b)  # the statistics cover the adapter


def test_static_rollouts_with_a_sharded_lora_student_are_refused_before_any_worker_starts(tmp_path):
    """The static cache's loop stops each worker at its own EOS, and a sharded student needs every worker to
    run the same forwards: refused at the params check, with an adapter as without (the dynamic path above is
    the one that runs)."""
    params = committed_params()
    params["ddp"]["strategy"] = "fsdp"
    params["opd"]["rollout_cache"] = "static"
    params["models"]["student_adapter"] = ADAPTER
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError) as e:
        load_params(tmp_path / "params.yaml", sections=("models", "ddp", "opd"))
    assert e.value.key == "opd.rollout_cache" and "use dynamic" in str(e.value)
