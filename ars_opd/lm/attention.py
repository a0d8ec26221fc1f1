"""Attention for packed rows (several sequences per row) that never builds a dense (L × L) mask.

A packed row (``ars_opd.lm.batching.pack_sequences``) carries position ids that restart at 0 for each
sequence and ``cu_seq_lens``, the sequences' boundaries in the flattened (rows × L) token stream. A token
may attend to the earlier tokens of its own sequence only. Three ways to compute that, best first:

- ``flash``: flash-attention's varlen kernel (``flash_attention_2``) where the ``flash_attn`` package is
  installed (CUDA): transformers passes ``cu_seq_lens_q/k`` and ``max_length_q/k`` straight to it;
- ``flex``: torch FlexAttention with a document mask (``flex_attention``): transformers derives the
  sequences from the position ids and builds a block-sparse ``BlockMask`` (compiled; CUDA only for training:
  FlexAttention has no backward on CPU);
- ``sdpa``: ``scaled_dot_product_attention`` once per sequence, causal, registered with transformers'
  attention interface as ``ars_varlen_sdpa`` so transformers builds no mask at all for it.

``use_packed_attention(model, preference)`` switches a model to one of them (the choice is not saved with
the model: transformers keeps the attention implementation out of ``config.json``). Packed batches must be
passed with ``attention_mask=None`` and ``use_cache=False`` (transformers only treats position ids as
sequence boundaries then), which ``packed_model_inputs`` does.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

VARLEN_SDPA = "ars_varlen_sdpa"
_IMPLEMENTATIONS = {"flash": "flash_attention_2", "flex": "flex_attention", "sdpa": VARLEN_SDPA}


def packed_segments(
    cu_seq_lens: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, length: int
) -> list[tuple[int, int]]:
    """[start, end) of every sequence in the flattened (rows × length) token stream."""
    if cu_seq_lens is not None:
        bounds = cu_seq_lens.tolist()
        return list(zip(bounds[:-1], bounds[1:]))
    if position_ids is None:
        raise ValueError("packed attention needs cu_seq_lens_q or position_ids to find the sequences")
    flat = position_ids.expand(rows, length).reshape(-1)
    starts = (flat == 0).nonzero().squeeze(-1).tolist()
    return list(zip(starts, starts[1:] + [flat.numel()]))


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per sequence of packed rows. query (R, Hq, L, D), key/value (R, Hkv, L, D) -> (R, L, Hq, D)."""
    if attention_mask is not None:
        raise ValueError(f"{VARLEN_SDPA} takes no attention mask: pass packed rows with attention_mask=None")
    if getattr(module, "sliding_window", None):
        raise NotImplementedError(f"{VARLEN_SDPA} does not implement sliding-window attention")
    R, Hq, L, D = query.shape
    segments = packed_segments(kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids"), R, L)
    q, k, v = (x.transpose(1, 2).reshape(R * L, x.shape[1], D) for x in (query, key, value))  # (R·L, heads, D)
    out = torch.empty_like(q)  # (R·L, Hq, D)
    for start, end in segments:
        seg = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            dropout_p=dropout if module.training else 0.0,
            is_causal=True,
            scale=scaling,
            enable_gqa=Hq != key.shape[1],
        )  # (Hq, n, D)
        out[start:end] = seg.transpose(0, 1)
    return out.view(R, L, Hq, D), None


def register_varlen_sdpa() -> None:
    """Make the per-sequence SDPA of packed rows a transformers attention implementation (``VARLEN_SDPA``)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)


def packed_attention_implementation(preference: str, device: torch.device | str) -> str:
    """The transformers attention implementation for packed rows: 'auto' -> flash (CUDA, flash_attn installed),
    else flex on CUDA, else per-sequence SDPA. An explicit choice that cannot run here is an error."""
    cuda = torch.device(device).type == "cuda"
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if preference == "auto":
        preference = "flash" if cuda and has_flash else "flex" if cuda else "sdpa"
    if preference not in _IMPLEMENTATIONS:
        raise ValueError(f"packed attention must be auto, flash, flex or sdpa, got {preference!r}")
    if preference == "flash" and not (cuda and has_flash):
        raise ValueError("sft.packed_attention: flash needs CUDA and the flash_attn package; use flex or sdpa")
    if preference == "flex" and not cuda:
        raise ValueError(
            "sft.packed_attention: flex trains on CUDA only (FlexAttention has no backward on CPU); use sdpa or auto"
        )
    if preference == "sdpa":
        register_varlen_sdpa()
    return _IMPLEMENTATIONS[preference]


def use_packed_attention(model: torch.nn.Module, preference: str = "auto") -> str:
    """Switch ``model`` to the attention implementation for packed rows; returns its name."""
    name = packed_attention_implementation(preference, next(model.parameters()).device)
    model.set_attn_implementation(name)
    return name


def packed_model_inputs(tensors: dict[str, torch.Tensor]) -> dict:
    """Model keyword arguments for a packed batch (input_ids, position_ids, cu_seq_lens from ``pack_sequences``)."""
    cu = tensors["cu_seq_lens"]
    longest = int((cu[1:] - cu[:-1]).max())
    return {
        "input_ids": tensors["input_ids"],
        "position_ids": tensors["position_ids"],
        "attention_mask": None,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
