"""``ddp.strategy: fsdp``: the student sharded over the workers with torch's FSDP2, and its worker statistics.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer and then to the root
(embeddings, final norm, head), so each worker holds 1/K of the weights, gradients and AdamW state at rest
and gathers one layer at a time for its forward and backward. On CUDA with bf16 (``precision: auto`` or
``bf16``) the policy computes in bf16 and reduces in fp32. FSDP2's default reduction averages over the K
workers, as DDP's does, so the engine's scaling (each worker's summed token loss × K / N_global) gives the
same reduced gradient under both strategies (tested: same losses, weights to fp32 tolerance). Gradient
accumulation keeps the unsharded local gradients across micro-batches (``set_requires_gradient_sync``) and
reduce-scatters once, at the step's last micro-batch. OPD's rollouts call the root's ``generate``, which FSDP2
treats as a forward too (``register_generate``): under LoRA the root is peft's wrapper, whose ``generate`` would
otherwise bypass the root's hooks and meet the embedding still sharded.

Worker statistics (``ShardedConsistencyHook``). Each FSDP group's reduce-scatter input is that group's
whole local gradient g_k (unsharded, flattened, laid out by destination rank, zero-padded), in the engine's
scale and not pre-divided (fp32 and bf16 reduce with AVG). The hook replaces the reduce-scatter through
FSDP2's own extension point (``FSDPModule.set_custom_reduce_scatter``, on every FSDP module, since the
setter does not recurse) with one that first takes what it needs from the input and then issues exactly
the stock collective (``dist.reduce_scatter_single``), so the reduced gradients are bit-identical to FSDP
without it. Summed over groups:

- ‖g_k‖² exactly, every step (the padding is zero). At K = 1 FSDP2 skips the reduce-scatter (it copies the
  gradient), so the hook reads ‖g_1‖² from the gradients themselves, as DDP's hook reports it at K = 1;
- K = 2: with ‖ḡ‖² (the pre-clip norm), ⟨g_1, g_2⟩ and every statistic follow exactly, as under DDP;
- K > 2: ḡ is sharded after the reduce, so ⟨g_k, ḡ⟩ is not local. The hook also exchanges the input with
  one all-to-all (rank s receives every rank's chunk s: the reduce-scatter's own volume, one input-sized
  buffer) and forms the K × K Gram matrix of its chunk; one all-reduce of those K² numbers gives the exact
  Gram matrix of the local gradients, every step. So every statistic is exact under FSDP at every K
  (``gram_every`` is not needed), for twice the gradient communication at K > 2.

What has no FSDP counterpart: the replica-drift check (``ars_opd.training.drift``). Under FSDP there are no
replicas: every worker computes with the same gathered parameters and updates only its own shard, so the
silent replica divergence that check exists to find cannot arise, and the check is off (``drift_mismatch``
null every step); ``ddp.inject.kind: param_desync`` is refused with fsdp for the same reason. Nothing
replaces it: a corrupted shard is a corrupted model on every worker alike, which the averaged loss shows.

Checkpoints are sharded through ``torch.distributed.checkpoint`` (``ars_opd.training.checkpoint``), and the
published model (and each learning-curve snapshot) is the full state dict gathered to rank 0
(``full_state_dict``) into rank 0's unsharded CPU copy of the student (``publishable``), a plain HF directory.
The custom reduce-scatter interface (``_fsdp_api.ReduceScatter``) is under a private path of torch 2.13;
``tests/test_fsdp.py`` checks it against a brute force. The input is the local gradient only when FSDP
averages (``ReduceOp.AVG``) in fp32 or bf16: an fp16 reduction divides the input by about √K first, and a
forced sum reduction or a custom gradient divide factor changes the op; the hook checks both at every
reduce-scatter and refuses anything else (``check_reduction``) instead of logging silently scaled norms.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of a causal LM (peft-wrapped or not): the units FSDP shards one by one."""
    from ars_opd.lm.head import unwrap

    inner = unwrap(model)
    base = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise TypeError(
            f"{type(base).__name__}'s decoder has no `layers` list of blocks to shard; "
            "use ddp.strategy: ddp for this model"
        )
    return list(layers)


