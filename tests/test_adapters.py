"""LoRA adapters on the student: only adapter tensors train, the merge is base + adapter, DDP reduces only
the adapter, bad targets are refused before any worker starts, and the stages publish and continue adapters."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file

from ars_opd.config import AdapterConfig, ArchConfig, ConfigError, ModelsConfig, OptimConfig
from ars_opd.lm.optim import make_optimizer
from ars_opd.models import adapters
from ars_opd.models.builtin import build_causal_lm
from micro import load_committed_params
from tolerances import U32, gamma

REPO = Path(__file__).resolve().parents[1]
U64 = 2.0**-53
ARCH = ArchConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=48)
LORA = AdapterConfig(kind="lora", r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _adapted(char_tokenizer, seed: int = 0):
    base = build_causal_lm(ARCH, char_tokenizer, seed)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    return adapters.attach(base, LORA), before


def _train(model, steps: int = 3, seed: int = 1) -> None:
    """A few AdamW steps on a next-token loss over random ids (B of the adapter leaves zero)."""
    g = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, OptimConfig(lr=0.05))
    for _ in range(steps):
        ids = torch.randint(0, 40, (4, 9), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_only_adapter_tensors_train_and_the_optimizer_holds_only_them(char_tokenizer):
    model, before = _adapted(char_tokenizer)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # every target of every layer got both matrices
    assert len(names) == 2 * len(LORA.target_modules) * ARCH.num_layers
    opt = make_optimizer(model, OptimConfig())
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    assert adapters.trainable_parameters(model) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    _train(model)
    state = model.get_base_model().state_dict()
    for key, value in before.items():  # the base's own tensors, under their wrapped names, are untouched
        wrapped = next(k for k in state if k.replace(".base_layer", "") == key)
        assert torch.equal(state[wrapped], value), key
    assert any(state[k].abs().sum() > 0 for k in state if ".lora_B." in k)  # the adapter did train
    opt = make_optimizer(model, OptimConfig())
    assert all(len(s) == 0 for s in opt.state.values())


def test_merged_weights_and_logits_equal_base_plus_adapter(char_tokenizer, tmp_path):
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model, _ = _adapted(char_tokenizer)
    _train(model)
    merged = adapters.merged_state_dict(model)
    base = model.get_base_model()
    scale = LORA.alpha / LORA.r
    layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == len(LORA.target_modules) * ARCH.num_layers
    for name, layer in layers.items():
        w = layer.base_layer.weight.double()
        a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
        oracle = w + scale * (b @ a)  # float64, from the adapter's own matrices (not peft's delta)
        # fl(W + fl(s·fl(B@A))): a length-r dot product, one scaling, one addition: ≤ r + 2 roundings per term
        bound = gamma(LORA.r + 2, U32) * (w.abs() + scale * (b.abs() @ a.abs()))
        err = (merged[f"{name}.weight"].double() - oracle).abs()
        assert bool((err <= bound).all()), (name, float((err - bound).max()))
    # the published directory is a plain model holding exactly these merged weights
    adapters.save_trained(model, tmp_path / "out", base_revision="r0")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="sdpa")
    assert not adapters.is_adapted(plain)
    published = plain.state_dict()
    assert set(merged) <= set(published) and all(torch.equal(published[k], merged[k]) for k in merged)
    assert (tmp_path / "out/adapter/adapter_config.json").is_file()
    assert json.loads((tmp_path / "out/adapter/base.json").read_text()) == {"revision": "r0"}
    # and its logits are those of base + adapter. In float64 (the merge is exact there up to reassociation:
    # x·(W + sBA) against x·W + s·(x·Aᵀ)·Bᵀ, fewer than 10,000 roundings along any path of these shapes)
    model = model.double()
    # both through sdpa: transformers' eager attention takes its softmax in fp32 even for float64 inputs
    model.get_base_model().set_attn_implementation("sdpa")
    plain64 = plain.double()  # as ``model``: its buffers (rotary frequencies) made in fp32, then widened
    missing, unexpected = plain64.load_state_dict(adapters.merged_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, plain64(input_ids=ids).logits
    assert float((want - got).abs().max()) <= gamma(10_000, U64) * float(want.abs().max())


def test_ddp_all_reduces_only_the_adapter(char_tokenizer):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, _ = _adapted(char_tokenizer)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        ddp = DDP(model)
        reduced = []

        def hook(state, bucket):
            reduced.append(bucket.buffer().numel())
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)
        ids = torch.randint(0, 40, (2, 7))
        ddp(input_ids=ids, labels=ids).loss.backward()
        # the reducer (it holds the group) must go while the group lives: destroyed after it, its destructor's
        # thread join can block for good (this test hung in CI)
        del ddp, hook
        gc.collect()
    finally:
        dist.destroy_process_group()
    total = sum(p.numel() for p in model.parameters())
    assert sum(reduced) == adapters.trainable_parameters(model) < total / 4


def _student_dir(char_tokenizer, tmp_path) -> Path:
    d = tmp_path / "student"
    build_causal_lm(ARCH, char_tokenizer, 0).save_pretrained(d)
    return d


def test_a_target_matching_no_linear_layer_is_refused_naming_the_key(char_tokenizer, tmp_path, monkeypatch):
    from ars_opd.models import loading

    student = _student_dir(char_tokenizer, tmp_path)
    monkeypatch.setattr(loading, "model_path", lambda models_dir, role: str(student))
    adapters.check_adapter(LORA, "unused")  # matches: no error
    adapters.check_adapter(AdapterConfig(kind=None, target_modules=("nope",)), "unused")  # off: not checked
    for bad in (("q_proj", "qkv_proj"), ("embed_tokens",)):  # an embedding is not a linear layer
        with pytest.raises(ConfigError) as e:
            adapters.check_adapter(AdapterConfig(kind="lora", target_modules=bad), "unused")
        assert e.value.key == "models.student_adapter.target_modules"
        assert repr(bad[-1]) in str(e.value) and "q_proj" in str(e.value)  # what missed, and what exists


def test_a_lora_on_the_output_head_is_refused_naming_modules_to_save(char_tokenizer, tmp_path, monkeypatch):
    """lm_head is a linear layer, so the target check passed it, and training then stopped at step 0: the losses
    take the logits from a plain linear head (OutputHead), which an adapted one is not. Refused up front."""
    from ars_opd.lm.head import OutputHead
    from ars_opd.models import loading

    student = _student_dir(char_tokenizer, tmp_path)
    monkeypatch.setattr(loading, "model_path", lambda models_dir, role: str(student))
    on_head = AdapterConfig(kind="lora", r=4, alpha=8.0, target_modules=("q_proj", "lm_head"))
    with pytest.raises(TypeError):  # what step 0 met before the refusal
        OutputHead.of(adapters.attach(build_causal_lm(ARCH, char_tokenizer, 0), on_head))
    for targets in (("q_proj", "lm_head"), ("lm_head",)):
        with pytest.raises(ConfigError) as e:
            adapters.check_adapter(AdapterConfig(kind="lora", target_modules=targets), "unused")
        assert e.value.key == "models.student_adapter.target_modules"
        message = str(e.value)
        assert "'lm_head'" in message and "output head" in message
        # the built-in head is tied to the embedding: the way to train it is that embedding, whole
        assert "models.student_adapter.modules_to_save: [embed_tokens]" in message
    adapters.check_adapter(LORA, "unused")  # the decoder's linear layers stay fine


def test_a_model_peft_cannot_wrap_is_refused_naming_trust_remote_code(char_tokenizer, tmp_path, monkeypatch):
    """A trust_remote_code model may bring its own layer types: here one layer's q_proj is not a linear layer
    (another's is, so the target check passes) and peft refuses it; the refusal names the key and the flag."""
    from transformers import AutoModelForCausalLM

    from ars_opd.models import loading

    class RemoteProjection(torch.nn.Module):  # a layer type of a model's own code, unknown to peft
        def __init__(self, d):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(d, d))

    student = _student_dir(char_tokenizer, tmp_path)
    monkeypatch.setattr(loading, "model_path", lambda models_dir, role: str(student))
    build = AutoModelForCausalLM.from_config

    def remote_model(config, **kw):
        model = build(config, **{k: v for k, v in kw.items() if k != "trust_remote_code"})
        model.model.layers[1].self_attn.q_proj = RemoteProjection(ARCH.hidden_size)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", remote_model)
    with pytest.raises(ConfigError) as e:
        adapters.check_adapter(LORA, "unused", trust_remote_code=True)
    assert e.value.key == "models.student_adapter"
    assert "peft cannot wrap" in str(e.value) and "models.trust_remote_code is true" in str(e.value)


