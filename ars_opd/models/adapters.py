"""LoRA adapters on the student (peft): attach, continue, publish as an adapter and a merged plain model.

With ``models.student_adapter.kind: lora`` a training stage trains only a LoRA adapter on the frozen
student: ``attach`` wraps the model with peft's ``get_peft_model`` (the base weights get
``requires_grad=False``, so the optimizer, DDP's all-reduce and the consistency statistics see the adapter
tensors only), and ``resume`` continues an adapter a previous stage published (OPD and the continued-SFT
control continue the SFT stage's adapter, on the same base student).

``save_trained`` publishes a stage's model directory: the merged model (W + (alpha/r)·B·A for every adapted
layer) as a plain HF directory at the top, so evaluation and the bundled server read a plain model, and the
adapter itself in ``adapter/`` (peft's format, with the base it was trained on in ``base.json``). The merge
is computed into a new state dict one layer at a time; the training model is never merged in place (an
unmerge would not restore its fp32 weights exactly).

``modules_to_save`` (e.g. ``[embed_tokens]``) trains whole modules beside the adapter, as peft does: the
module's trained copy replaces it in the merged model, and an output head tied to a trained embedding is tied
to the copy (peft's ``ensure_weight_tying``). Without it, a student with a tied head (the built-in one) keeps
its base output distribution whatever the adapter learns.

``check_adapter`` runs before any worker starts: every ``target_modules`` entry must match a linear layer
of the student (peft's rule: the module's name, or its dotted-name suffix) other than the output head (the
losses compute the logits from a plain linear head's weight, ``ars_opd.lm.head``, and refuse an adapted one;
``modules_to_save`` trains the head whole instead), every ``modules_to_save`` entry some module, and peft must
be able to wrap the student (a ``trust_remote_code`` model may have layers it cannot), all checked on a
weightless (meta-device) copy built from the student's config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ars_opd.config import AdapterConfig, ConfigError

ADAPTER_DIR = "adapter"  # the adapter, in a published model directory
BASE_FILE = "base.json"  # which base model the adapter was trained on
ADAPTER_NAME = "default"  # peft's name for the one adapter
KEY = "models.student_adapter"


def is_adapted(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def unmatched_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The entries of ``targets`` that name no linear layer of ``model``."""
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [t for t in targets if not any(_matches(n, t) for n in linear)]


def unmatched_modules(model: torch.nn.Module, names: tuple[str, ...]) -> list[str]:
    """The entries of ``names`` that name no module of ``model`` (``modules_to_save``: any module type)."""
    modules = [n for n, _ in model.named_modules() if n]
    return [t for t in names if not any(_matches(n, t) for n in modules)]


def output_head_name(model: torch.nn.Module) -> str:
    """The dotted name of ``model``'s output embedding (the head), e.g. ``lm_head``."""
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)


def input_embedding_name(model: torch.nn.Module) -> str:
    embedding = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is embedding)


def head_targets(model: torch.nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The entries of ``targets`` that would put a LoRA adapter on the output head (peft's name rule)."""
    if model.get_output_embeddings() is None:
        return []
    head = output_head_name(model)
    return [t for t in targets if _matches(head, t)]


def _lora_config(cfg: AdapterConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        # a module trained whole keeps an output head tied to it tied to the trained copy (one tensor, one gradient)
        modules_to_save=list(cfg.modules_to_save) or None,
        ensure_weight_tying=bool(cfg.modules_to_save),
    )


def check_adapter(cfg: AdapterConfig, models_dir: str | Path, trust_remote_code: bool = False) -> None:
    """Refuse, naming the key, an adapter that would not wrap the models stage's student (from its config
    alone)."""
    if not cfg.enabled:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from ars_opd.models.loading import model_path

    config = AutoConfig.from_pretrained(model_path(models_dir, "student"), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    on_head = head_targets(model, cfg.target_modules)
    if on_head:
        head = output_head_name(model)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        whole = f"[{input_embedding_name(model).rsplit('.', 1)[-1]}]" if tied else f"[{head.rsplit('.', 1)[-1]}]"
        raise ConfigError(
            f"{KEY}.target_modules",
            f"{on_head} match the student's output head ({head}), which cannot carry a LoRA adapter: every "
            "loss computes the logits h·Wᵀ + b from a plain linear head's weight, one chunk of positions at a "
            "time (ars_opd.lm.head), and training would stop at its first step; leave it out of "
            f"target_modules, or train the head whole with {KEY}.modules_to_save: {whole}"
            + (" (the head is tied to that embedding)" if tied else ""),
        )
    missing = unmatched_targets(model, cfg.target_modules)
    if missing:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"{KEY}.target_modules",
            f"{missing} match no linear layer of the student "
            f"({type(model).__name__}); its linear layers are named {names}",
        )
    unsaved = unmatched_modules(model, cfg.modules_to_save)
    if unsaved:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n and "layers." not in n})
        raise ConfigError(
            f"{KEY}.modules_to_save",
            f"{unsaved} match no module of the student ({type(model).__name__}); outside the decoder layers its "
            f"modules are named {names}",
        )
    try:
        attach(model, cfg)
    except Exception as e:  # peft refuses a layer type it has no LoRA for (remote code may bring such layers)
        why = f"peft cannot wrap the student ({type(model).__name__}) with this adapter: {type(e).__name__}: {e}"
        if trust_remote_code:
            why += "; models.trust_remote_code is true and the model's own code may use layers peft does not know"
        raise ConfigError(KEY, why) from None