def shard_model(
    model: torch.nn.Module, device: torch.device, bf16: bool, reshard_after_forward: bool = True
) -> torch.nn.Module:
    """``fully_shard`` every decoder layer, then the root; the shards then move to ``device``.
    ``reshard_after_forward`` (``ddp.fsdp_reshard_after_forward``) applies to the layers; the root keeps
    FSDP2's own choice (not resharded after the forward: its weights, the tied head among them, are
    needed at once by the backward)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy)
    register_generate(model)
    return model.to(device)


def register_generate(model: torch.nn.Module) -> None:
    """Make the sharded root's ``generate`` gather the root's own weights (embeddings, final norm, head, and
    whatever else no decoder layer holds) for the whole call, as its ``forward`` does.

    FSDP2 gathers a module's weights in the hooks of its ``forward`` only. A plain causal LM's ``generate``
    calls ``self(...)``, the root's forward, so its rollouts go through those hooks. peft's ``PeftModel``, the
    root under LoRA, forwards ``generate`` to the HF model inside it, which calls *its own* forward: the
    root's hooks never run, the embedding is still a shard (a DTensor), and the first rollout fails
    ("aten.embedding.default got mixed torch.Tensor and DTensor"). torch's ``register_fsdp_forward_method``
    runs the root's pre- and post-forward hooks around ``generate``; the decoder layers gather themselves in
    their own forwards, as in training."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if hasattr(model, "generate"):
        register_fsdp_forward_method(model, "generate")


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def no_gradient_sync(model: torch.nn.Module):
    """FSDP's ``no_sync``: keep accumulating unsharded local gradients, no reduce-scatter."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# the reductions whose reduce-scatter input is this worker's local gradient as the engine scaled it: FSDP2
# (torch 2.13, ``_get_gradient_divide_factors``) averages fp32 and bf16 with ReduceOp.AVG and nothing
# pre-divided; an fp16 reduction divides the input by about √K first (against overflow), a forced sum reduction
# (``set_force_sum_reduction_for_comms``, implied on some devices) or a custom ``set_gradient_divide_factor``
# changes the op, and either would scale ‖g_k‖² (and the engine's loss normalisation assumes the average)
READABLE_DTYPES = (torch.float32, torch.bfloat16)


class UnreadableReductionError(RuntimeError):
    """An FSDP gradient reduction whose input is not the local gradient in the engine's scale."""


def check_reduction(op, dtype: torch.dtype) -> None:
    """Refuse a reduce-scatter the statistics cannot read: anything but ReduceOp.AVG in fp32 or bf16."""
    if dtype in READABLE_DTYPES and op == dist.ReduceOp.AVG:
        return
    raise UnreadableReductionError(
        f"FSDP reduces the gradients with {op} in {dtype}; the worker statistics (ddp.consistency) read each "
        "reduce-scatter's input as this worker's local gradient, which holds only for ReduceOp.AVG in "
        "float32 or bfloat16 (FSDP divides an fp16 input before a sum, and a forced sum reduction or a custom "
        "gradient divide factor changes the op, scaling every ‖g_k‖² and the engine's averaged gradient). "
        "Reduce in fp32 or bf16 with FSDP's default op, or set ddp.consistency: false to train without the "
        "statistics"
    )


def _reduce_scatter_base():
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class _RecordingReduceScatter:
    """The stock reduce-scatter of FSDP2, after taking this worker's statistics from its input."""

    def __init__(self, hook: "ShardedConsistencyHook"):
        self.hook = hook

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)  # FSDP writes every element, padding included

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        hook = self.hook
        check_reduction(op, input_tensor.dtype)
        t0 = time.perf_counter()
        hook._sq.append(torch.linalg.vector_norm(input_tensor, dtype=torch.float32).square())
        if hook.tracks_gram:
            received = torch.empty_like(input_tensor)
            dist.all_to_all_single(received, input_tensor, group=group)  # row s of every rank's chunk s
            chunks = received.view(hook.world_size, -1).double()
            partial = chunks @ chunks.T
            hook._gram = partial if hook._gram is None else hook._gram + partial
        hook._host.append(time.perf_counter() - t0)
        return dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


