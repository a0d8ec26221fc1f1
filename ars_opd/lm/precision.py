"""Which device a process computes on, and which precision a model's weights and the loss's products run in.

- ``resolve_device``: ``ddp.device`` as a torch device ('auto': CUDA when visible, else CPU);

- ``frozen_model_dtype``: the weights of a model that is only scored (the OPD and evaluation teacher): bf16 on
  CUDA (an 8B teacher is 16 GB instead of 32), fp32 on CPU (CPU bf16 matmuls are slow and the offline default
  must reproduce), or what the param forces;
- ``compute_dtype`` / ``no_autocast``: the chunked losses cast explicitly, to autocast's dtype when autocast
  is on (bf16 on CUDA) and else to the weight's, and turn autocast off inside so nothing is cast twice.
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def frozen_model_dtype(choice: str, device: torch.device | str) -> torch.dtype:
    """'auto' -> bf16 on CUDA, fp32 elsewhere; 'fp32' / 'bf16' as named."""
    if choice == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if choice not in _DTYPES:
        raise ValueError(f"dtype must be auto, fp32 or bf16, got {choice!r}")
    return _DTYPES[choice]


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype products with ``weight`` run in: autocast's when it is on for its device, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def no_autocast(device_type: str):
    """Autocast off (when it is on) for code that casts explicitly."""
    return (
        torch.autocast(device_type, enabled=False)
        if torch.is_autocast_enabled(device_type)
        else contextlib.nullcontext()
    )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ddp.device is 'cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(device)
