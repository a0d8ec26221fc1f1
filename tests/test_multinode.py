"""Multi-node launch proven on one machine: the sft stage as two torchrun "nodes" (two separate launchers,
``--nnodes 2 --node-rank 0|1 --nproc-per-node 1``, c10d rendezvous on 127.0.0.1) ends with weights bit-identical
to the single-launcher 2-worker run of the same stage (CPU, gloo).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ars_opd.artifacts import read_jsonl
from test_sft_stage import REPO, _workspace

STEPS = {"steps": 4, "checkpoint_every": 2, "snapshot_every": 0, "warmup_steps": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_nodes(root: Path, timeout: float = 300) -> list[str]:
    """Start the stage as two torchrun launchers (one per "node") on one rendezvous; both must exit 0."""
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
            cwd=root,
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
        assert p.returncode == 0, out[-4000:]
    return outs


@pytest.mark.slow
@pytest.mark.ddp
def test_multinode_sft_two_torchrun_nodes_bit_identical_to_single_launcher(tmp_path):
    single = _workspace(tmp_path / "single", STEPS)
    nodes = tmp_path / "nodes"
    # the same models and data (not rebuilt): only the launch differs
    shutil.copytree(single, nodes)
    proc = subprocess.run(
        [sys.executable, "-m", "stages.sft"],
        cwd=single,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _torchrun_nodes(nodes)

    a = load_file(str(single / "data/sft/model/model.safetensors"))
    b = load_file(str(nodes / "data/sft/model/model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps_a, steps_b = read_jsonl(single / "data/sft/log/steps.jsonl"), read_jsonl(nodes / "data/sft/log/steps.jsonl")
    assert [r["loss"] for r in steps_a] == [r["loss"] for r in steps_b] and len(steps_b) == 4
    assert len(steps_b[0]["worker_loss"]) == 2  # a world of two workers, one per launcher
