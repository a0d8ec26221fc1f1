"""A vLLM worker extension that loads a trainer's published weights into the running engine (weight sync).

STANDALONE: vLLM runs in its own environment (``.venv-vllm``), which does not have the ``ars_opd`` package, so
this file imports only the standard library at the top, and torch, safetensors and vLLM inside the methods
(it runs inside vLLM's worker process). ``VLLMOptions(weight_sync=True)``
(``ars_opd.teacher.client.vllm_server``) copies it next to the server as ``ars_opd_vllm_ext.py`` and starts
vLLM with what weight sync needs, each flag for a reason measured on vLLM CPU 0.32 (fp32):

- ``VLLM_SERVER_DEV_MODE=1``: enables ``POST /collective_rpc`` ``{"method", "kwargs"}`` ->
  ``{"results": [one value per worker]}``, the route the trainer calls;
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
"""

from __future__ import annotations

import time


class ArsOpdWeightSync:
    """Mixed into vLLM's worker by ``--worker-extension-cls``; call through ``/collective_rpc``."""

    def ars_opd_load_weights(self, path: str) -> dict:
        """Load the safetensors file ``path`` (Hugging Face parameter names, as the student's ``state_dict()``;
        a tied ``lm_head.weight`` may be absent) into the served model, then refresh the embedding-derived
        kernel state (the tied head). Returns ``{"loaded": tensors in the file, "seconds": wall time,
        "refreshed": embedding-type layers re-processed}``."""
        from safetensors.torch import load_file
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        start = time.perf_counter()
        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()))
        refreshed = 0
        for module in self.model_runner.model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, VocabParallelEmbedding) and isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed += 1
        return {"loaded": len(weights), "seconds": time.perf_counter() - start, "refreshed": refreshed}

    def ars_opd_reload_weights_only(self, path: str) -> dict:
        """The stock path alone (``reload_weights`` without the refresh), kept to show by test what it misses
        (a stale tied head on vLLM CPU). Not for training."""
        from safetensors.torch import load_file

        start = time.perf_counter()
        weights = load_file(path, device="cpu")
        self.reload_weights(weights_iterator=iter(weights.items()))
        return {"loaded": len(weights), "seconds": time.perf_counter() - start}
