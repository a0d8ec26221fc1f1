"""Tiny models on disk, for the tests that need a model directory.

``save_tiny_model`` writes a one-layer built-in model (hidden 16) with its tokenizer: a self-contained
Hugging Face directory, the shape of a user's local teacher or student, loadable by the bundled server
(``context``: its context length, for the server's prompt bounds). ``prepare_local_models`` runs the
models stage on one thread into ``root/models`` (metrics in ``root/m.json``), as the tests of pinning, of
the teacher gate and of the models stage itself do. ``sync_student`` and ``perturbed`` are the weight-sync
tests' student (tied head, head size 32: one vLLM CPU serves) and a moved copy of it (a newer policy version).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from ars_opd.config import ArchConfig, BaseConfig, ModelsConfig, SyntheticConfig
from ars_opd.models.builtin import build_causal_lm, save_builtin_model
from ars_opd.models.prepare import prepare_models

TINY = ArchConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
SYNC_ARCH = ArchConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, intermediate_size=96)


def sync_student(tokenizer) -> torch.nn.Module:
    """The weight-sync tests' student: ``SYNC_ARCH`` from seed 3, tied head, in eval mode."""
    return build_causal_lm(SYNC_ARCH, tokenizer, seed=3).eval()


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every parameter moved by N(0, 0.05²) noise from ``seed`` (a newer version)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return other


def save_tiny_model(directory: Path, tokenizer, seed: int = 0, context: int | None = None) -> Path:
    """``TINY`` (context ``context`` tokens, else ArchConfig's default) initialised from ``seed``, saved
    with ``tokenizer`` in ``directory``; returns ``directory``."""
    arch = TINY if context is None else dataclasses.replace(TINY, max_position_embeddings=context)
    return save_builtin_model(directory, arch, tokenizer, seed)


def prepare_local_models(root: Path, models: ModelsConfig, out: str = "models", metrics: str = "m.json") -> dict:
    """The models stage (one thread, default base seed and synthetic tasks) into ``root/out``, its metrics
    written to ``root/metrics`` and returned."""
    return prepare_models(
        BaseConfig(threads=1), models, SyntheticConfig(), str(root / out), str(root / metrics), progress=False
    )


def tiny_llama(
    vocab: int, seed: int, eos: int, pad: int, head_scale: float = 1.0, attn_implementation: str | None = "eager"
):
    """A two-layer Llama (hidden 32, eager attention, untied head) of ``vocab`` ids from ``seed``, its output head
    scaled by ``head_scale`` (far from uniform above 1, so divergences and their gradients are not all alike);
    ``attn_implementation`` None: transformers' default."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(head_scale)
    return model
