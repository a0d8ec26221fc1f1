"""Losses from the last hidden states: the output projection applied one chunk of positions at a time.

Every loss of the pipeline (SFT cross-entropy, each OPD objective, evaluation's NLL and reverse KL) needs the
distribution softmax(h·Wᵀ + b) over the vocabulary at the M positions it scores. Taking it from
``model(...).logits`` materialises (B, T, V) logits and then fp32 copies of them: at Qwen3's V = 151,936 a
16 × 512 micro-batch costs about 5 GB per fp32 copy, for the student and again for the teacher. Here no
(tokens × vocabulary) tensor ever exists:

- ``last_hidden_states`` runs the causal LM (DDP-wrapped or not) so that it returns the final hidden states
  (B, T, H) and projects nothing (``logits_to_keep`` selects no position). It calls the model itself, not its
  inner decoder, so under DDP the forward goes through DDP's ``forward`` and the gradient all-reduce (and the
  consistency hook on its buckets) sees every parameter as before.
- ``OutputHead`` is the model's output embedding restricted to the shared vocabulary: ids 0..V-1 of the
  tokenizer; rows beyond it are padding and are sliced off (a view of the parameter, so tied input/output
  embeddings get one gradient, summed by autograd).
- ``chunked_head_loss`` walks the M scored rows in chunks of ``chunk_size``. Per chunk it forms the logits
  (c, V), asks the loss's ``RowTerms`` for each row's loss and the gradient of the loss with respect to those
  logits (fp32, analytic), and folds that gradient at once into the gradients of the hidden states (dz·W) and
  of the head (dzᵀ·h, accumulated in fp32). The chunk's logits are then dropped.

Why the gradient is formed in the forward pass rather than by recomputing each chunk's logits in the backward:
the loss is the last node of the graph, so its backward runs first and the fp32 (V × H) and (M × H) gradient
buffers live for the same span either way; forming them in the forward costs three matrix products per chunk
(the same three autograd runs on full logits: logits, dh, dW) where recomputation costs four plus a second
pass of the softmax, and it keeps no teacher input alive until the backward. The price is one backward per
forward (no ``retain_graph``); a second backward is a clear error.

Precision: the matrix products run in the weight's dtype, or autocast's when autocast is on (bf16 on CUDA);
the logits are upcast to fp32 per chunk for the softmaxes, and the sums over rows and chunks (the loss, the
head's gradient) accumulate in fp32. The backward scales the fp32 gradients by the incoming scalar (the
engine's K / N_global) before casting them to the parameters' dtype, so a bf16 gradient is rounded once.

A ``RowTerms`` is ``terms(z, start, end, need_grad) -> (value (c,), dz (c, V) or None)`` for rows
start..end-1, with z the fp32 logits of those rows (the callee may overwrite z). The losses' own terms live
with their definitions (``ars_opd.lm.cross_entropy``, ``ars_opd.lm.divergences``). What this leaves out: heads that
transform the logits (final soft-capping, logit scaling) are refused, not approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ars_opd.lm.precision import compute_dtype, no_autocast

RowTerms = Callable[[torch.Tensor, int, int, bool], tuple[torch.Tensor, torch.Tensor | None]]

# config attributes of architectures whose logits are not h·Wᵀ + b (Gemma 2's soft-capping, Cohere's scale)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP (``.module``) or ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def last_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """The final hidden states (B, T, H) of a causal LM (after its last norm), without computing any logits.

    ``model`` may be DDP-wrapped: it is called as a whole (so DDP's forward runs) with ``logits_to_keep``
    selecting no position; a forward hook on the inner decoder returns what the head would have received.
    ``kwargs`` go to the model (e.g. the varlen attention arguments of packed rows).
    """
    decoder = unwrap(model).get_decoder()
    captured: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda _m, _a, out: captured.append(out[0]))
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
            **kwargs,
        )
    finally:
        handle.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one call of {type(decoder).__name__} per forward, saw {len(captured)}")
    return captured[0]


def select_rows(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The rows of ``hidden`` (B, T, H) where ``mask`` (B, T) is True, in row-major order: (M, H)."""
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, mask.reshape(-1).nonzero().squeeze(-1))