def attach(model: torch.nn.Module, cfg: AdapterConfig) -> torch.nn.Module:
    """A fresh adapter on ``model`` (peft initialises B = 0, so the wrapped model computes what ``model`` does)."""
    from peft import get_peft_model

    return get_peft_model(model, _lora_config(cfg), adapter_name=ADAPTER_NAME)


def resume(base: torch.nn.Module, adapter_dir: str | Path, base_revision: str) -> torch.nn.Module:
    """Continue the adapter published in ``adapter_dir`` on ``base`` (trainable), which must be the base it was
    trained on."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    recorded = json.loads((adapter_dir / BASE_FILE).read_text()).get("revision")
    if recorded != base_revision:
        raise ValueError(
            f"the adapter in {adapter_dir} was trained on the student {recorded}, not on this run's "
            f"{base_revision}; rerun the stage that made it (dvc repro)"
        )
    return PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=ADAPTER_NAME, is_trainable=True)


def adapter_of(model_dir: str | Path) -> Path | None:
    """The adapter a stage published with its model, if it published one."""
    path = Path(model_dir) / ADAPTER_DIR
    return path if (path / "adapter_config.json").exists() else None


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's state dict of an adapted ``model``: every adapted linear layer's weight is
    W + its adapter's delta (peft's ``get_delta_weight``), a module trained whole (``modules_to_save``) is its
    trained copy, every other tensor is the base's."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    base = model.get_base_model()
    adapted = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    saved = [n for n, m in base.named_modules() if isinstance(m, ModulesToSaveWrapper)]
    out = {}
    for name, tensor in base.state_dict().items():
        whole = next((a for a in saved if name.startswith(a + ".")), None)
        if whole is not None:  # the trained copy replaces the module; its frozen original is dropped
            copy = f"{whole}.modules_to_save.{ADAPTER_NAME}."
            if name.startswith(copy):
                out[f"{whole}.{name[len(copy) :]}"] = tensor.detach()
            continue
        owner = next((a for a in adapted if name.startswith(a + ".")), None)
        if owner is None:
            out[name] = tensor.detach()
            continue
        rest = name[len(owner) + 1 :]
        if not rest.startswith("base_layer."):
            continue  # the adapter's own tensors (lora_A, lora_B)
        key = f"{owner}.{rest.removeprefix('base_layer.')}"
        if rest == "base_layer.weight":
            layer = adapted[owner]
            with torch.no_grad():
                out[key] = tensor.detach() + layer.get_delta_weight(ADAPTER_NAME).to(tensor.dtype)
        else:
            out[key] = tensor.detach()
    return out


def save_trained(model: torch.nn.Module, out_dir: str | Path, base_revision: str | None = None) -> None:
    """Write a trained student to ``out_dir`` as a plain HF model directory; an adapted one also leaves its
    adapter in ``out_dir/adapter`` (with ``base_revision``, the base it needs)."""
    out_dir = Path(out_dir)
    if not is_adapted(model):
        model.save_pretrained(out_dir, safe_serialization=True)
        return
    model.get_base_model().save_pretrained(out_dir, state_dict=merged_state_dict(model), safe_serialization=True)
    model.save_pretrained(out_dir / ADAPTER_DIR, safe_serialization=True)
    (out_dir / ADAPTER_DIR / BASE_FILE).write_text(json.dumps({"revision": base_revision}, sort_keys=True) + "\n")
