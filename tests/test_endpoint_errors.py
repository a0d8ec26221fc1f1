"""Endpoint and API-key errors end a stage with one message and exit 4, never a traceback.

Each case runs the real stage entry point (``python -m stages.teacher_gen`` / ``stages.opd``) in a micro
workspace against a port nobody listens on or a fake endpoint (tests/fake_endpoint.py), and checks the exit
code, that stderr is that one message, and that it names the URL or the key and the fix. The preflight runs
before any request is sent (teacher_gen) and before any worker starts (opd); an endpoint error raised inside a
data-parallel worker reaches the stage as the same clean error, while any other exception keeps its traceback.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from micro import write_micro_params

REPO = Path(__file__).resolve().parents[1]
MISSING_KEY = "ARS_OPD_TEST_UNSET_API_KEY"
EXIT_ENDPOINT = 4  # stages.EXIT_ENDPOINT (not imported: importing stages checks the environment)


def _free_url() -> str:
    with socket.socket() as s:  # bound, then closed: nobody listens on it
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.fixture(scope="module")
def template(tmp_path_factory, char_tokenizer):
    """What both stages read before they reach the endpoint: a tiny subset (teacher_gen) and the shared
    tokenizer at the models stage's place (opd's tokenizer check); made once, copied per case."""
    from ars_opd.artifacts import write_jsonl
    from ars_opd.config import DataConfig, PathsConfig, SyntheticConfig
    from ars_opd.data.subset import make_subset

    root = tmp_path_factory.mktemp("endpoint_errors")
    paths = PathsConfig()
    subset = make_subset(DataConfig(subset_size=12, eval_size=4), SyntheticConfig(), seed=0)
    for rows, path in ((subset.train, paths.subset_train), (subset.eval, paths.subset_eval)):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(root / path, rows)
    char_tokenizer.save_pretrained(str(root / paths.models_dir / "tokenizer"))
    return root


def _other_tokenizer_endpoint():
    """A fake endpoint whose vLLM-style /tokenize (beside /v1) gives other ids than the student's tokenizer:
    what a teacher served with another vocabulary looks like."""
    from aiohttp import web

    from fake_endpoint import FakeEndpoint

    class OtherTokenizer(FakeEndpoint):
        def app(self) -> web.Application:
            app = super().app()

            async def tokenize(request: web.Request) -> web.Response:
                return web.json_response({"tokens": [7, 7, 7]})

            app.router.add_post("/tokenize", tokenize)
            return app

    return OtherTokenizer()


def _stage(template: Path, root: Path, stage: str, endpoint: dict) -> subprocess.CompletedProcess:
    """Run ``stage`` in a copy of the template whose params point its endpoint section at ``endpoint``."""
    shutil.copytree(template, root)
    if stage == "teacher_gen":
        extra = {"teacher_gen": {"request_timeout_s": 2.0, **endpoint}}
    else:
        extra = {
            "opd": {
                "teacher": "endpoint",
                "loss": "sampled_token",
                "teacher_endpoint": {"request_timeout_s": 2.0, **endpoint},
            }
        }
    write_micro_params(REPO, root / "params.yaml", extra)
    env = {k: v for k, v in os.environ.items() if k != MISSING_KEY}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", f"stages.{stage}"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def _assert_one_clean_message(out: subprocess.CompletedProcess, stage: str, *needles: str) -> str:
    assert out.returncode == EXIT_ENDPOINT, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ars-opd {stage}: "), out.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


SECTION = {"teacher_gen": "teacher_gen", "opd": "opd.teacher_endpoint"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["teacher_gen", "opd"])
def test_unreachable_endpoint(template, tmp_path, stage):
    url = _free_url()
    out = _stage(template, tmp_path / "w", stage, {"endpoint": url, "model": "teacher"})
    _assert_one_clean_message(
        out, stage, f"cannot reach the teacher endpoint {url}", "start the server", f"set {SECTION[stage]}.endpoint"
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["teacher_gen", "opd"])
def test_wrong_model_name(template, tmp_path, stage):
    from fake_endpoint import FakeEndpoint

    with FakeEndpoint(model="fault-teacher") as ep:
        out = _stage(template, tmp_path / "w", stage, {"endpoint": ep.base_url, "model": "no-such-model"})
        assert ep.log == []  # not one completion asked for
    _assert_one_clean_message(
        out,
        stage,
        f"model 'no-such-model' is not served at {ep.base_url}",
        "['fault-teacher']",
        f"set {SECTION[stage]}.model",
    )


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["teacher_gen", "opd"])
def test_missing_api_key_variable(template, tmp_path, stage):
    from fake_endpoint import FakeEndpoint

    with FakeEndpoint() as ep:
        out = _stage(
            template, tmp_path / "w", stage, {"endpoint": ep.base_url, "model": ep.model, "api_key_env": MISSING_KEY}
        )
        assert ep.log == []
    _assert_one_clean_message(out, stage, f"{SECTION[stage]}.api_key_env names {MISSING_KEY}", "not set", "export it")


@pytest.mark.slow
def test_tokenizer_mismatch_between_the_teacher_endpoint_and_the_student(template, tmp_path):
    with _other_tokenizer_endpoint() as ep:
        out = _stage(template, tmp_path / "w", "opd", {"endpoint": ep.base_url, "model": ep.model})
    _assert_one_clean_message(out, "opd", ep.base_url, "tokenizes differently", "opd.teacher_endpoint.endpoint")


# --- errors raised inside a data-parallel worker ------------------------------------------------------------


def worker_raises(kind: str) -> None:
    """A worker body (importable by the spawned process) that fails as ``kind`` says."""
    from ars_opd.teacher.client.endpoint import EndpointError

    if kind == "endpoint":
        raise EndpointError("the teacher endpoint http://127.0.0.1:9/v1 stopped answering: start it again")
    raise ValueError("an unexpected failure")


def stage_main() -> None:
    """A stage whose one worker raises an EndpointError (run through stages.run_stage by the test)."""
    from ars_opd.training.distributed import launch

    launch(worker_raises, "endpoint", workers=1, in_process=False)  # the spawned path: pickled back


@pytest.mark.slow
def test_an_endpoint_error_in_a_worker_reaches_the_stage_as_itself(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    code = "from stages import run_stage; from test_endpoint_errors import stage_main; run_stage(stage_main)"
    # run where the stage's record of runs (paths.stage_runs, relative) may be written: not the repo's workspace
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    _assert_one_clean_message(out, "test_endpoint_errors", "http://127.0.0.1:9/v1 stopped answering")


@pytest.mark.slow
def test_an_unexpected_error_in_a_worker_keeps_its_traceback():
    from ars_opd.training.distributed import WorkerFailedError, launch

    with pytest.raises(ValueError, match="an unexpected failure") as e:  # a spawned worker
        launch(worker_raises, "value", workers=1, in_process=False)
    cause = e.value.__cause__
    assert isinstance(cause, WorkerFailedError)
    assert "Traceback" in str(cause) and "in worker_raises" in str(cause)  # the worker's own frames
    with pytest.raises(ValueError, match="an unexpected failure") as e:  # one worker in this process
        launch(worker_raises, "value", workers=1)
    assert any(frame.name == "worker_raises" for frame in traceback.extract_tb(e.value.__traceback__))


def test_run_stage_prints_an_endpoint_error_alone_and_lets_others_through(capsys, monkeypatch, tmp_path):
    from ars_opd.teacher.client.endpoint import EndpointError
    from stages import EXIT_ENDPOINT as code
    from stages import run_stage

    def main() -> None:
        raise EndpointError("the teacher endpoint http://x/v1 is gone: start it")

    monkeypatch.chdir(tmp_path)  # run_stage records the run under paths.stage_runs, relative to the workspace

    with pytest.raises(SystemExit) as e:
        run_stage(main)
    assert e.value.code == code == EXIT_ENDPOINT
    assert (
        capsys.readouterr().err == "ars-opd test_endpoint_errors: the teacher endpoint http://x/v1 is gone: start it\n"
    )

    def broken() -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):  # unexpected: propagates, traceback and all
        run_stage(broken)
