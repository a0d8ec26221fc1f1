"""OPD with the teacher behind a scoring endpoint: the bundled server serving the micro teacher.

Oracles: the in-process teacher (``LocalTeacher``, the same weights) for the scores and for a whole OPD run;
a fault-injecting proxy (tests/fake_endpoint.py) in front of the same server for the retries.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ars_opd.artifacts import read_jsonl
from ars_opd.config import ConfigError, EndpointConfig, TeacherServerConfig, load_params
from ars_opd.lm.batching import build_rollout_batch
from ars_opd.lm.opd_objectives import check_config, get_objective
from ars_opd.models.loading import load_model, load_tokenizer, model_path
from ars_opd.teacher.client.endpoint import ClientSettings, EndpointError
from ars_opd.teacher.client.generate import LOCAL_MODEL_NAME, local_server
from ars_opd.teacher.client.score import ScoringError
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.worker import TrainingJob
from fake_endpoint import FaultyProxy
from micro import distill_workspace, run_opd_in, teacher_rows
from tolerances import forward_bound, two_computations

REPO = Path(__file__).resolve().parents[1]
SERVER = TeacherServerConfig(max_batch_size=64, max_wait_ms=5.0, threads=1, startup_timeout_s=120.0)


def _workspace(root: Path, opd: dict, workers: int = 1) -> None:
    distill_workspace(REPO, root, opd, workers)


def _models_dir(root: Path) -> str:
    return str(root / load_params(root / "params.yaml").paths.models_dir)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd_endpoint")
    _workspace(root, {})
    return root


def _batches(tokenizer, n: int = 12, micro_batch: int = 4) -> list[dict]:
    """Rollout batches from teacher rows: prompts + completions of several lengths, right-padded."""
    from ars_opd.data.prompts import encode_completions, encode_prompts

    rows = teacher_rows(n, seed=9)
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    completions = encode_completions(tokenizer, [r["completion"] for r in rows])
    return [
        build_rollout_batch(
            prompts[i : i + micro_batch],
            completions[i : i + micro_batch],
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
        )
        for i in range(0, n, micro_batch)
    ]


def _endpoint(url: str, vocab: int, concurrency: int = 4, **limits) -> EndpointTeacher:
    return EndpointTeacher(
        ClientSettings(
            url, limits=EndpointConfig(endpoint=url, model=LOCAL_MODEL_NAME, concurrency=concurrency, **limits)
        ),
        LOCAL_MODEL_NAME,
        vocab,
        topk=5,
    )


def test_endpoint_scores_equal_the_local_forward(micro):
    models = _models_dir(micro)
    tokenizer = load_tokenizer(models)
    local = LocalTeacher(load_model(models, "teacher"), len(tokenizer), chunk_size=7, topk=5)
    batches = _batches(tokenizer)
    worst = {"token": 0.0, "topk": 0.0}
    with local_server(model_path(models, "teacher"), SERVER, max_logprobs=5) as url:
        remote = _endpoint(url, len(tokenizer))
        try:
            for name in ("sampled_token", "topk"):
                objective = get_objective(name)
                cpu = [dict(b) for b in batches]
                remote.attach(cpu, objective)
                for b in cpu:
                    mine, theirs = local.score(b, objective, 1.0), remote.score(b, objective, 1.0)
                    worst["token"] = max(
                        worst["token"], float((mine.target_logprobs() - theirs.target_logprobs()).abs().max())
                    )
                    if name == "topk":
                        # same support sets; log-probs aligned by id
                        for r in range(mine.support_ids.shape[0]):
                            a = {
                                int(i): float(v)
                                for i, v in zip(mine.support_ids[r], mine.support_logprobs[r])
                                if v > -1e30
                            }
                            c = {
                                int(i): float(v)
                                for i, v in zip(theirs.support_ids[r], theirs.support_logprobs[r])
                                if v > -1e30
                            }
                            assert set(a) == set(c)
                            worst["topk"] = max(worst["topk"], max(abs(a[i] - c[i]) for i in a))
        finally:
            remote.close()
    print(f"max |endpoint - local| log p_T: targets {worst['token']:.2e}, top-k {worst['topk']:.2e}")
    # two fp32 forwards of the same weights at other batch shapes (the server pads its own batches)
    with torch.no_grad():
        top = max(
            local.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.abs().max().item()
            for b in batches
        )
    width = max(b["input_ids"].shape[1] for b in batches)
    tol = two_computations(forward_bound(local.model.config, width, top, len(tokenizer)))
    assert worst["token"] <= tol and worst["topk"] <= tol


def test_faults_on_the_endpoint_leave_the_scores_identical(micro):
    """20% of requests fail once (429, 500, 503, a hang past the timeout): retried, same numbers bit for bit."""
    models = _models_dir(micro)
    tokenizer = load_tokenizer(models)
    batches = _batches(tokenizer, n=40)
    objective = get_objective("topk")
    # one row per forward, so a retried request cannot meet other batch mates (bit-identical answers)
    alone = dataclasses.replace(SERVER, max_batch_size=1)
    with local_server(model_path(models, "teacher"), alone, max_logprobs=5) as url:
        direct, faulty = [dict(b) for b in batches], [dict(b) for b in batches]
        clean = _endpoint(url, len(tokenizer))
        clean.attach(direct, objective)
        clean.close()
        proxy = FaultyProxy(fault_rate=0.2, retry_after_s=0.05, hang_s=5.0, upstream=url.removesuffix("/v1"))
        with proxy:
            retrying = _endpoint(
                proxy.base_url, len(tokenizer), request_timeout_s=1.0, backoff_base_s=0.05, backoff_max_s=0.2
            )
            retrying.attach(faulty, objective)
            retrying.close()
    first = [e["outcome"] for e in proxy.log if e["attempt"] == 1]
    assert len(first) == 40 and {"429", "500", "503", "hang"} <= set(first), first  # every kind of fault
    assert 0.1 <= sum(o != "ok" for o in first) / len(first) <= 0.35  # about 20% of requests failed once
    for a, b in zip(direct, faulty):
        for key in ("teacher_logprobs", "teacher_support_ids", "teacher_support_logprobs"):
            assert torch.equal(a[key], b[key]), key


def test_a_sequence_that_keeps_failing_stops_the_step_naming_the_endpoint(micro):
    models = _models_dir(micro)
    tokenizer = load_tokenizer(models)
    with local_server(model_path(models, "teacher"), SERVER, max_logprobs=5) as url:
        proxy = FaultyProxy(fault_rate=1.0, retry_after_s=0.05, hang_s=5.0, upstream=url.removesuffix("/v1"))
        with proxy:
            teacher = _endpoint(proxy.base_url, len(tokenizer), max_attempts=1, request_timeout_s=1.0)
            cpu = [dict(b) for b in _batches(tokenizer, n=4)]
            with pytest.raises(ScoringError, match=f"{proxy.base_url}.*step was not trained"):
                teacher.attach(cpu, get_objective("sampled_token"))
            teacher.close()
    assert all("teacher_logprobs" not in b for b in cpu)  # nothing partial was attached


def test_endpoint_losses_are_checked_against_what_an_endpoint_returns():
    from ars_opd.config import OPDConfig

    with pytest.raises(ConfigError, match="opd.loss.*full distribution"):
        check_config(OPDConfig(teacher="endpoint", loss="full_vocab"))
    with pytest.raises(ConfigError, match="opd.temperature"):
        check_config(OPDConfig(teacher="endpoint", loss="sampled_token", temperature=0.5, sample_temperature=0.5))
    check_config(OPDConfig(teacher="endpoint", loss="topk", beta=0.0, temperature=0.5))
    check_config(OPDConfig(teacher="endpoint", loss="sampled_token"))


def _run(root: Path) -> tuple[list[dict], dict]:
    steps, summary, _ = run_opd_in(root)
    return steps, summary


@pytest.mark.slow
@pytest.mark.ddp
def test_sampled_token_opd_with_endpoint_scoring_matches_the_local_teacher(tmp_path):
    opd = {
        "steps": 20,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "max_new_tokens": 6,
        "loss": "sampled_token",
        "checkpoint_every": 0,
        "snapshot_every": 0,
        "warmup_steps": 1,
        "lr": 0.005,
        "teacher_server": {"threads": 1},
    }
    _workspace(tmp_path / "local", {**opd, "teacher": "local"})
    _workspace(tmp_path / "endpoint", {**opd, "teacher": "endpoint"})
    local_steps, _ = _run(tmp_path / "local")
    endpoint_steps, summary = _run(tmp_path / "endpoint")
    assert len(local_steps) == len(endpoint_steps) == 20
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(local_steps, endpoint_steps)]
    lp = [abs(a["task/teacher_logprob"] - b["task/teacher_logprob"]) for a, b in zip(local_steps, endpoint_steps)]
    print(f"max per-step |loss diff| {max(diffs):.2e}, |teacher_logprob diff| {max(lp):.2e}")
    # not a rounding bound of one computation: the runs differ only by the teacher's fp32 scores (within
    # two fp32 forwards, as above) at step 0, then train on them for 20 steps, so the later steps also carry the
    # trajectories' drift from those differences; 1e-4 is an allowance for that drift, far below the losses'
    # own step-to-step changes (checked next)
    assert max(diffs) <= 1e-4 and max(lp) <= 1e-4
    assert len({round(r["loss"], 3) for r in local_steps}) > 5  # the runs really trained (losses moved)


@pytest.mark.slow
def test_unreachable_endpoint_fails_before_step_zero_naming_the_url(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    _workspace(
        tmp_path,
        {
            "loss": "sampled_token",
            "teacher": "endpoint",
            "teacher_endpoint": {"endpoint": url, "model": "teacher", "request_timeout_s": 2.0},
        },
    )
    with pytest.raises(EndpointError, match=f"cannot reach the teacher endpoint {url}.*opd.teacher_endpoint.endpoint"):
        _run(tmp_path)
    assert not (tmp_path / load_params(tmp_path / "params.yaml").paths.training("opd").steps).exists()


def test_endpoint_opd_worker_never_loads_teacher_weights(tmp_path, monkeypatch):
    """One in-process worker (a world of one) trains 2 steps with endpoint scoring; every weights load is
    recorded, and none reads the teacher's directory (the bundled server, another process, does)."""
    from transformers import AutoModelForCausalLM

    from ars_opd.teacher.client.endpoint import ClientSettings
    from ars_opd.training.opd.stage import opd_worker
    from ars_opd.training.worker import ScoringEndpoint

    _workspace(
        tmp_path,
        {
            "loss": "sampled_token",
            "teacher": "endpoint",
            "steps": 2,
            "warmup_steps": 0,
            "checkpoint_every": 0,
            "snapshot_every": 0,
        },
    )
    loaded: list[str] = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def recording(cls, path, *args, **kwargs):
        loaded.append(str(Path(path).resolve()))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(recording))
    monkeypatch.chdir(tmp_path)
    p = load_params("params.yaml")
    teacher_dir = str(Path(model_path(p.paths.models_dir, "teacher")).resolve())
    with local_server(teacher_dir, SERVER, max_logprobs=1) as url:
        job = TrainingJob(
            "opd",
            p.opd,
            p.ddp,
            p.paths,
            progress=False,
            scoring=ScoringEndpoint(url, LOCAL_MODEL_NAME, ClientSettings(url, "EMPTY", p.opd.teacher_endpoint)),
        )
        summary = opd_worker(job)
    assert summary["steps"] == 2
    assert loaded and teacher_dir not in loaded, loaded  # the student was loaded, the teacher never
    steps = read_jsonl(p.paths.training("opd").steps)
    assert all(r["task/teacher_logprob"] < 0 for r in steps)
