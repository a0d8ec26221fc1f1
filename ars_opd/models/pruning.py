"""Depth pruning: a student made of some of the teacher's decoder layers, as an ordinary model directory.

Depth pruning plus distillation is how real small models are made (NVIDIA's Minitron prunes Llama-3.1-8B to
4B and recovers it by distillation). The student keeps the teacher's embeddings, final norm, output head and
tokenizer, and the decoder layers ``PrunedStudentConfig.layers`` names, in the teacher's order; nothing is
re-initialised, so it starts as the teacher with layers skipped (the residual stream passes a dropped layer
unchanged).

The directory written is an ordinary model of the teacher's architecture: ``num_hidden_layers`` is the kept
count, every per-layer list of the config (``layer_types`` and any other list as long as the teacher's layer
count) keeps the kept layers' entries, each kept layer's attention carries its new index (the KV cache is
indexed by it), and a tied head stays tied. transformers and vLLM load it with nothing of ours.
``prune_model`` checks what it wrote: reloaded from disk, the student's logits on a probe sequence must
equal those of the teacher run through the kept layers only, computed here from the teacher's own modules.

What it leaves out: width pruning (heads, MLP channels, hidden size), per-layer scalars that are not lists
(e.g. Qwen2's ``max_window_layers`` is refused when sliding windows are on, since its meaning shifts with the
indices), and choosing the layers from data (``studies/prune_candidates.py`` compares candidate choices by the
pruned start's reverse KL to the teacher; the chosen rule or list is a param).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from ars_opd.models.loading import ModelSourceError


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The model's list of decoder layers (``model.model.layers`` for Llama, Qwen and their kin)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ModelSourceError(
            f"cannot prune a {type(model).__name__}: depth pruning needs a decoder stack at model.layers "
            "(Llama, Qwen, Mistral, SmolLM and kin)"
        )
    return layers


def _pruned_config(config, kept: list[int]):
    text = config.get_text_config()
    n = text.num_hidden_layers
    if getattr(text, "use_sliding_window", False) and getattr(text, "max_window_layers", None) is not None:
        raise ModelSourceError(
            "cannot prune a model with sliding-window attention chosen by max_window_layers: which layers slide "
            "would change with the new indices"
        )
    new = copy.deepcopy(config)
    new_text = new.get_text_config()
    for key, value in vars(text).items():
        if isinstance(value, list) and len(value) == n and key != "architectures":
            setattr(new_text, key, [value[i] for i in kept])
    new_text.num_hidden_layers = len(kept)
    return new


def prune_model(teacher: PreTrainedModel, kept: list[int]) -> PreTrainedModel:
    """A new model of the teacher's class with the decoder layers ``kept`` (copies; the teacher is untouched)."""
    layers = decoder_layers(teacher)
    n = len(layers)
    if not kept or any(i < 0 or i >= n for i in kept) or sorted(set(kept)) != list(kept):
        raise ModelSourceError(f"cannot keep layers {kept} of a {n}-layer teacher: increasing indices in 0..{n - 1}")
    student = copy.deepcopy(teacher)
    student.config = _pruned_config(teacher.config, kept)
    student.model.config = student.config.get_text_config()
    student.model.layers = nn.ModuleList([student.model.layers[i] for i in kept])
    for new_index, layer in enumerate(student.model.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_index
    if getattr(student.config.get_text_config(), "tie_word_embeddings", False):
        student.tie_weights()
    return student.eval()


@torch.no_grad()
def skipped_layer_logits(teacher: PreTrainedModel, kept: list[int], input_ids: torch.Tensor) -> torch.Tensor:
    """The teacher's logits with only the layers ``kept`` run (the others skipped, the residual stream passing
    them unchanged): the independent reference a pruned directory is checked against. (1, T, V)"""
    inner = teacher.model
    hidden = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    embeddings = inner.rotary_emb(hidden, positions)
    mask = torch.full((input_ids.shape[1],) * 2, float("-inf")).triu(1)[None, None]
    for i in kept:
        out = inner.layers[i](hidden, attention_mask=mask, position_ids=positions, position_embeddings=embeddings)
        hidden = out[0] if isinstance(out, tuple) else out
    return teacher.lm_head(inner.norm(hidden))


def write_pruned(teacher: PreTrainedModel, kept: list[int], out: str | Path, probe_ids: list[int]) -> dict:
    """Write the student made of ``kept`` to ``out`` (safetensors, config, generation config), reload it as an
    ordinary model and check its logits on ``probe_ids`` against the teacher run through those layers only;
    returns what the manifest records (kept layers, counts, the check's largest difference)."""
    student = prune_model(teacher, kept)
    out = Path(out)
    student.save_pretrained(out, safe_serialization=True)
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([probe_ids])
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits.double()
    want = skipped_layer_logits(teacher, kept, ids).double()
    diff = float((got - want).abs().max())
    scale = float(want.abs().max())
    # two fp32 runs of the same modules, batched alike: rounding only; a wrong layer or index moves logits by O(1)
    if not diff <= 1e-3 * max(1.0, scale):
        raise ModelSourceError(
            f"the pruned student written to {out} does not reproduce the teacher run through layers {kept}: "
            f"largest logit difference {diff:.3g} (logits up to {scale:.3g})"
        )
    return {
        "kept_layers": list(kept),
        "teacher_layers": len(decoder_layers(teacher)),
        "parameters": sum(p.numel() for p in reloaded.parameters()),
        "reload_max_abs_logit_diff": diff,
    }
