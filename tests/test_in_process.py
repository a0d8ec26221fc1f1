"""One worker trains in the stage's own process, with the same result as a spawned worker."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ars_opd.artifacts import read_jsonl
from ars_opd.config import load_params
from ars_opd.training import distributed
from ars_opd.training.sft import sft_worker
from ars_opd.training.worker import TrainingJob
from test_sft_stage import _workspace

REPO = Path(__file__).resolve().parents[1]


def _train(root: Path, in_process: bool) -> dict:
    cwd = os.getcwd()
    os.chdir(root)
    try:
        p = load_params("params.yaml")
        job = TrainingJob("sft", p.sft, p.ddp, p.paths, progress=False)
        return distributed.launch(sft_worker, job, 1, 1, in_process=in_process)
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_one_worker_in_process_equals_spawned_worker(tmp_path, monkeypatch):
    here = _workspace(tmp_path / "here", {"steps": 12, "checkpoint_every": 5})
    # one worker; the whole global batch on it
    text = (here / "params.yaml").read_text().replace("workers: 2", "workers: 1")
    (here / "params.yaml").write_text(text)
    spawned = tmp_path / "spawned"
    shutil.copytree(here, spawned)

    started = []  # launch() imports elastic_launch when it starts workers: count its calls there
    from torch.distributed.launcher import api

    original = api.elastic_launch
    monkeypatch.setattr(api, "elastic_launch", lambda *a, **k: (started.append(1), original(*a, **k))[1])

    threads, rng, py = torch.get_num_threads(), torch.get_rng_state(), random.getstate()
    a = _train(here, in_process=True)
    assert started == []  # no worker process was started
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng) and random.getstate() == py
    b = _train(spawned, in_process=False)
    assert started == [1]
    assert a["steps"] == b["steps"] == 12

    wa, wb = (load_file(str(r / "data/sft/model/model.safetensors")) for r in (here, spawned))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bit-identical
    la, lb = (read_jsonl(r / "data/sft/log/steps.jsonl") for r in (here, spawned))
    assert la == lb and len(la) == 12


def test_in_process_worker_refuses_inside_a_process_group(monkeypatch):
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already belongs to a process group"):
        distributed.launch(lambda job: job, 1, 1)


def test_in_process_worker_error_is_raised_as_itself():
    class Boom(ValueError):
        pass

    def fn(job):
        raise Boom("from the worker")

    with pytest.raises(Boom, match="from the worker"):
        distributed.launch(fn, None, 1)