@dataclass
class ShardedConsistencyHook:
    """Per-worker gradient statistics of an FSDP2 model, taken from its reduce-scatter inputs (module doc)."""

    world_size: int
    gram_every: int = 0  # unused: under FSDP the Gram matrix (K > 2) is exact every step
    process_group: dist.ProcessGroup | None = None
    _sq: list[torch.Tensor] = field(default_factory=list)
    _gram: torch.Tensor | None = None
    _host: list[float] = field(default_factory=list)
    _full_gram: torch.Tensor | None = None
    _params: list[torch.Tensor] = field(default_factory=list)

    @property
    def tracks_gram(self) -> bool:
        return self.world_size > 2

    @property
    def tracks_dot(self) -> bool:
        return self.world_size > 2

    def attach(self, model: torch.nn.Module) -> None:
        if not is_sharded(model):
            raise TypeError("the sharded consistency hook needs a fully_shard model (use ConsistencyHook for DDP)")
        # K = 1: FSDP2 skips the reduce-scatter (it copies the local gradient into the shard, which is the whole
        # tensor), so the statistics read the gradients themselves (``local_stats``)
        self._params = [p for p in model.parameters() if p.requires_grad]
        base = _reduce_scatter_base()
        comm_type = type("RecordingReduceScatter", (_RecordingReduceScatter, base), {})
        for module in fsdp_modules(model):
            module.set_custom_reduce_scatter(comm_type(self))

    def begin_step(self, step: int) -> None:
        self._sq.clear()
        self._host.clear()
        self._gram = None
        self._full_gram = None

    @property
    def reductions(self) -> int:
        """The gradient reductions this step's statistics summed over: FSDP groups (K = 1: the parameters)."""
        return len(self._sq)

    def host_seconds(self) -> float:
        return sum(self._host)

    def local_stats(self, device: torch.device) -> torch.Tensor:
        """[‖g_k‖², ⟨g_k, ḡ⟩ or NaN], fp64 on ``device``. K > 2: a collective (the Gram's all-reduce)."""
        nan = torch.tensor(float("nan"), dtype=torch.float64, device=device)
        if self.world_size == 1 and not self._sq:
            self._record_unreduced()
        if not self._sq:
            return torch.stack([nan, nan])
        sq = torch.stack(self._sq).sum().to(device=device, dtype=torch.float64)
        if not self.tracks_gram:
            return torch.stack([sq, nan])
        gram = self._gram.to(device)
        dist.all_reduce(gram, group=self.process_group)  # Σ over shards of each shard's Gram
        self._full_gram = gram.cpu()
        rank = dist.get_rank(self.process_group)
        return torch.stack([sq, gram[rank].sum() / self.world_size])  # ⟨g_k, ḡ⟩ = mean_j ⟨g_k, g_j⟩

    def gram(self) -> torch.Tensor | None:
        """The exact (K, K) Gram matrix of the local gradients (K > 2), from ``local_stats``' all-reduce."""
        return self._full_gram

    def _record_unreduced(self) -> None:
        """K = 1: ‖g_1‖² from the gradients, which FSDP2 left unreduced (one worker's shard is the whole tensor
        and its gradient the local one), per parameter in fp32 as the reduce-scatter path takes it per group;
        the same statistics as DDP's hook at K = 1, which sees its buckets even in a world of one."""
        t0 = time.perf_counter()
        for p in self._params:
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                self._sq.append(torch.linalg.vector_norm(grad, dtype=torch.float32).square())
        self._host.append(time.perf_counter() - t0)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every worker calls (a collective): the whole model's state dict on rank 0's CPU ({} elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def publishable(model: torch.nn.Module, copy_on_main: torch.nn.Module | None) -> torch.nn.Module | None:
    """The trained student as a whole module on rank 0: itself (DDP: every rank holds it whole), or, when
    sharded, rank 0's unsharded CPU copy loaded with the gathered full state dict (every rank must call;
    others get None)."""
    if not is_sharded(model):
        return model
    state = full_state_dict(model)
    if copy_on_main is None:
        return None
    missing, unexpected = copy_on_main.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(copy_on_main, k)}
    if unexpected or set(missing) - tied:
        raise RuntimeError(
            f"the gathered state dict does not fit the student: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return copy_on_main


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    """Whether ``key`` names a parameter that shares its tensor with another (a tied head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if key not in params:
        return False
    return any(other is not key and p is params[key] for other, p in params.items() if other != key)