def active_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module that computes for ``module``: itself, or for a module an adapter trains whole beside it (peft's
    ``ModulesToSaveWrapper``, recognised by its ``original_module`` and ``modules_to_save``; on a tied head
    the wrapper's copy is the trained embedding) the active trained copy, or the original with adapters off."""
    copies = getattr(module, "modules_to_save", None)
    if copies is None or not hasattr(module, "original_module"):
        return module
    if getattr(module, "disable_adapters", False):
        return module.original_module
    active = list(getattr(module, "active_adapters", None) or [getattr(module, "active_adapter", None)])
    if len(active) != 1 or active[0] not in copies:
        raise ValueError(f"the output head has active adapters {active}; the chunked losses need exactly one")
    return copies[active[0]]


@dataclass(frozen=True)
class OutputHead:
    """A model's output projection over the shared vocabulary: logits = hidden·weightᵀ + bias."""

    weight: torch.Tensor  # (V, H): the first V rows of the output embedding (a view: gradients reach the parameter)
    bias: torch.Tensor | None  # (V,) or None

    @classmethod
    def of(cls, model: torch.nn.Module, vocab: int | None = None) -> "OutputHead":
        """The head of ``model`` (unwrapped from DDP/compile) restricted to ids 0..vocab-1 (all rows if None)."""
        inner = unwrap(model)
        head = active_module(inner.get_output_embeddings())
        if not isinstance(head, torch.nn.Linear):
            raise TypeError(
                f"{type(inner).__name__}'s output embedding is a {type(head).__name__}, not a Linear "
                "layer: the chunked losses need logits = h·Wᵀ + b"
            )
        config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
        for attr in _LOGIT_TRANSFORMS:
            value = getattr(config, attr, None)
            if value not in (None, 1, 1.0):
                raise ValueError(
                    f"{type(inner).__name__} transforms its logits ({attr} = {value}); the chunked "
                    "losses compute h·Wᵀ + b only and would be wrong for this model"
                )
        rows = head.weight.shape[0]
        vocab = rows if vocab is None else vocab
        if not 0 < vocab <= rows:
            raise ValueError(f"the model has {rows} output rows, fewer than the {vocab} vocabulary ids to score")
        if vocab == rows:  # the parameters themselves: a slice's backward would zero-fill a (V, H) buffer to copy into
            return cls(head.weight, head.bias)
        bias = head.bias[:vocab] if head.bias is not None else None
        return cls(head.weight[:vocab], bias)

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (c, V) of a chunk of hidden rows (c, H), the product in the compute dtype."""
        dtype = compute_dtype(self.weight)
        with no_autocast(hidden.device.type):
            bias = self.bias.to(dtype) if self.bias is not None else None
            return F.linear(hidden.to(dtype), self.weight.to(dtype), bias).float()


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, terms, chunk_size):
        # hidden (M, H), weight (V, H), bias (V,) or None. One pass: each chunk's loss and, when anything needs
        # a gradient, its contribution to dL/dhidden (M, H) and dL/dweight (V, H), both fp32.
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        need = need_h or need_w or need_b
        dtype = compute_dtype(weight)
        device = hidden.device
        M, (V, H) = hidden.shape[0], weight.shape
        with no_autocast(device.type):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            total = torch.zeros((), dtype=torch.float32, device=device)
            grad_h = torch.empty((M, H), dtype=torch.float32, device=device) if need_h else None
            grad_w = None  # (V, H) fp32: the first chunk's product, then a sum (no zero-filled buffer to add to)
            grad_b = torch.zeros((V,), dtype=torch.float32, device=device) if need_b else None
            for start in range(0, M, chunk_size):
                end = min(M, start + chunk_size)
                h = h_all[start:end]  # (c, H)
                z = F.linear(h, w, b).float()  # (c, V): the only logits alive, one chunk's
                value, dz = terms(z, start, end, need)  # (c,), (c, V) fp32
                total += value.sum()
                if need:
                    if need_b:
                        grad_b += dz.sum(0)
                    if dtype == torch.float32:
                        if need_h:
                            torch.mm(dz, w, out=grad_h[start:end])
                        if need_w:
                            grad_w = torch.mm(dz.t(), h) if grad_w is None else grad_w.addmm_(dz.t(), h)
                    else:  # products in bf16/fp16 (fp32 accumulation inside each), sums over chunks in fp32
                        dz = dz.to(dtype)
                        if need_h:
                            grad_h[start:end] = torch.mm(dz, w)
                        if need_w:
                            part = torch.mm(dz.t(), h).float()
                            grad_w = part if grad_w is None else grad_w.add_(part)
                del z, dz, value
        ctx.grads = (grad_h, grad_w, grad_b) if need else None
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("chunked_head_loss supports one backward pass per forward (no retain_graph)")
        ctx.used = True
        grads, ctx.grads = ctx.grads, None
        out = []
        for g, dtype in zip(grads, ctx.dtypes):
            # scaled in fp32 by the exact incoming scalar (e.g. K / N_global), then cast once
            out.append(None if g is None else g.mul_(grad_out.to(torch.float32)).to(dtype))
        return out[0], out[1], out[2], None, None


def chunked_head_loss(hidden: torch.Tensor, head: OutputHead, terms: RowTerms, chunk_size: int = 256) -> torch.Tensor:
    """Σ over the M rows of ``terms``' per-row loss of logits = hidden·Wᵀ + b, never materialising (M, V).

    hidden: (M, H) with grad (or not); head: the output projection (its weight/bias get gradients when they
    require them); terms: see the module docstring. Returns a 0-dim fp32 tensor; backward gives exact
    gradients for the hidden rows and the head (one backward per call).
    """
    if hidden.dim() != 2 or hidden.shape[-1] != head.weight.shape[-1]:
        raise ValueError(f"hidden rows must be (M, {head.weight.shape[-1]}), got {tuple(hidden.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if hidden.shape[0] == 0:
        raise ValueError("no positions to score (every position is masked out)")
    return _ChunkedHeadLoss.apply(hidden, head.weight, head.bias, terms, int(chunk_size))


@torch.no_grad()
def target_logprobs(
    hidden: torch.Tensor,
    head: OutputHead,
    targets: torch.Tensor,
    temperatures: Sequence[float] = (1.0,),
    chunk_size: int = 256,
) -> list[torch.Tensor]:
    """log softmax(z / τ)[target] at each of the M rows, for each τ in ``temperatures``: a list of (M,) fp32.

    hidden: (M, H); targets: (M,) token ids < head.vocab. No gradient; one head product per chunk.
    """
    outs = [torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) for _ in temperatures]
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(hidden.shape[0], start + chunk_size)
        z = head.logits(hidden[start:end])  # (c, V)
        y = targets[start:end, None]
        for out, tau in zip(outs, temperatures):
            zt = z if tau == 1.0 else z / tau
            out[start:end] = zt.gather(-1, y).squeeze(-1) - torch.logsumexp(zt, -1)
    return outs


@torch.no_grad()
def topk_logprobs(
    hidden: torch.Tensor, head: OutputHead, targets: torch.Tensor, k: int, chunk_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k most likely tokens at each of the M rows and the targets' log-probabilities, at τ = 1.

    Returns (top ids (M, k) int64, their log-probs (M, k) fp32, log p(target) (M,) fp32); what a served
    teacher's ``prompt_logprobs: k`` answers, computed locally one chunk of rows at a time.
    """
    M = hidden.shape[0]
    k = min(k, head.vocab)
    ids = torch.empty((M, k), dtype=torch.long, device=hidden.device)
    lps = torch.empty((M, k), dtype=torch.float32, device=hidden.device)
    at = torch.empty(M, dtype=torch.float32, device=hidden.device)
    for start in range(0, M, chunk_size):
        end = min(M, start + chunk_size)
        z = torch.log_softmax(head.logits(hidden[start:end]), -1)  # (c, V)
        top = z.topk(k, dim=-1)
        ids[start:end], lps[start:end] = top.indices, top.values
        at[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1)
    return ids, lps, at
