"""The served-teacher paths against a real vLLM server (CPU build, ``.venv-vllm``), not against our own.

One module fixture (``vllm_teacher``, tests/conftest.py) serves a micro teacher twice: as the README tells
users to start vLLM for OPD scoring (``--logprobs-mode raw_logprobs``, no prefix caching), and with
``raw_logits`` for the refusal. Oracles: the bundled server (its answers come from transformers' generate),
the teacher's own HF forward in this process, and a counting proxy in front of vLLM for what was asked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ars_opd.artifacts import read_jsonl, write_jsonl
from ars_opd.config import (
    DataConfig,
    EndpointConfig,
    OPDConfig,
    PathsConfig,
    SyntheticConfig,
    TeacherGenConfig,
    load_params,
    parse_section,
)
from ars_opd.data.prompts import encode_prompts
from ars_opd.data.subset import make_subset
from ars_opd.lm.opd_objectives import get_objective
from ars_opd.models.loading import load_model, load_tokenizer
from ars_opd.teacher.client.endpoint import ClientSettings, EndpointError, make_client
from ars_opd.teacher.client.generate import build_requests, generate_teacher_completions
from ars_opd.teacher.client.score import NotLogprobsError, ScoringError, check_tokenizer
from ars_opd.training.opd.stage import run_opd
from ars_opd.training.opd.teacher_setup import check_scoring_endpoint
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.worker import ScoringEndpoint, TrainingJob
from fake_endpoint import FaultyProxy
from micro import committed_params
from tolerances import forward_bound, two_computations

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]


def _gen_workspace(root: Path, teacher, n: int = 160, eval_size: int = 20) -> PathsConfig:
    """A directory with a synthetic subset and a copy of the fixture's models at the default relative paths;
    chdir into it (teacher_gen reads every path relative to the working directory)."""
    root.mkdir(parents=True, exist_ok=True)
    os.chdir(root)
    paths = PathsConfig()
    res = make_subset(DataConfig(subset_size=n, eval_size=eval_size), SyntheticConfig(), seed=3)
    Path(paths.subset_train).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(paths.subset_train, res.train)
    write_jsonl(paths.subset_eval, res.eval)
    shutil.copytree(teacher.models_dir, paths.models_dir)
    return paths


def _gen_cfg(endpoint: str, **kw) -> TeacherGenConfig:
    raw = {"endpoint": endpoint, "max_tokens": 16, "concurrency": 16, "server": {"threads": 1}, **kw}
    if endpoint != "local":
        raw.setdefault("model", "teacher")
    return parse_section(TeacherGenConfig, raw, "teacher_gen")


@pytest.fixture
def in_tmp(tmp_path):
    cwd = os.getcwd()
    yield tmp_path
    os.chdir(cwd)


def _answers(paths: PathsConfig) -> dict[str, dict]:
    return {r["id"]: r for split in ("train", "eval") for r in read_jsonl(paths.completions(split))}


def _text(row: dict) -> tuple[str, str]:
    return row["completion"], row["finish_reason"]


def _completion_ids(tokenizer, row: dict) -> list[int]:
    ids = tokenizer.encode(row["completion"], add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] if row["finish_reason"] == "stop" else ids


def test_greedy_teacher_gen_through_vllm_equals_the_bundled_server(vllm_teacher, in_tmp):
    """The teacher_gen stage asks vLLM and the bundled server for the same 160 prompts, greedy. Every answer
    must be the same text with the same finish_reason, except where the two servers' fp32 forwards may rank the
    top two tokens differently: at the first token where two answers part, the gap between those two tokens'
    logits in this process's HF forward (prompt + the common prefix) must be within the rounding of two fp32
    forwards (``tolerances.forward_bound``), which a chat template or a detokeniser that differ never are."""
    bundled = _gen_workspace(in_tmp / "bundled", vllm_teacher)
    generate_teacher_completions(_gen_cfg("local"), bundled, progress=False)
    theirs_paths = _gen_workspace(in_tmp / "vllm", vllm_teacher)
    m = generate_teacher_completions(_gen_cfg(vllm_teacher.url), theirs_paths, progress=False)
    assert m["failed"] == 0 and m["answered"] == m["prompts"] == 160
    ours, theirs = _answers(bundled), _answers(theirs_paths)
    assert set(ours) == set(theirs)
    same = [
        i
        for i in ours
        if (ours[i]["completion"], ours[i]["finish_reason"]) == (theirs[i]["completion"], theirs[i]["finish_reason"])
    ]
    tokenizer = load_tokenizer(str(vllm_teacher.models_dir))
    model = load_model(str(vllm_teacher.models_dir), "teacher")
    differing = []
    for i in sorted(set(ours) - set(same)):
        a, b = _completion_ids(tokenizer, ours[i]), _completion_ids(tokenizer, theirs[i])
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert j < min(len(a), len(b)), f"{i}: one answer is a prefix of the other: {ours[i]} / {theirs[i]}"
        prompt = encode_prompts(tokenizer, [ours[i]["messages"]])[0]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + a[:j]])).logits[0, -1]
        gap = float((logits[a[j]] - logits[b[j]]).abs())
        tol = two_computations(forward_bound(model.config, len(prompt) + j + 1, float(logits.abs().max())))
        differing.append((i, j, gap, tol))
    print(
        f"identical greedy answers: {len(same)}/{len(ours)}; where they part (id, token, logit gap, bound): {differing}"
    )
    for i, j, gap, tol in differing:
        assert gap <= tol, f"prompt {i} parts at token {j} with a logit gap of {gap:.3g} > {tol:.3g}: not rounding"


def test_length_finish_is_recorded_as_truncation(vllm_teacher, in_tmp):
    """With max_tokens 3 vLLM cuts answers: finish_reason 'length' reaches the rows and the stage's
    length_finish_fraction, and every such answer is exactly 3 tokens (vLLM's own count of what it cut)."""
    paths = _gen_workspace(in_tmp, vllm_teacher, n=40, eval_size=8)
    m = generate_teacher_completions(_gen_cfg(vllm_teacher.url, max_tokens=3), paths, progress=False)
    rows = list(_answers(paths).values())
    tokenizer = load_tokenizer(str(vllm_teacher.models_dir))
    cut = [r for r in rows if r["finish_reason"] == "length"]
    assert cut, "no answer reached max_tokens 3"
    assert {r["finish_reason"] for r in rows} <= {"length", "stop"}
    assert all(len(tokenizer.encode(r["completion"], add_special_tokens=False)) == 3 for r in cut)
    assert m["length_finish_fraction"] == round(len(cut) / len(rows), 4)


def _write_stage_params(root: Path, **teacher_gen) -> None:
    params = committed_params()
    params["teacher_gen"].update(teacher_gen)
    (root / "params.yaml").write_text(yaml.safe_dump(params))


_STAGE = [sys.executable, "-m", "stages.teacher_gen"]
_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_kill_9_then_resume_asks_vllm_nothing_twice(vllm_teacher, in_tmp):
    """The stage, killed with SIGKILL after 40 of 300 answers are cached, resumes: every cached answer is kept,
    none is asked again (a counting proxy in front of vLLM sees each request body), and the cache ends with one
    line per key, the keys the stage computes for vLLM's model name and revision."""
    paths = _gen_workspace(in_tmp, vllm_teacher, n=300, eval_size=20)
    with FaultyProxy(fault_rate=0.0, upstream=vllm_teacher.url.removesuffix("/v1")) as proxy:
        _write_stage_params(in_tmp, endpoint=proxy.base_url, model="teacher", model_revision="r1", concurrency=4)
        proc = subprocess.Popen(_STAGE, cwd=in_tmp, env=_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cache = Path(paths.teacher_cache)
        deadline = time.monotonic() + 120
        while (not cache.exists() or cache.read_bytes().count(b"\n") < 40) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not Path(paths.teacher_dir).exists()
        cached = {json.loads(line)["key"] for line in cache.read_text().splitlines() if line.endswith("}")}
        assert 40 <= len(cached) < 300
        n_first = len(proxy.log)
        second = subprocess.run(_STAGE, cwd=in_tmp, env=_ENV, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        asked = [e for e in proxy.log[n_first:] if e["path"] == "/v1/chat/completions"]
    params = load_params(in_tmp / "params.yaml")
    rows = read_jsonl(paths.subset_train) + read_jsonl(paths.subset_eval)
    keys = {r.key for r in build_requests(rows, params.teacher_gen, "teacher", "r1")}
    # the rerun asked exactly the prompts without a cached answer, once each; a body the proxy saw in both runs
    # (attempt 2) can only be one in flight at the kill, answered by vLLM but never written (concurrency 4)
    assert len(asked) == len(keys) - len(cached)
    assert sum(e["attempt"] > 1 for e in asked) <= 4, asked
    lines = [json.loads(line) for line in cache.read_text().splitlines()]
    assert sorted(r["key"] for r in lines) == sorted(keys)  # one line per key, the keys of vLLM's name and revision
    m = json.loads(Path(paths.teacher_metrics).read_text())
    assert m["cached_before_run"] == len(cached) and m["answered"] == len(keys) - len(cached)


def _stage_failure(root: Path, **teacher_gen) -> tuple[int, list[str]]:
    """Run the stage with these teacher_gen params: its exit code and its stderr's lines, progress bars left out."""
    _write_stage_params(root, **teacher_gen)
    run = subprocess.run(_STAGE, cwd=root, env=_ENV, capture_output=True, text=True, timeout=300)
    return run.returncode, [line for line in run.stderr.splitlines() if line.strip() and "req/s" not in line]


def test_wrong_model_unreachable_port_and_overlong_prompt_give_our_errors(vllm_teacher, in_tmp):
    """Each is one line on stderr naming what to do, exit code 4 (an endpoint error), no traceback."""
    from ars_opd.serving.vllm_server import free_port

    _gen_workspace(in_tmp, vllm_teacher, n=30, eval_size=4)
    code, err = _stage_failure(in_tmp, endpoint=vllm_teacher.url, model="no-such-model")
    assert code == 4 and len(err) == 1, err
    assert f"model 'no-such-model' is not served at {vllm_teacher.url}" in err[0] and "['teacher']" in err[0]
    assert "teacher_gen.model" in err[0]

    url = f"http://127.0.0.1:{free_port()}/v1"
    code, err = _stage_failure(in_tmp, endpoint=url, model="teacher", request_timeout_s=2.0)
    assert code == 4 and len(err) == 1, err
    assert f"cannot reach the teacher endpoint {url}" in err[0] and "teacher_gen.endpoint" in err[0]

    # a system prompt longer than the server's context (256 tokens): vLLM answers 400 to every prompt; the
    # stage stops (after 20 such answers in a row it would not ask the rest), quoting vLLM's reason, and keeps
    # the refusals in its failure report (a rerun would get the same answer: they are not asked again)
    code, err = _stage_failure(in_tmp, endpoint=vllm_teacher.url, model="teacher", system_prompt="word " * 300)
    assert code == 4 and len(err) == 1, err
    assert "http_400" in err[0] and "maximum context length is 256 tokens" in err[0]
    report = json.loads(Path(in_tmp / PathsConfig().teacher_failure_report).read_text())
    assert report["stage_failed"] and report["failed"] == report["prompts"] == 30
    assert set(report["by_kind"]) == {"http_400"} and all(f["status"] == 400 for f in report["failures"])
    assert not Path(PathsConfig().teacher_dir).exists()


def _batches(tokenizer, n: int = 12, micro_batch: int = 4) -> list[dict]:
    """Rollout batches from teacher rows: prompts + completions of several lengths, right-padded."""
    from ars_opd.data.prompts import encode_completions
    from ars_opd.lm.batching import build_rollout_batch
    from micro import teacher_rows

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


def _support(scores, r: int) -> dict[int, float]:
    """Row r's returned top-k ids and their log-probs (padding entries, -inf, left out)."""
    return {int(i): float(v) for i, v in zip(scores.support_ids[r], scores.support_logprobs[r]) if v > -1e30}


def test_vllm_prompt_logprobs_equal_local_scoring_within_two_fp32_forwards(vllm_teacher):
    """vLLM's prompt_logprobs of rollout sequences, through the OPD scoring client, against the teacher's own
    forward here (``LocalTeacher``, the same weights): the sampled tokens' log-probs and the top-k sets and
    values, within the rounding of two fp32 forwards of the teacher to its log-probabilities."""
    models = str(vllm_teacher.models_dir)
    tokenizer = load_tokenizer(models)
    local = LocalTeacher(load_model(models, "teacher"), len(tokenizer), chunk_size=7, topk=5)
    remote = EndpointTeacher(
        ClientSettings(vllm_teacher.url, limits=EndpointConfig(endpoint=vllm_teacher.url, model="teacher")),
        "teacher",
        len(tokenizer),
        topk=5,
    )
    batches = _batches(tokenizer)
    worst = {"token": 0.0, "topk": 0.0}
    try:
        for name in ("sampled_token", "topk"):
            objective = get_objective(name)
            scored = [dict(b) for b in batches]
            remote.attach(scored, objective)
            for b in scored:
                mine, theirs = local.score(b, objective, 1.0), remote.score(b, objective, 1.0)
                worst["token"] = max(
                    worst["token"], float((mine.target_logprobs() - theirs.target_logprobs()).abs().max())
                )
                if name == "topk":
                    for r in range(mine.support_ids.shape[0]):
                        a = {
                            int(i): float(v) for i, v in zip(mine.support_ids[r], mine.support_logprobs[r]) if v > -1e30
                        }
                        c = {
                            int(i): float(v)
                            for i, v in zip(theirs.support_ids[r], theirs.support_logprobs[r])
                            if v > -1e30
                        }
                        assert set(a) == set(c), (r, a, c)
                        worst["topk"] = max(worst["topk"], max(abs(a[i] - c[i]) for i in a))
    finally:
        remote.close()
    with torch.no_grad():
        top = max(
            local.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.abs().max().item()
            for b in batches
        )
    width = max(b["input_ids"].shape[1] for b in batches)
    tol = two_computations(forward_bound(local.model.config, width, top, len(tokenizer)))
    print(
        f"max |vLLM - local| log p_T: sampled tokens {worst['token']:.2e}, top-k {worst['topk']:.2e}; bound {tol:.2e}"
    )
    assert worst["token"] <= tol and worst["topk"] <= tol


def _opd_run(root: Path) -> list[dict]:
    cwd = os.getcwd()
    os.chdir(root)
    try:
        p = load_params("params.yaml")
        run_opd(TrainingJob.from_params("opd", p, progress=False))
        return read_jsonl(p.paths.training("opd").steps)
    finally:
        os.chdir(cwd)


def _opd_workspace(vllm_teacher, dest: Path, **opd) -> Path:
    shutil.copytree(vllm_teacher.root, dest, ignore=shutil.ignore_patterns("checkpoints", "opd", "live"))
    params = yaml.safe_load((dest / "params.yaml").read_text())
    params["opd"].update(opd)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return dest


def test_topk_opd_trains_on_vllm_scores_as_on_the_local_teacher(vllm_teacher, tmp_path):
    """8 OPD steps of the topk loss scored by vLLM (the endpoint path end to end: preflight, /tokenize probe,
    scoring every step) against the same run with the teacher in the worker: the per-step losses agree."""
    common = {
        "loss": "topk",
        "topk": 5,
        "steps": 8,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "max_new_tokens": 6,
        "checkpoint_every": 0,
        "snapshot_every": 0,
        "warmup_steps": 1,
        "lr": 0.005,
    }
    local = _opd_run(_opd_workspace(vllm_teacher, tmp_path / "local", teacher="local", **common))
    served = _opd_run(
        _opd_workspace(
            vllm_teacher,
            tmp_path / "vllm",
            teacher="endpoint",
            teacher_endpoint={"endpoint": vllm_teacher.url, "model": "teacher"},
            **common,
        )
    )
    assert len(local) == len(served) == 8
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(local, served)]
    print(f"max per-step |loss(local) - loss(vLLM)| {max(diffs):.2e}")
    # as in test_opd_endpoint: step 0 differs by the scores' rounding (two fp32 forwards, ~1e-6 here), the
    # later steps also by the trajectories' drift from it; 1e-4 allows that drift and is far below the loss's
    # own step-to-step changes (checked next)
    assert max(diffs) <= 1e-4, diffs
    assert len({round(r["loss"], 3) for r in served}) > 3  # it trained: the losses moved


def test_tokenizer_probe_goes_through_vllms_tokenize(vllm_teacher):
    """The pre-training probe reaches vLLM's root /tokenize (seen by a proxy) and passes for the student's
    tokenizer; a tokenizer that splits the probe otherwise (one more token) is refused with both sequences."""
    import asyncio

    tokenizer = load_tokenizer(str(vllm_teacher.models_dir))
    other = load_tokenizer(str(vllm_teacher.models_dir))
    other.add_tokens(["distillation"])  # in the probe text: one id where the server has twelve

    async def probe(url: str, tok) -> None:
        settings = ClientSettings(url, limits=EndpointConfig(endpoint=url, model="teacher"))
        client = make_client(settings)
        try:
            await check_tokenizer(client, "teacher", tok, settings, "opd.teacher_endpoint", k=5)
        finally:
            await client.close()

    with FaultyProxy(fault_rate=0.0, upstream=vllm_teacher.url.removesuffix("/v1")) as proxy:
        asyncio.run(probe(proxy.base_url, tokenizer))
        paths = [e["path"] for e in proxy.log]
        assert "/tokenize" in paths, paths  # the root route, not /v1/tokenize
        with pytest.raises(ScoringError, match="tokeniz"):
            asyncio.run(probe(proxy.base_url, other))


def test_a_raw_logits_server_is_refused_before_step_zero(vllm_teacher):
    """vLLM started with --logprobs-mode raw_logits returns logits as prompt_logprobs: the endpoint check
    refuses it naming the flag; the same check passes the server started as the README says."""
    cwd = os.getcwd()
    os.chdir(vllm_teacher.root)
    try:
        p = load_params("params.yaml")
        cfg = OPDConfig(teacher="endpoint", loss="topk", topk=5)
        job = dataclasses.replace(TrainingJob.from_params("opd", p), cfg=cfg)

        def endpoint(url: str) -> ScoringEndpoint:
            return ScoringEndpoint(url, "teacher", ClientSettings(url, "EMPTY", cfg.teacher_endpoint))

        check_scoring_endpoint(endpoint(vllm_teacher.url), job)
        with pytest.raises(NotLogprobsError, match="--logprobs-mode raw_logprobs"):
            check_scoring_endpoint(endpoint(vllm_teacher.raw_logits_url), job)
    finally:
        os.chdir(cwd)
    assert issubclass(NotLogprobsError, EndpointError)  # a stage prints it alone and exits 4


@pytest.mark.parametrize("status", [0, 3])
def test_vllm_serve_runs_the_command_after_dashes_against_the_server(monkeypatch, status):
    """`ars-opd vllm serve DIR --port P --name N -- COMMAND ...`: the options go to the server, everything after
    `--` (options included) is the command, run with the server's URL in $ARS_OPD_VLLM_URL; its status is ours.
    The server is a stand-in here (the real one is the fixture's): this is about the command line."""
    import contextlib

    from ars_opd import cli
    from ars_opd.serving import vllm_server

    started = []

    @contextlib.contextmanager
    def fake_server(model_dir, opts, port=0, log_path=None):
        started.append((model_dir, opts.served_model_name, port))
        yield "http://127.0.0.1:1/v1"

    monkeypatch.setattr(vllm_server, "vllm_server", fake_server)
    check = f"import os, sys; sys.exit({status} if os.environ['ARS_OPD_VLLM_URL'] == 'http://127.0.0.1:1/v1' else 9)"
    argv = ["vllm", "serve", "some/dir", "--port", "8123", "--name", "t", "--", sys.executable, "-c", check]
    assert cli.main(argv) == status
    assert started == [("some/dir", "t", 8123)]
