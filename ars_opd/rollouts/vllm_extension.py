"""A vLLM worker extension that loads a trainer's published weights into the running engine (weight sync) and
says exactly which weights the engine computes with (the fingerprint).

STANDALONE: vLLM runs in its own environment (``.venv-vllm``), which does not have the ``ars_opd`` package, so
this file imports only the standard library at the top, and torch, safetensors and vLLM inside the methods
(it runs inside vLLM's worker process). ``VLLMOptions(weight_sync=True)``
(``ars_opd.serving.vllm_server``) copies it next to the server as ``ars_opd_vllm_ext.py`` and starts
vLLM with what weight sync needs, each flag for a reason measured on vLLM CPU 0.32 (fp32):

- ``VLLM_SERVER_DEV_MODE=1``: enables ``POST /collective_rpc`` ``{"method", "kwargs"}`` ->
  ``{"results": [one value per worker]}``, the route the trainer calls, and ``POST /reset_prefix_cache``,
  which the trainer calls after every load: vLLM keeps cached prefixes across ``reload_weights`` and a rollout
  request reads them, so KV blocks computed under the old weights would be reused for a shared prefix;
- ``--worker-extension-cls ars_opd_vllm_ext.ArsOpdWeightSync`` with ``PYTHONPATH`` holding the copy: vLLM mixes
  this class into its worker, so ``self`` below is the worker (``self.model_runner.model``: the model);
- ``--generation-config vllm``: the checkpoint's ``generation_config.json`` (a repetition penalty, top-k...)
  must not become the server's sampling defaults; rollouts are sampled by the request's parameters alone;
- ``--no-enable-chunked-prefill``: with chunked prefill, a per-request ``seed`` on a batch of concurrent
  requests crashes the CPU engine ("CPU Generator does not use offset", then EngineDeadError and a 500 for
  every later request). Without it, one request per prompt each with its own seed runs, and a rerun draws the
  same tokens (128/128 identical).

Why not the stock ``reload_weights``: on vLLM CPU it updates the norms and the linear layers but leaves a
TIED output head stale (the served model matched "new input embedding, old head" to 4.8e-6). The CPU backend
serves every linear layer, the head included, through a kernel handler (``layer.cpu_linear``: oneDNN, or a
packed copy for small shapes) built from the weight once, after loading
(``UnquantizedEmbeddingMethod.process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``); a head
tied to the embedding is an embedding-type layer (``VocabParallelEmbedding`` / ``ParallelLMHead``) that the
reload does not re-process, so it keeps computing with the old packed copy. A naive ``model.load_weights``
fails part-way instead (the linears' weights were repacked or emptied), leaving garbage. So
``ars_opd_load_weights`` reloads through ``reload_weights`` (which handles the repacked linears) and then
re-derives the kernel state of every unquantized embedding-type layer from its (new) weight.

The fingerprint (``ars_opd_fingerprint``): the sha256 of every weight the engine computes with, under the
trainer's Hugging Face names, which the trainer compares with what it published
(``ars_opd.rollouts.fingerprint``). A tensor is read where the forward reads it:

- ``held``: a parameter the forward uses as it is (an embedding's rows, the norms; a linear layer's weight
  where no kernel handler replaced it, as on GPUs), vocabulary rows that vLLM padded sliced off;
- ``kernel``: a linear layer that computes through a kernel handler (vLLM CPU: every linear layer, whose
  weight was emptied once its handler was built, and the output head, tied or not, whose handler holds a
  packed copy): the layer's own ``quant_method.apply`` on the identity matrix, which returns Wᵀ exactly (each
  output is one weight times 1 plus products with 0, exact in floating point), so what is hashed is the copy
  the kernel computes with, not the parameter beside it. A packed layer (``packed_modules_mapping``: ``qkv_proj``
  -> ``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` -> ``gate_proj``, ``up_proj``) is split by its
  ``output_sizes`` back into the checkpoint's tensors.

A layer neither way can read (quantized, or a handler that rejects the identity) is left out, and the trainer
counts it as verified by the probe alone. Hashes are of the tensor's bytes in C order with -0.0 written as
+0.0 (the identity product turns a -0.0 weight into +0.0; the two compute the same).

Fault injection, for tests only (``ars_opd_fault``): ``ignore_weight_updates`` answers loads as done and
keeps the old weights; ``stock_reload`` loads through the stock ``reload_weights`` alone, leaving a tied head
stale on CPU. Both let a test show that the trainer's check refuses such an engine.
"""

from __future__ import annotations

import hashlib
import time

FAULTS = (None, "ignore_weight_updates", "stock_reload")


def _sha256(tensor) -> str:
    """sha256 of ``tensor``'s bytes (C order, -0.0 as +0.0); the same function as the trainer's."""
    import torch

    flat = (tensor.detach().reshape(-1).to("cpu") + 0).contiguous()  # x + 0 == x, and -0.0 + 0 == +0.0
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