SAVED = AdapterConfig(
    kind="lora", r=4, alpha=8.0, target_modules=("q_proj", "v_proj"), modules_to_save=("embed_tokens",)
)


def test_modules_to_save_trains_the_embedding_and_the_tied_head_follows(char_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from ars_opd.training.budget import matmul_parameters

    base = build_causal_lm(ARCH, char_tokenizer, 0)
    assert base.get_output_embeddings().weight is base.get_input_embeddings().weight  # the built-in head is tied
    plain_p = matmul_parameters(base)
    original = base.get_input_embeddings().weight.detach().clone()
    model = adapters.attach(base, SAVED)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    whole = {n for n in names if ".lora_" not in n}
    assert whole == {"base_model.model.model.embed_tokens.modules_to_save.default.weight"}
    lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert adapters.trainable_parameters(model) == lora + original.numel()
    # the budget counts the embedding once (its trained copy), as in the plain model, plus the adapter
    assert matmul_parameters(model) == plain_p + lora
    _train(model)
    copy = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is copy  # the head reads the trained copy
    # and so do the chunked losses, which read the head's weight themselves (the stages' path)
    from ars_opd.lm.head import OutputHead

    assert OutputHead.of(model).weight.data_ptr() == copy.data_ptr()
    assert not torch.equal(copy, original)
    assert torch.equal(model.get_base_model().state_dict()["model.embed_tokens.original_module.weight"], original)
    merged = adapters.merged_state_dict(model)
    assert not any("original_module" in k or "modules_to_save" in k for k in merged)
    assert torch.equal(merged["model.embed_tokens.weight"], copy.detach())
    adapters.save_trained(model, tmp_path / "out", base_revision="r0")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, attn_implementation="sdpa")
    assert torch.equal(plain.get_output_embeddings().weight, copy.detach())  # published, the head tied to it
    # the plain model computes what the adapted one does: merged in float64, the bound of the merge test above
    model = model.double()
    model.get_base_model().set_attn_implementation("sdpa")
    plain = plain.double()
    missing, unexpected = plain.load_state_dict(adapters.merged_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    ids = torch.randint(0, 40, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert float((want - got).abs().max()) <= gamma(10_000, U64) * float(want.abs().max())
    # a later stage continues the adapter and the trained embedding together, on the untouched base
    again = adapters.resume(build_causal_lm(ARCH, char_tokenizer, 0).double(), tmp_path / "out/adapter", "r0")
    again.get_base_model().set_attn_implementation("sdpa")
    assert {n for n, p in again.named_parameters() if p.requires_grad} == names
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, want)


def test_a_module_to_save_matching_nothing_is_refused_naming_the_key(char_tokenizer, tmp_path, monkeypatch):
    from ars_opd.models import loading

    student = _student_dir(char_tokenizer, tmp_path)
    monkeypatch.setattr(loading, "model_path", lambda models_dir, role: str(student))
    adapters.check_adapter(SAVED, "unused")
    with pytest.raises(ConfigError) as e:
        adapters.check_adapter(AdapterConfig(kind="lora", modules_to_save=("embed",)), "unused")
    assert e.value.key == "models.student_adapter.modules_to_save"
    assert "'embed'" in str(e.value) and "embed_tokens" in str(e.value)


def test_stages_refuse_a_bad_adapter_before_any_worker_starts(monkeypatch):
    from ars_opd.training import sft, worker
    from ars_opd.training.opd import stage as opd
    from ars_opd.training.worker import TrainingJob

    started = []
    for module in (sft, opd):
        monkeypatch.setattr(module, "launch_stage", lambda *a, **k: started.append(a))
    monkeypatch.setattr(worker, "check_adapter", lambda *a, **k: (_ for _ in ()).throw(ConfigError("k", "bad")))
    p = load_committed_params()
    p = dataclasses.replace(p, models=dataclasses.replace(p.models, student_adapter=LORA))
    for run in (
        lambda: sft.run_sft(TrainingJob.from_params("sft", p)),
        lambda: sft.run_sft_continued(TrainingJob.from_params("sft_continued", p)),
        lambda: opd.run_opd(TrainingJob.from_params("opd", p)),
    ):
        with pytest.raises(ConfigError):
            run()
    assert started == []


def test_adapter_params_are_checked():
    for bad, key in (
        ({"r": 0}, "r"),
        ({"alpha": 0}, "alpha"),
        ({"dropout": 1.0}, "dropout"),
        ({"target_modules": []}, "target_modules"),
        ({"kind": "ia3"}, "kind"),
        ({"modules_to_save": [" "]}, "modules_to_save"),
        ({"modules_to_save": ["q_proj"], "target_modules": ["q_proj"]}, "modules_to_save"),
    ):
        from ars_opd.config import parse_section

        with pytest.raises(ConfigError) as e:
            parse_section(AdapterConfig, {"kind": "lora", **bad}, "models.student_adapter")
        assert e.value.key == f"models.student_adapter.{key}"


def test_the_models_stage_reads_every_models_key_but_the_adapter():
    # trying an adapter (dvc exp run -S models.student_adapter.kind=lora) must not retrain the teacher
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    listed = {k.removeprefix("models.") for k in stages["models"]["params"] if k.startswith("models.")}
    import dataclasses

    assert listed == {f.name for f in dataclasses.fields(ModelsConfig)} - {"student_adapter"}
    for name in ("sft", "opd", "sft_continued"):
        assert "models.student_adapter" in stages[name]["params"], name


@pytest.mark.slow
@pytest.mark.ddp
def test_sft_then_opd_train_publish_and_continue_the_adapter(tmp_path):
    """sft (2 workers) trains a fresh adapter; opd (1 worker, in-process) continues it."""
    from ars_opd.models.loading import load_model
    from micro import distill_workspace, run_stage_here

    root = tmp_path / "w"
    adapter = {"kind": "lora", "r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
    distill_workspace(REPO, root, {"steps": 3}, workers=2)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["models"]["student_adapter"] = adapter
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    import shutil

    shutil.rmtree(root / "data/sft/model")  # distill_workspace's stand-in; the sft stage makes the real one
    run_stage_here(root, "sft")
    sft_dir = root / "data/sft/model"
    manifest = json.loads((root / "data/sft/log/manifest.json").read_text())
    cwd = os.getcwd()
    os.chdir(root)
    try:
        base = load_model("data/models", "student").state_dict()
    finally:
        os.chdir(cwd)
    merged = load_file(str(sft_dir / "model.safetensors"))
    adapted = [k for k in merged if ".q_proj." in k or ".v_proj." in k]
    assert adapted and all(not torch.equal(merged[k], base[k]) for k in adapted)  # the merge changed them
    assert all(torch.equal(merged[k], base[k]) for k in merged if k not in adapted)  # and nothing else
    trainable = sum(v.numel() for k, v in load_file(str(sft_dir / "adapter/adapter_model.safetensors")).items())
    assert manifest["trainable_parameters"] == trainable < manifest["parameters"]
    assert manifest["adapter"]["kind"] == "lora" and manifest["adapter_start"] == "fresh"
    assert json.loads((sft_dir / "budget.json").read_text())["trainable_parameters"] == trainable
    snapshots = sorted((sft_dir / "snapshots").iterdir())
    assert snapshots and (snapshots[-1] / "model.safetensors").is_file()  # plain merged models, for the curve

    # the same adapter trained under fsdp (peft's frozen and trainable tensors share the FSDP groups)
    sharded = tmp_path / "fsdp"
    shutil.copytree(root, sharded)
    for out in ("data/sft", "data/checkpoints", "data/live"):
        shutil.rmtree(sharded / out, ignore_errors=True)
    fsdp_params = {**params, "ddp": {**params["ddp"], "strategy": "fsdp"}}
    (sharded / "params.yaml").write_text(yaml.safe_dump(fsdp_params, sort_keys=False))
    run_stage_here(sharded, "sft")
    fsdp_merged = load_file(str(sharded / "data/sft/model/model.safetensors"))
    # the bound the FSDP tests hold the two strategies to (tests/test_fsdp.py), per tensor's largest entry
    assert all(float((fsdp_merged[k] - merged[k]).abs().max()) <= 1e-5 * float(merged[k].abs().max()) for k in merged)
    assert json.loads((sharded / "data/sft/log/manifest.json").read_text())["trainable_parameters"] == trainable
    assert (sharded / "data/sft/model/adapter/adapter_model.safetensors").is_file()

    params["ddp"]["workers"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run_stage_here(root, "opd")
    opd_manifest = json.loads((root / "data/opd/log/manifest.json").read_text())
    assert opd_manifest["adapter_start"] == "continued" and opd_manifest["workers"] == 1
    opd_merged = load_file(str(root / "data/opd/model/model.safetensors"))
    assert all(torch.equal(opd_merged[k], base[k]) for k in opd_merged if k not in adapted)
    assert any(not torch.equal(opd_merged[k], merged[k]) for k in adapted)  # OPD moved the adapter further
    budget = json.loads((root / "data/opd/model/budget.json").read_text())
    assert budget["steps"] == manifest["steps"] + 3  # from scratch: SFT's steps, then OPD's


@pytest.mark.slow
def test_sft_and_opd_stages_train_an_adapter_with_a_module_trained_whole(tmp_path):
    """modules_to_save through the stages (one in-process worker each): the chunked losses read the trained
    copy of the tied embedding, which the published model carries; opd continues both."""
    from ars_opd.models.loading import load_model, load_model_dir
    from micro import distill_workspace, run_stage_here

    root = tmp_path / "w"
    distill_workspace(REPO, root, {"steps": 2}, workers=1)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["models"]["student_adapter"] = {
        "kind": "lora",
        "r": 4,
        "alpha": 8.0,
        "target_modules": ["q_proj", "v_proj"],
        "modules_to_save": ["embed_tokens"],
    }
    params["sft"]["steps"] = 3
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    import shutil

    shutil.rmtree(root / "data/sft/model")
    run_stage_here(root, "sft")
    run_stage_here(root, "opd")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        base = load_model("data/models", "student").state_dict()
        sft, opd = (load_model_dir(f"data/{stage}/model", stage=stage).state_dict() for stage in ("sft", "opd"))
    finally:
        os.chdir(cwd)
    key = "model.embed_tokens.weight"
    assert not torch.equal(sft[key], base[key]) and not torch.equal(opd[key], sft[key])  # trained, then continued
    for trained in (sft, opd):
        assert torch.equal(trained["lm_head.weight"], trained[key])  # published with the head tied to it
