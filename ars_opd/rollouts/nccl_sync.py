"""Transport ``nccl``: the trainer's weights go to a vLLM engine on GPUs over NCCL, through vLLM's own
weight-transfer routes (``opd.engine.transport: nccl``), with no file in between.

The protocol is vLLM's dense NCCL backend (vLLM >= 0.32, ``vllm/distributed/weight_transfer/nccl_engine.py``),
spoken from the trainer without importing vLLM (the trainer's environment need not have it):

- the engine is started with ``--weight-transfer-config '{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``
  (which registers the routes below and ``/collective_rpc``);
- **connect** (once, on rank 0): ``POST /collective_rpc {"method": "check_health"}`` counts the engine's GPU
  workers W (one result per worker); rank 0 mints an NCCL unique id (``torch.cuda.nccl.unique_id``) and, while
  ``POST /init_weight_transfer_engine {"init_info": {"nccl_unique_id_b64", "rank_offset": 1, "world_size":
  1 + W, "packed": false}}`` is in flight (the workers block in ``ncclCommInitRank`` until every rank joined),
  joins the group as rank 0 (``torch.cuda.nccl.init_rank``) and answers the workers' warm-up: a one-element
  all-reduce, which vLLM's unique-id path issues right after init and every peer must match;
- **send** (every sync): ``POST /start_weight_update``; then ``POST /update_weights {"update_info": {"names",
  "dtype_names", "shapes"}}``, which the workers run concurrently with the trainer's broadcasts: one
  ``broadcast`` from rank 0 per tensor, in the order of ``names`` (unpacked: ``packed: false`` at init);
  then ``POST /finish_weight_update {"weight_version": "<version>"}``, which finalises vLLM's layer-wise
  reload (the kernel state of every layer, the tied head included, is rebuilt from the new weights);
- **close**: ``POST /shutdown_weight_transfer_engine``.

What travels is ``engine_state_dict`` (``ars_opd.rollouts.weights``): the plain model's names, a LoRA
student merged, a sharded one gathered, a tied head left out. The version check
(``ars_opd.rollouts.version_check``) then checks what the engine serves, exactly as after a filesystem sync:
the transport is trusted for nothing.

A failure is an error naming the engine and the route, never a hang where it can be helped: an
``update_weights`` that fails before its broadcasts is seen before the trainer broadcasts (as vLLM's own
trainer engine does), and the wait for its answer after the broadcasts is bounded by the request timeout.

NCCL wants every rank on its own GPU: the trainer's rank 0 and the engine cannot share one device.
"""

from __future__ import annotations

import base64
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import torch

from ars_opd.rollouts.engine_api import EngineClient, EngineError
from ars_opd.rollouts.weights import Transfer

ROUTES_HINT = (
    'start vLLM (>= 0.32, CUDA) with --weight-transfer-config \'{"backend": "nccl"}\' and VLLM_SERVER_DEV_MODE=1, '
    "or use opd.engine.transport: filesystem"
)
NCCL_UNIQUE_ID_BYTES = 128


class WeightTransferError(EngineError):
    """The engine refused or failed a weight-transfer route, or the NCCL group could not be built."""


class Group(Protocol):
    """Rank 0's end of the trainer-engine NCCL group."""

    def warmup(self) -> None: ...

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class TorchNcclGroup:
    """The group through torch's NCCL bindings (``torch.cuda.nccl``): rank 0 on ``device``."""

    def __init__(self, unique_id: bytes, world_size: int, device: torch.device):
        import torch.cuda.nccl as nccl

        self.nccl, self.device = nccl, device
        with torch.cuda.device(device):
            self.comm = nccl.init_rank(world_size, unique_id, 0)

    @staticmethod
    def unique_id() -> bytes:
        import torch.cuda.nccl as nccl

        return nccl.unique_id()

    def warmup(self) -> None:
        data = torch.zeros(1, device=self.device)  # vLLM's warm-up: one fp32 element, summed
        self.nccl.all_reduce([data], comms=[self.comm])
        torch.cuda.synchronize(self.device)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.nccl.broadcast([tensor], root=0, comms=[self.comm])

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.comm = None


GroupFactory = Callable[[bytes, int], Group]  # (unique id, world size) -> rank 0's end, joined


