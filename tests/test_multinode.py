"""Multi-node launch proven on one machine: the sft stage as two torchrun "nodes" (two separate launchers,
``--nnodes 2 --node-rank 0|1 --nproc-per-node 1``, c10d rendezvous on 127.0.0.1) ends with weights bit-identical
to the single-launcher 2-worker run of the same stage (CPU, gloo).

Each "node" runs in a working directory of its own (the same models, data and params copied), so the two
share no filesystem, as two machines need not: under DDP rank 0 keeps the checkpoints on its machine and
decides the resume for every rank (``ars_opd.training.checkpoint``); under fsdp, whose ranks each write their
shards, a checkpoint directory the other node cannot see is refused before the first step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ars_opd.artifacts import read_jsonl
from micro import run_stage_here
from test_sft_stage import REPO, _workspace

STEPS = {"steps": 4, "checkpoint_every": 2, "snapshot_every": 0, "warmup_steps": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_nodes(root: Path | list[Path], timeout: float = 300, ok: bool = True) -> list[str]:
    """Start the stage as two torchrun launchers (one per "node") on one rendezvous, in ``root`` or each in its
    own of two working directories; with ``ok`` both must exit 0, else both must fail."""
    roots = root if isinstance(root, list) else [root, root]
    torchrun = Path(sys.executable).with_name("torchrun")
    port, run_id = _free_port(), uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    procs = [
        subprocess.Popen(
            [
                str(torchrun),
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
                "--local-addr",
                "127.0.0.1",
                "--max-restarts",
                "0",
                "-m",
                "stages.sft",
            ],
            cwd=roots[rank],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert (p.returncode == 0) == ok, out[-4000:]
    return outs


@pytest.mark.slow
@pytest.mark.ddp
def test_multinode_sft_two_torchrun_nodes_bit_identical_to_single_launcher_and_resumed(tmp_path):
    """The two nodes in two working directories: each sees its own ``data/checkpoints/sft``. The run ends
    bit-identical to the single launcher's with every checkpoint on rank 0's node (before, rank 1 wrote its
    RNG state into a directory only rank 0's node had: FileNotFoundError at the first checkpoint); and a rerun
    resumes every rank from rank 0's checkpoint, which rank 1's node does not hold (before, each rank read its
    own ``latest.json``: rank 1 would start afresh beside a resumed rank 0), again bit-identical."""
    single = _workspace(tmp_path / "single", STEPS)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:  # the same models and data on both machines (not rebuilt): only the launch differs
        shutil.copytree(single, node)
    run_stage_here(single, "sft")  # the single launcher (its workers forked from this session's forkserver)
    _torchrun_nodes(nodes)

    def same_as_single(root: Path) -> list[dict]:
        a = load_file(str(single / "data/sft/model/model.safetensors"))
        b = load_file(str(root / "data/sft/model/model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
        steps_a, steps_b = (
            read_jsonl(single / "data/sft/log/steps.jsonl"),
            read_jsonl(root / "data/sft/log/steps.jsonl"),
        )
        assert [r["loss"] for r in steps_a] == [r["loss"] for r in steps_b] and len(steps_b) == 4
        assert len(steps_b[0]["worker_loss"]) == 2  # a world of two workers, one per launcher
        return steps_b

    same_as_single(nodes[0])
    ckpts = nodes[0] / "data/checkpoints/sft"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000002", "step_0000004"]
    assert sorted(p.name for p in (ckpts / "step_0000002").glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    assert not list((nodes[1] / "data/checkpoints").rglob("step_*"))  # nothing written on rank 1's node

    # as if the run had stopped after its step-2 checkpoint: rank 0's node names it latest
    latest = ckpts / "latest.json"
    latest.write_text(json.dumps({**json.loads(latest.read_text()), "step": 2, "dir": "step_0000002"}))
    shutil.rmtree(ckpts / "step_0000004")
    for out in ("data/sft", "data/live"):
        shutil.rmtree(nodes[0] / out)
    _torchrun_nodes(nodes)
    assert json.loads((nodes[0] / "data/sft/log/manifest.json").read_text())["resumed_from"] == 2
    same_as_single(nodes[0])


@pytest.mark.slow
@pytest.mark.ddp
def test_multinode_fsdp_refuses_a_checkpoint_directory_the_other_node_cannot_see(tmp_path):
    """fsdp writes every rank's shards into the checkpoint directory, so it must be one shared directory: two
    nodes in two working directories stop before the first step, both naming the directory and the rank that
    cannot see it (before: FileNotFoundError at the first checkpoint, after the steps up to it)."""
    single = _workspace(tmp_path / "single", STEPS)
    params = yaml.safe_load((single / "params.yaml").read_text())
    params["ddp"]["strategy"] = "fsdp"
    (single / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        shutil.copytree(single, node)
    outs = _torchrun_nodes(nodes, ok=False)
    where = str((nodes[0] / "data/checkpoints/sft").resolve())
    for out in outs:
        assert "invalid params: ddp.strategy: fsdp writes every rank's shards" in out, out[-3000:]
        assert where in out and "rank 1 on" in out and "rank 0 on" not in out, out[-3000:]
    assert not (nodes[0] / "data/sft/log/steps.jsonl").exists()  # refused before any step
