"""The exact identity of the weights an engine computes with: one sha256 per tensor, under the trainer's Hugging
Face names, compared with the tensors the trainer published.

The probe (``ars_opd.rollouts.verify``) compares log-probabilities within a tolerance, so an update smaller than
twice the tolerance leaves a stale engine undetected. A hash has no tolerance: after each load the engine hashes
what it holds (``POST /collective_rpc`` ``ars_opd_fingerprint``: the bundled server every tensor of its model,
``ars_opd.serving.server.weights``; vLLM our worker extension, ``ars_opd.rollouts.vllm_extension``, which reads
a CPU linear layer's weight back through its own kernel and maps packed layers back to the checkpoint's
names), and rank 0 hashes what it published (in a thread, while the engine loads). A tensor whose hashes differ
is refused by name; a tensor the engine cannot read (a quantized layer; an engine without the method) is
counted as verified by the probe alone.

The hash is of the tensor's bytes in C order after ``x + 0`` (which writes -0.0 as +0.0 and changes nothing
else: reading a weight back through a kernel turns a -0.0 into +0.0, and the two compute the same), in the
engine's dtype: where the engine holds another dtype than the published one (a bf16 engine), the trainer hashes
its tensor cast as the engine's load casts it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ars_opd.serving.server.weights import dtype_name, tensor_sha256  # the engines' format, defined with them

__all__ = ["FingerprintResult", "TrainerHashes", "compare", "dtype_name", "tensor_sha256"]


class TrainerHashes:
    """Rank 0's hashes of the published ``state``, computed in a background thread (sha256 releases the GIL)
    while the engine loads; ``aliases`` maps a name the trainer does not publish to the published one holding
    the same tensor (a tied head: ``lm_head.weight`` -> the input embedding's name)."""

    def __init__(self, state: dict[str, torch.Tensor], aliases: dict[str, str]):
        self.state, self.aliases = state, aliases
        self._hashes: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ars-opd-fingerprint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for name, tensor in self.state.items():
                self._hashes[name] = tensor_sha256(tensor)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e

    def result(self) -> dict[str, str]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._hashes

    def names(self) -> list[str]:
        """Every tensor the engine computes with, under the trainer's names: the published ones and the aliases."""
        return [*self.state, *self.aliases]


@dataclass(frozen=True)
class FingerprintResult:
    """How many tensors the engine holds exactly as published (``verified``), which ones it could not show
    (``unread``: left to the probe) and which ones differ (``mismatched``)."""

    verified: int
    unread: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def message(self) -> str:
        """The refusal's words for the tensors that differ ("" when none does)."""
        if not self.mismatched:
            return ""
        more = len(self.mismatched) - 6
        shown = ", ".join(self.mismatched[:6]) + (f" and {more} more" if more > 0 else "")
        total = self.verified + len(self.mismatched) + len(self.unread)
        return f"{len(self.mismatched)} of its {total} tensors are not the published ones ({shown})"


def compare(engine: dict | None, hashes: TrainerHashes, seconds: float = 0.0) -> FingerprintResult:
    """The engine's fingerprint (``{"tensors": {name: {"sha256", "dtype", "shape"}}}``; None when it has none)
    against the trainer's."""
    names = hashes.names()
    mine = hashes.result()  # joined either way: no hashing goes on beside the training that follows
    tensors = (engine or {}).get("tensors")
    if not isinstance(tensors, dict):
        return FingerprintResult(0, names, [], seconds)
    verified, unread, mismatched = 0, [], []
    for name in names:
        got = tensors.get(name)
        if not isinstance(got, dict) or not isinstance(got.get("sha256"), str):
            unread.append(name)
            continue
        source = hashes.aliases.get(name, name)
        tensor = hashes.state[source]
        if got.get("shape") != list(tensor.shape):
            mismatched.append(name)
            continue
        want = mine[source]
        if got.get("dtype") != dtype_name(tensor.dtype):  # the engine holds another dtype: its load's cast
            want = tensor_sha256(tensor.to(getattr(torch, str(got.get("dtype")), tensor.dtype)))
        if got["sha256"] == want:
            verified += 1
        else:
            mismatched.append(name)
    return FingerprintResult(verified, unread, mismatched, seconds)