def update_info(state: dict[str, torch.Tensor]) -> dict:
    """What ``/update_weights`` tells the workers to receive, in broadcast order (vLLM's
    ``NCCLWeightTransferUpdateInfo``: names, torch dtype names, shapes)."""
    return {
        "names": list(state),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
        "shapes": [list(t.shape) for t in state.values()],
    }


class NcclWeightSync:
    """Rank 0's NCCL transport to one vLLM engine (see the module docstring). ``group_factory`` and
    ``unique_id`` default to torch's NCCL on ``device``; tests pass recording fakes."""

    def __init__(
        self,
        client: EngineClient,
        device: torch.device | None = None,
        group_factory: GroupFactory | None = None,
        unique_id: Callable[[], bytes] | None = None,
        timeout_s: float = 300.0,
    ):
        if group_factory is None:
            if device is None or device.type != "cuda" or not torch.cuda.is_available():
                raise WeightTransferError(
                    f"opd.engine.transport: nccl needs the trainer on a CUDA device (got {device}); "
                    "use opd.engine.transport: filesystem on CPU"
                )
            group_factory = lambda uid, world: TorchNcclGroup(uid, world, device)  # noqa: E731
            unique_id = unique_id or TorchNcclGroup.unique_id
        self.client, self.device = client, device
        self.group_factory = group_factory
        self.unique_id = unique_id or (lambda: bytes(NCCL_UNIQUE_ID_BYTES))
        self.timeout_s = timeout_s
        self.group: Group | None = None

    # -- control plane ----------------------------------------------------------------------------------------
    def _route(self, path: str, body: dict | None = None) -> dict:
        try:
            return self.client.post_route(path, body or {})
        except EngineError as e:
            raise WeightTransferError(
                f"POST {path} to the rollout engine {self.client.root} failed: {e}. {ROUTES_HINT}"
            ) from None

    def engine_workers(self) -> int:
        """How many GPU workers the engine runs (tensor x pipeline x data parallel): ``/collective_rpc``
        ``check_health`` answers once per worker."""
        answer = self._route("/collective_rpc", {"method": "check_health"})
        results = answer.get("results")
        if not isinstance(results, list) or not results:
            raise WeightTransferError(
                f"the rollout engine {self.client.root} answered /collective_rpc check_health with "
                f"{str(answer)[:200]}, not one result per worker. {ROUTES_HINT}"
            )
        return len(results)

    # -- the group --------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Build the trainer-engine group (rank 0 here, the engine's workers at 1..W)."""
        if self.group is not None:
            return
        workers = self.engine_workers()
        world = 1 + workers
        uid = self.unique_id()
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise WeightTransferError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        init_info = {
            "nccl_unique_id_b64": base64.b64encode(uid).decode("ascii"),
            "rank_offset": 1,
            "world_size": world,
            "packed": False,
        }
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ars-opd-nccl-init") as pool:
            # the workers block inside the route until every rank has joined: join while it is in flight
            answer = pool.submit(self._route, "/init_weight_transfer_engine", {"init_info": init_info})
            group = self.group_factory(uid, world)
            group.warmup()
            answer.result(timeout=self.timeout_s)
        self.group = group

    def publish(self, state: dict[str, torch.Tensor], version: int) -> Transfer:
        """Version ``version`` into the engine: start, update (with one broadcast per tensor), finish. Nothing
        is written, so ``write_s`` is 0 and the whole round trip is ``load_s``."""
        self.connect()
        assert self.group is not None
        t0 = time.perf_counter()
        info = update_info(state)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        self._route("/start_weight_update")
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ars-opd-nccl-update")
        try:
            answer = pool.submit(self._route, "/update_weights", {"update_info": info})
            if answer.done():  # refused at once (best effort, as vLLM's own trainer engine): no broadcast
                answer.result()
            for tensor in state.values():
                send = tensor.to(self.device) if self.device is not None else tensor
                self.group.broadcast(send.contiguous())
            answer.result(timeout=self.timeout_s)
        finally:
            # never join the request's thread: after a failed broadcast the workers sit in NCCL and it never returns
            pool.shutdown(wait=False)
        self._route("/finish_weight_update", {"weight_version": str(version)})
        return Transfer(bytes=nbytes, write_s=0.0, load_s=time.perf_counter() - t0)

    def close(self) -> None:
        if self.group is None:
            return
        try:
            self._route("/shutdown_weight_transfer_engine")
        finally:
            self.group.close()
            self.group = None