class ArsOpdWeightSync:
    """Mixed into vLLM's worker by ``--worker-extension-cls``; call through ``/collective_rpc``."""

    def ars_opd_load_weights(self, path: str) -> dict:
        """Load the safetensors file ``path`` (Hugging Face parameter names, as the student's ``state_dict()``;
        a tied ``lm_head.weight`` may be absent) into the served model, then refresh the embedding-derived
        kernel state (the tied head). Returns ``{"loaded": tensors in the file, "seconds": wall time,
        "refreshed": embedding-type layers re-processed, "vocab": the ids its log-probabilities are normalised
        over (the logits processor's ``org_vocab_size``: the checkpoint's rows, padding rows included)}``."""
        from safetensors.torch import load_file
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        start = time.perf_counter()
        fault = getattr(self, "_ars_opd_fault", None)
        weights = load_file(path, device="cpu")
        refreshed = 0
        if fault != "ignore_weight_updates":
            self.reload_weights(weights_iterator=iter(weights.items()))
        if fault is None:
            for module in self.model_runner.model.modules():
                method = getattr(module, "quant_method", None)
                if isinstance(module, VocabParallelEmbedding) and isinstance(method, UnquantizedEmbeddingMethod):
                    method.process_weights_after_loading(module)
                    refreshed += 1
        return {
            "loaded": len(weights),
            "seconds": time.perf_counter() - start,
            "refreshed": refreshed,
            "vocab": self._ars_opd_vocab(),
        }

    def ars_opd_reload_weights_only(self, path: str) -> dict:
        """The stock path alone (``reload_weights`` without the refresh), kept to show by test what it misses
        (a stale tied head on vLLM CPU). Not for training."""
        from safetensors.torch import load_file

        start = time.perf_counter()
        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()))
        return {"loaded": len(weights), "seconds": time.perf_counter() - start}

    def ars_opd_fault(self, mode: str | None = None) -> dict:
        """FAULT INJECTION, for tests only: how later ``ars_opd_load_weights`` calls misbehave (``FAULTS``)."""
        if mode not in FAULTS:
            raise ValueError(f"unknown fault {mode!r}: one of {FAULTS}")
        self._ars_opd_fault = mode
        return {"fault": mode}

    def ars_opd_fingerprint(self) -> dict:
        """``{"tensors": {hf_name: {"sha256", "dtype", "shape", "via"}}, "vocab", "seconds"}`` for every weight the
        engine computes with that it can read (the module docstring)."""
        import torch

        start = time.perf_counter()
        model = self.model_runner.model
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        out: dict[str, dict] = {}
        with torch.inference_mode():
            for name, module in model.named_modules():
                for hf_name, tensor, via in _module_tensors(name, module, packed):
                    out[hf_name] = {
                        "sha256": _sha256(tensor),
                        "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape),
                        "via": via,
                    }
        return {"tensors": out, "vocab": self._ars_opd_vocab(), "seconds": time.perf_counter() - start}

    def _ars_opd_vocab(self) -> int | None:
        processor = getattr(self.model_runner.model, "logits_processor", None)
        return getattr(processor, "org_vocab_size", None)


def _module_tensors(name: str, module, packed: dict):
    """(hf_name, tensor, via) for the weights ``module`` itself computes with (not its children's)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    weight = module._parameters.get("weight")
    bias = module._parameters.get("bias")
    prefix = f"{name}." if name else ""
    if isinstance(module, (LinearBase, ParallelLMHead)):
        kernel = hasattr(module, "cpu_linear") or weight is None or weight.numel() == 0
        full = _through_kernel(module) if kernel else weight
        if full is None:
            return
        if isinstance(module, ParallelLMHead):
            full = full[: module.org_vocab_size]
        via = "kernel" if kernel else "held"
        parts = _unpacked(name, module, packed)
        yield from _split(parts, full, via)
        if bias is not None and bias.numel() > 0:
            yield from ((n.removesuffix(".weight") + ".bias", t, "held") for n, t, _ in _split(parts, bias, "held"))
        return
    for pname, param in module._parameters.items():
        if param is None or param.numel() == 0:
            continue
        tensor = param
        if isinstance(module, VocabParallelEmbedding) and pname == "weight":
            tensor = param[: module.org_vocab_size]
        yield f"{prefix}{pname}", tensor, "held"


def _unpacked(name: str, module, packed: dict) -> list[tuple[str, int]]:
    """The checkpoint's weight names of a (possibly packed) linear layer, each with its number of output rows."""
    parent, _, leaf = name.rpartition(".")
    prefix = f"{parent}." if parent else ""
    sizes = getattr(module, "output_sizes", None)
    if leaf in packed and sizes is not None and len(sizes) == len(packed[leaf]):
        return [(f"{prefix}{sub}.weight", int(n)) for sub, n in zip(packed[leaf], sizes)]
    return [(f"{name}.weight", -1)]


def _split(parts: list[tuple[str, int]], full, via: str):
    start = 0
    for hf_name, rows in parts:
        end = full.shape[0] if rows < 0 else start + rows
        yield hf_name, full[start:end], via
        start = end


def _through_kernel(module):
    """Wᵀ as the layer's kernel computes it (its ``quant_method.apply`` on the identity), transposed back; None
    when the layer cannot be read so (quantized: its kernel's weights are not the checkpoint's)."""
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = getattr(module, "quant_method", None)
    if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
        return None
    width = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
    if width is None:
        return None
    dtype = getattr(module, "params_dtype", None) or torch.get_default_dtype()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    eye = torch.eye(int(width), dtype=dtype, device=device)
    try:
        out = method.apply(module, eye, bias=None)
    except Exception:  # noqa: BLE001 - a kernel that rejects the probe input: leave the layer to the probe
        return None
    return out.t().to("cpu")
