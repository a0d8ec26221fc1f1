"""Loading a trainer's published weights into the served model: the bundled server's side of weight sync.

``load_state_file(model, path)`` reads a safetensors file of Hugging Face parameter names (the student's
``state_dict()`` / ``save_pretrained`` names; a tied ``lm_head.weight`` may be absent, since it is the input
embedding's tensor) and copies it into ``model`` in place. Everything is checked before the first tensor is
copied (unknown names, missing ones, shapes, two names of one tied tensor with different values), so a file
that does not fit is refused with a 400 and leaves the model as it was: never a half-loaded model.

Tied heads: with ``tie_word_embeddings`` the output head *is* the embedding's parameter in Hugging Face
models, so copying the embedding refreshes the head; ``tie_weights()`` runs afterwards all the same, so a
model whose tying is done by reassignment is re-tied to the new tensor. (On vLLM CPU the head is a repacked
copy and needs an explicit refresh: ``ars_opd.rollouts.vllm_extension``.)

``state_fingerprint(model)`` answers the trainer's version check (``ars_opd.rollouts.fingerprint``): the sha256
of every tensor of the served model, by its Hugging Face name. This server computes with its modules' own
parameters, so every tensor is read where the forward reads it, exactly.
"""

from __future__ import annotations

import hashlib

import torch

from ars_opd.serving.server.validation import RequestError


def _read(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not isinstance(path, str) or not path:
        raise RequestError(400, "'kwargs.path' must be the path of a safetensors file", "invalid_value", "path")
    try:
        return load_file(path)
    except FileNotFoundError:
        raise RequestError(400, f"no weights file at {path} (the path is read by the server)", "invalid_value", "path")
    except (SafetensorError, OSError, ValueError) as e:
        raise RequestError(400, f"cannot read {path} as safetensors: {e}", "invalid_value", "path") from None


def load_state_file(model: torch.nn.Module, path: str, apply: bool = True, keep_head: bool = False) -> int:
    """Copy the tensors of the safetensors file ``path`` into ``model``'s parameters and buffers in place;
    return how many tensors the file holds. ``apply=False`` reads and checks the file and copies nothing
    (the fault injection of ``ServerOptions.ignore_weight_updates``); ``keep_head`` copies everything but the
    output head (``ServerOptions.keep_old_head``, ``_keep_head``). ``RequestError`` (400) when the file does not
    fit the model; the model is then unchanged."""
    if keep_head:
        _untie_head(model)
    state = _read(path)
    targets = dict(model.state_dict(keep_vars=True))  # every name, tied duplicates included
    unknown = sorted(set(state) - set(targets))
    if unknown:
        raise RequestError(400, f"{path} has tensors the served model does not: {unknown[:5]}", "invalid_value")
    loaded_storage = {targets[n].data_ptr() for n in state}
    if keep_head:  # the head the fault keeps is not looked for in the file
        loaded_storage.add(model.get_output_embeddings().weight.data_ptr())
    missing = sorted(n for n, t in targets.items() if n not in state and t.data_ptr() not in loaded_storage)
    if missing:
        raise RequestError(400, f"{path} lacks tensors of the served model: {missing[:5]}", "invalid_value")
    by_storage: dict[int, torch.Tensor] = {}
    for name, tensor in state.items():
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise RequestError(
                400,
                f"{path}: {name} has shape {tuple(tensor.shape)}, the model's {tuple(target.shape)}",
                "invalid_value",
            )
        first = by_storage.setdefault(target.data_ptr(), tensor)
        if first is not tensor and not torch.equal(first, tensor):
            raise RequestError(400, f"{path}: {name} is tied to another tensor of the file but differs from it")
    if apply:
        head = model.get_output_embeddings().weight if keep_head else None
        with torch.no_grad():
            for name, tensor in state.items():
                if targets[name] is not head:
                    targets[name].copy_(tensor)
        if getattr(model.config.get_text_config(), "tie_word_embeddings", False) and not keep_head:
            model.tie_weights()
    return len(state)


def _untie_head(model: torch.nn.Module) -> None:
    """FAULT INJECTION: give a head tied to the input embedding its own copy of the current values, so that a
    load can move the embedding and keep the old head ("new embedding, old head", what vLLM CPU's stock
    ``reload_weights`` serves)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embedding.weight:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The fingerprint of one tensor: the sha256 of its bytes in C order after ``x + 0``, which writes -0.0 as
    +0.0 and changes nothing else (a weight read back through a kernel turns -0.0 into +0.0; the two compute the
    same). The trainer's side (``ars_opd.rollouts.fingerprint``) uses this function; vLLM's worker extension
    repeats it verbatim."""
    flat = (tensor.detach().reshape(-1).to("cpu") + 0).contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_fingerprint(model: torch.nn.Module) -> dict[str, dict]:
    """``{name: {"sha256", "dtype", "shape", "via": "held"}}`` for every tensor of ``model``'s state (tied names,
    one tensor, hashed once)."""
    out: dict[str, dict] = {}
    hashed: dict[tuple, str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key not in hashed:
            hashed[key] = tensor_sha256(tensor)
        out[name] = {
            "sha256": hashed[key],
            "dtype": dtype_name(tensor.dtype),
            "shape": list(tensor.shape),
            "via": "held",
        }
    return out
