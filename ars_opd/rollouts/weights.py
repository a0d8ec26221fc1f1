"""Publishing the trainer's weights to a rollout engine, one policy version at a time.

Two transports, the same contents (``engine_state_dict``):

- ``filesystem`` (``FilesystemTransport``, any engine of ours): rank 0 writes the student's whole state dict,
  under the Hugging Face names the engine's loader expects (those of ``save_pretrained``), to
  ``<sync_dir>/policy-v<version>.safetensors``, first under a temporary name and then renamed, so an engine
  never reads a half-written file. The engine then loads that path
  (``ars_opd.rollouts.engine_api.EngineClient.load_weights``: our worker extension on vLLM, the bundled
  server's route);
- ``nccl`` (``ars_opd.rollouts.nccl_sync``, vLLM on CUDA): rank 0 broadcasts the tensors to the engine's
  workers through vLLM's weight-transfer routes.

What is published:

- a plain student: its ``state_dict()``;
- a LoRA-adapted student: the merged weights, W + the adapter's delta (``merged_state_dict``), since an
  engine serving the base model can take whole tensors but not our adapter's layout; only the base's names
  travel;
- a sharded (FSDP2) student: the full state dict, gathered to rank 0 (a collective: every rank calls).

A tied output head (``lm_head.weight`` sharing the embedding's tensor) is left out, as ``save_pretrained``
leaves it out: the engine ties it itself, and safetensors refuses two names for one tensor. Older versions
are removed once a newer one is written (the engine has loaded what it needs by then).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ars_opd.models.adapters import is_adapted, merged_state_dict

PREFIX = "policy-v"


@dataclass(frozen=True)
class Published:
    """One version on disk: where, how many bytes, and how long gathering and writing took."""

    path: Path
    version: int
    bytes: int
    seconds: float


def engine_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The student's weights under the plain model's names, contiguous, on the CPU (rank 0; {} elsewhere when
    sharded). Every rank calls: gathering a sharded model is a collective."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # sharded by FSDP2 (ars_opd.training.sharding)
        if is_adapted(model):
            raise NotImplementedError(
                "engine rollouts with a sharded (ddp.strategy: fsdp) LoRA student are not supported: "
                "use ddp.strategy: ddp, or opd.rollouts: trainer"
            )
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif is_adapted(model):
        state = merged_state_dict(model)
    else:
        state = model.state_dict()
    return _untied(model, state)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """The names ``engine_state_dict`` leaves out because they share a published tensor, each with that tensor's
    name: a tied head (``{"lm_head.weight": "model.embed_tokens.weight"}``); {} when nothing is tied."""
    base = model.get_base_model() if is_adapted(model) else model
    if not bool(getattr(getattr(base, "config", None), "tie_word_embeddings", False)):
        return {}
    names = {id(module): name for name, module in base.named_modules()}
    head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if id(head) not in names or id(embedding) not in names:
        return {}
    return {f"{names[id(head)]}.weight": f"{names[id(embedding)]}.weight"}


def _untied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names that share a tensor with an earlier one (a tied head), as save_pretrained does."""
    base = model.get_base_model() if is_adapted(model) else model
    tied = bool(getattr(getattr(base, "config", None), "tie_word_embeddings", False))
    out = {}
    for name, tensor in state.items():
        if tied and name.endswith("lm_head.weight"):
            continue
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


@dataclass(frozen=True)
class Transfer:
    """One version published to the engine: its bytes, the seconds spent writing it (0 when nothing is written)
    and the seconds until the engine had loaded it; ``vocab``, where the engine's answer says it, how many ids
    its log-probabilities are normalised over (None: the student's output rows, as vLLM normalises);
    ``prefix_cache``: False where the engine says it has no prefix cache to reset (the bundled server), None
    where it does not say (vLLM: it has one)."""

    bytes: int
    write_s: float
    load_s: float
    vocab: int | None = None
    prefix_cache: bool | None = None


class FilesystemTransport:
    """Transport ``filesystem`` (rank 0): write the version to ``sync_dir``, then have the engine load that file
    (``EngineClient.load_weights``: our vLLM worker extension, or the bundled server's route)."""

    def __init__(self, client, sync_dir: Path):
        self.client, self.sync_dir = client, sync_dir

    def publish(self, state: dict[str, torch.Tensor], version: int) -> Transfer:
        written = write_version(state, self.sync_dir, version)
        t0 = time.perf_counter()
        answer = self.client.load_weights(str(written.path))
        vocab = answer.get("vocab")
        vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
        cache = answer.get("prefix_cache")
        cache = cache if isinstance(cache, bool) else None
        return Transfer(written.bytes, written.seconds, time.perf_counter() - t0, vocab, cache)

    def close(self) -> None:
        pass


def write_version(state: dict[str, torch.Tensor], sync_dir: Path, version: int) -> Published:
    """Rank 0: write ``state`` as version ``version`` atomically and remove older versions."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    sync_dir.mkdir(parents=True, exist_ok=True)
    final = sync_dir / f"{PREFIX}{version:07d}.safetensors"
    tmp = sync_dir / f".{final.name}.{os.getpid()}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt", "ars_opd_policy_version": str(version)})
    os.replace(tmp, final)
    for old in sync_dir.glob(f"{PREFIX}*.safetensors"):
        if old != final:
            old.unlink(missing_ok=True)
    return Published(final, version, final.stat().st_size, time.perf_counter() - t0)


def remove_versions(sync_dir: Path) -> None:
    """Remove the versions (and any half-written one) from ``sync_dir``; the directory stays."""
    for old in [*sync_dir.glob(f"{PREFIX}*.safetensors"), *sync_dir.glob(f".{PREFIX}*.tmp")]:
        old.unlink(missing_ok=True)
