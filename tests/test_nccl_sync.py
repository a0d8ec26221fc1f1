"""Transport ``nccl`` (``ars_opd.rollouts.nccl_sync``) against a recorded fake of vLLM's weight-transfer side.

There is no GPU here, so NCCL itself cannot run. What can fail without one is tested:

- the fake serves vLLM's routes (``vllm/entrypoints/rl/online/api_router.py``) with the dense NCCL worker's
  behaviour (``nccl_engine.py``, unpacked): the init blocks until the trainer joined the group and answered the
  warm-up; ``update_weights`` receives exactly ``len(names)`` broadcasts, each of the announced dtype and
  shape, and loads them into a model it serves; ``finish_weight_update`` records the version. The fake's
  "NCCL" is the group the trainer is given: its broadcasts land in the fake's receive queue;
- the payloads the trainer sent are recorded and then parsed by vLLM's own classes, in the vLLM environment
  (``NCCLWeightTransferInitInfo``, ``NCCLWeightTransferUpdateInfo``): the contract is vLLM's, not ours;
- over that transport the model the fake serves equals the trainer's exactly, and the version probe passes;
  an engine that takes the broadcasts and keeps its old weights is refused by the probe, naming the version;
- a refused update, a server without the routes and a CPU trainer are errors that say what to do.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import json
import os
import queue
import subprocess
from pathlib import Path

import pytest
import torch
from aiohttp import web

from ars_opd.config import ConfigError
from ars_opd.models.builtin import build_causal_lm
from ars_opd.rollouts.engine_api import EngineClient
from ars_opd.rollouts.nccl_sync import NcclWeightSync, WeightTransferError, update_info
from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan
from ars_opd.rollouts.verify import StaleEngineError
from ars_opd.rollouts.weights import engine_state_dict
from micro import load_committed_params
from server_thread import ServerThread
from tiny_models import SYNC_ARCH, perturbed, sync_student

REPO = Path(__file__).resolve().parents[1]


class FakeGroup:
    """The trainer's end of the NCCL group: every broadcast lands in the fake engine's receive queue."""

    def __init__(self, engine: FakeVllm, uid: bytes, world: int):
        self.engine, self.uid, self.world = engine, uid, world
        self.broadcasts: list[tuple[str, tuple[int, ...]]] = []
        engine.joined.put((uid, world))

    def warmup(self) -> None:
        self.engine.warmups += 1

    def broadcast(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        self.broadcasts.append((str(tensor.dtype), tuple(tensor.shape)))
        self.engine.wire.put(tensor.detach().clone())

    def close(self) -> None:
        self.engine.closed = True


class FakeVllm:
    """vLLM's weight-transfer routes with the dense NCCL worker's behaviour, serving ``model``'s
    ``prompt_logprobs``. ``workers``: the engine's GPU workers. ``stale``: receive the broadcasts, keep the
    old weights. ``refuse_update``: answer ``/update_weights`` with a 400 (a malformed update)."""

    def __init__(self, model: torch.nn.Module, workers: int = 2, stale: bool = False, refuse_update: bool = False):
        self.model, self.workers, self.stale, self.refuse_update = model, workers, stale, refuse_update
        self.calls: list[tuple[str, dict]] = []
        self.joined: queue.Queue = queue.Queue()
        self.wire: queue.Queue = queue.Queue()
        self.warmups, self.closed, self.initialised, self.updating = 0, False, False, False
        self.init_info: dict | None = None
        self.versions: list[str] = []
        self.received: dict[str, torch.Tensor] = {}
        app = web.Application()
        for path, handler in [
            ("/collective_rpc", self.rpc),
            ("/init_weight_transfer_engine", self.init),
            ("/start_weight_update", self.start),
            ("/update_weights", self.update),
            ("/finish_weight_update", self.finish),
            ("/shutdown_weight_transfer_engine", self.shutdown),
            ("/reset_prefix_cache", self.reset_prefix_cache),
            ("/v1/completions", self.completions),
        ]:
            app.router.add_post(path, handler)
        self.server = ServerThread(app)
        self.url = self.server.url

    async def _body(self, request: web.Request) -> dict:
        body = await request.json() if request.can_read_body else {}
        if request.path != "/v1/completions":
            self.calls.append((request.path, body))
        return body

    async def rpc(self, request):
        body = await self._body(request)
        if body["method"] != "check_health":  # vLLM's answer for a method its worker lacks (no ars_opd extension)
            error = f"Worker failed with error ''GPUWorker' object has no attribute '{body['method']}''"
            return web.json_response({"error": {"message": error}}, status=500)
        return web.json_response({"results": [None] * self.workers})

    async def init(self, request):
        info = (await self._body(request))["init_info"]
        self.init_info = info
        # the workers sit in ncclCommInitRank until every rank joined, then run the warm-up all-reduce
        try:
            uid, world = await asyncio.get_running_loop().run_in_executor(None, self.joined.get, True, 10)
        except queue.Empty:
            return web.json_response({"error": "the trainer never joined the group"}, status=500)
        if base64.b64decode(info["nccl_unique_id_b64"]) != uid or info["world_size"] != world:
            return web.json_response({"error": "rendezvous mismatch"}, status=500)
        self.initialised = True
        return web.json_response({"message": "Weight transfer initialized"})

    async def start(self, request):
        await self._body(request)
        if not self.initialised:
            return web.json_response({"error": "not initialised"}, status=500)
        self.updating = True
        return web.json_response({"message": "Weight update started"})

    async def update(self, request):
        info = (await self._body(request))["update_info"]
        if self.refuse_update:
            return web.json_response({"detail": "Invalid update_info"}, status=400)
        if not self.updating or len({len(info[k]) for k in ("names", "dtype_names", "shapes")}) != 1:
            return web.json_response({"error": "bad update"}, status=500)
        loop = asyncio.get_running_loop()
        for name, dtype_name, shape in zip(info["names"], info["dtype_names"], info["shapes"]):
            tensor = await loop.run_in_executor(None, self.wire.get, True, 10)  # one broadcast per name, in order
            assert tensor.dtype == getattr(torch, dtype_name) and list(tensor.shape) == shape, name
            self.received[name] = tensor
        return web.json_response({"message": "Weights updated"})

    async def finish(self, request):
        body = await self._body(request)
        self.updating = False
        self.versions.append(body.get("weight_version"))
        if not self.stale:
            missing, unexpected = self.model.load_state_dict(self.received, strict=False)
            assert unexpected == [] and set(missing) <= {"lm_head.weight"}
        return web.json_response({"message": "Weight update finished"})

    async def reset_prefix_cache(self, request):
        await self._body(request)
        return web.json_response({"success": not self.updating})

    async def shutdown(self, request):
        await self._body(request)
        return web.json_response({"message": "Weight transfer shut down"})

    async def completions(self, request):
        ids = (await self._body(request))["prompt"]
        with torch.no_grad():
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].double(), -1)
        rows = [None] + [{str(ids[i]): {"logprob": float(logp[i - 1, ids[i]])}} for i in range(1, len(ids))]
        return web.json_response({"choices": [{"prompt_logprobs": rows}]})

    def close(self):
        self.server.close()


@pytest.fixture
def student(char_tokenizer):
    return sync_student(char_tokenizer)


def _sync(engine: FakeVllm, **kw) -> tuple[NcclWeightSync, list[FakeGroup]]:
    groups: list[FakeGroup] = []

    def factory(uid, world):
        groups.append(FakeGroup(engine, uid, world))
        return groups[-1]

    client = EngineClient(engine.url, "student")
    return NcclWeightSync(client, group_factory=factory, unique_id=lambda: os.urandom(128), **kw), groups


def test_versions_travel_in_vllms_protocol_and_the_engine_gets_the_trainers_weights(student, char_tokenizer):
    served = build_causal_lm(SYNC_ARCH, char_tokenizer, seed=11).eval()
    engine = FakeVllm(served, workers=2)
    try:
        sync, groups = _sync(engine)
        first = engine_state_dict(student)
        sent = sync.publish(first, 0)
        newer = perturbed(student, 1)
        second = engine_state_dict(newer)
        sync.publish(second, 1)
        sync.close()
    finally:
        engine.close()
    paths = [path for path, _ in engine.calls]
    assert paths == [
        "/collective_rpc",
        "/init_weight_transfer_engine",
        *["/start_weight_update", "/update_weights", "/finish_weight_update"] * 2,
        "/shutdown_weight_transfer_engine",
    ]
    assert len(groups) == 1 and groups[0].world == 1 + 2 and engine.warmups == 1 and engine.closed
    assert engine.init_info["rank_offset"] == 1 and engine.init_info["packed"] is False
    assert engine.versions == ["0", "1"]
    assert "lm_head.weight" not in engine.received  # tied: the engine ties it itself
    assert [name for name, _ in engine.calls[-2][1].items()] == ["weight_version"]
    announced = [(str(t.dtype), tuple(t.shape)) for state in (first, second) for t in state.values()]
    assert groups[0].broadcasts == announced  # one broadcast per tensor, in the announced order
    assert sent.bytes == sum(t.numel() * t.element_size() for t in first.values()) and sent.write_s == 0.0
    for (name, want), got in zip(newer.state_dict().items(), served.state_dict().values()):
        assert torch.equal(want, got), name
    assert served.lm_head.weight.data_ptr() == served.model.embed_tokens.weight.data_ptr()


def test_the_recorded_payloads_parse_in_vllms_own_classes(student, tmp_path):
    """The init and update bodies the trainer sent, read by vLLM's dataclasses in the vLLM environment."""
    from ars_opd.serving.vllm_server import vllm_python

    engine = FakeVllm(copy.deepcopy(student), workers=1)
    try:
        sync, _ = _sync(engine)
        sync.publish(engine_state_dict(student), 7)
    finally:
        engine.close()
    bodies = dict(engine.calls)
    recorded = tmp_path / "recorded.json"
    recorded.write_text(
        json.dumps({"init": bodies["/init_weight_transfer_engine"], "update": bodies["/update_weights"]})
    )
    check = (
        "import json, sys, torch\n"
        "from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferInitInfo, "
        "NCCLWeightTransferUpdateInfo\n"
        "r = json.load(open(sys.argv[1]))\n"
        "init = NCCLWeightTransferInitInfo(**r['init']['init_info'])\n"
        "assert init.nccl_unique_id_bytes is not None and len(init.nccl_unique_id_bytes) == 128\n"
        "assert init.rank_offset == 1 and init.world_size == 2 and init.packed is False\n"
        "upd = NCCLWeightTransferUpdateInfo(**r['update']['update_info'])\n"
        "dtypes = [getattr(torch, d) for d in upd.dtype_names]\n"
        "print(json.dumps({'names': len(upd.names), 'dtypes': sorted({str(d) for d in dtypes})}))\n"
    )
    out = subprocess.run([str(vllm_python()), "-c", check, str(recorded)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {"names": len(engine_state_dict(student)), "dtypes": ["torch.float32"]}


def test_a_sync_over_nccl_passes_the_probe_and_a_stale_engine_is_refused(student, char_tokenizer, tmp_path):
    """The probe after an nccl sync, through the rollout schedule: a fresh engine passes; one that took the
    broadcasts and kept its weights is refused at the first version that differs."""
    plan = RolloutPlan(steps=4, max_lag=0, sync_every=1, sync_dir=tmp_path, seed=0, rollout_seed=0, transport="nccl")
    cpu = torch.device("cpu")
    for stale in (False, True):
        engine = FakeVllm(copy.deepcopy(student), stale=stale)  # serves version 0's weights from the start
        try:
            sync, _ = _sync(engine)
            rollouts = EngineRollouts(sync.client, plan, spec=None, rank=0, world=1, transport=sync)
            first = rollouts._publish(0, student, cpu)
            assert first["probe_max_abs_diff"] <= first["probe_bound"] and first["load_s"] > 0
            moved = perturbed(student, 5)
            if stale:
                with pytest.raises(StaleEngineError, match="does not serve policy version 1"):
                    rollouts._publish(1, moved, cpu)
            else:
                second = rollouts._publish(1, moved, cpu)
                assert second["probe_max_abs_diff"] <= second["probe_bound"] < second["probe_separation"] / 2
            paths = [path for path, _ in engine.calls]
            finished = [i for i, path in enumerate(paths) if path == "/finish_weight_update"]
            assert finished and all(paths[i + 1] == "/reset_prefix_cache" for i in finished)  # after every load
            rollouts.close()  # what the stage calls on every way out of the run: the engine's side is shut down
            assert engine.calls[-1][0] == "/shutdown_weight_transfer_engine" and engine.closed
            rollouts.close()  # a second call does nothing
            assert [path for path, _ in engine.calls].count("/shutdown_weight_transfer_engine") == 1
        finally:
            engine.close()


def test_a_refused_update_is_an_error_and_nothing_is_finished(student):
    engine = FakeVllm(copy.deepcopy(student), refuse_update=True)
    try:
        sync, _ = _sync(engine, timeout_s=30)
        with pytest.raises(WeightTransferError, match="/update_weights.*http_400"):
            sync.publish(engine_state_dict(student), 0)
    finally:
        engine.close()
    assert "/finish_weight_update" not in [path for path, _ in engine.calls]


def test_a_server_without_the_routes_says_how_to_start_vllm(student):
    server = ServerThread(web.Application())  # answers 404 to everything
    try:
        sync = NcclWeightSync(EngineClient(server.url, "student"), group_factory=lambda u, w: None)
        with pytest.raises(WeightTransferError, match="weight-transfer-config.*VLLM_SERVER_DEV_MODE"):
            sync.publish(engine_state_dict(student), 0)
    finally:
        server.close()


def test_nccl_is_refused_where_it_cannot_run():
    from ars_opd.config import check_params

    with pytest.raises(WeightTransferError, match="CUDA"):
        NcclWeightSync(EngineClient("http://127.0.0.1:9", "student"), torch.device("cpu"))
    params = load_committed_params()
    with pytest.raises(ConfigError, match="bundled"):  # the section itself refuses the pair
        dataclasses.replace(params.opd.engine, server="bundled", transport="nccl")
    opd = dataclasses.replace(
        params.opd, rollouts="engine", engine=dataclasses.replace(params.opd.engine, server="vllm", transport="nccl")
    )
    bad = dataclasses.replace(params, opd=opd, ddp=dataclasses.replace(params.ddp, device="cpu"))
    with pytest.raises(ConfigError, match="CUDA"):
        check_params(bad, REPO)


def test_update_info_names_every_tensor_in_order(student):
    state = engine_state_dict(student)
    info = update_info(state)
    assert info["names"] == list(state)
    assert info["dtype_names"] == ["float32"] * len(state)
    assert info["shapes"] == [list(t.shape) for t in state.values()]
