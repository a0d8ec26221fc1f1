"""Shared fixtures, and how the suite shares two cores. Tests never touch the network: the hub is forced offline
for the whole session.

What a new test can reuse rather than build again:

- configs: ``tests/micro.py`` (``micro_params``, ``write_micro_params``, ``committed_params``,
  ``load_committed_params``), always from the committed params.yaml, never the workspace's (micro.py says why);
- a micro workspace ready for opd/sft_continued: ``micro.distill_workspace``; its models come from
  ``micro.micro_models``, made once per session for each distinct ``models``/``synthetic`` config;
- any other expensive set-up several tests need the same of, in whichever worker: ``micro.made_once(name,
  make)``, made once per session under a file lock in a directory both workers share;
- the real profile's models (SmolLM2 from the wheel's GGUF, the pruned student): ``real_models.shared_real_models``;
- a real vLLM: ``vllm_teacher`` (module scope: two servers of a micro teacher) and ``vllm_student`` (module scope:
  a rollout engine) below. A file's module fixtures start once, in the one worker that runs the file (``--dist
  loadfile``), and stop when it ends, so tests that need the same server belong in one file.

Two workers on two cores (``make test``: ``-n 2 --dist loadfile``):

- torch in each worker runs ``THREADS`` intra-op threads (cores / workers, so 1), reset before every test (a stage
  run in-process sets its own and would leave it set): two workers with torch's default of one thread per core
  ran four threads on two cores, and a thread pool whose threads wait on each other slows down by several times
  when its threads are not all running. Subprocesses (stages, servers) take their threads from their params.
- ``SLOW_FILES`` are handed out first, longest first (``make test`` passes ``--no-loadscope-reorder``: xdist
  otherwise orders files by their number of tests, which put the few-test, many-minute files last, run by one
  worker while the other had finished); the many short files then fill in around them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _threads_per_worker() -> int | None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    return max(1, len(os.sched_getaffinity(0)) // workers) if workers > 1 else None


THREADS = _threads_per_worker()  # None: one process (no xdist), torch's default


@pytest.fixture(autouse=True)
def _worker_threads():
    if THREADS is not None:
        import torch

        torch.set_num_threads(THREADS)


@pytest.fixture(scope="session", autouse=True)
def _session_dir(tmp_path_factory):
    """``micro.SESSION_DIR``: under pytest-xdist each worker's base temporary directory lies in the session's,
    which both workers share; alone, the base is the session's."""
    import micro

    base = tmp_path_factory.getbasetemp()
    micro.SESSION_DIR = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "made-once"


def _workspace_files() -> dict[str, tuple[int, int]]:
    """The repo workspace's data/ files (path -> size, mtime): what the pipeline writes, and no test may."""
    data = REPO / "data"
    return {str(p.relative_to(REPO)): (p.stat().st_size, p.stat().st_mtime_ns) for p in data.rglob("*") if p.is_file()}


_WORKSPACE_AT_START: dict[str, tuple[int, int]] = {}


def pytest_sessionstart(session):
    """Read the committed params.yaml, which every test config is built from (tests/micro.py says why not the
    workspace's), once at the start: a checkout git cannot show it from fails here, before any test runs. The
    controller also notes the workspace's data/ files, which ``pytest_sessionfinish`` checks nothing wrote."""
    from micro import committed_text

    committed_text("params.yaml")
    if not hasattr(session.config, "workerinput"):
        _WORKSPACE_AT_START.update(_workspace_files())


def pytest_sessionfinish(session, exitstatus):
    """A test that ran a stage (or ``stages.run_stage``) with the repo as its working directory wrote into the
    user's workspace (a record of runs under data/logs/, a stage's outputs): the session fails naming the files.
    A pipeline run in this workspace while the tests ran trips it too; the message says so."""
    if hasattr(session.config, "workerinput") or not _WORKSPACE_AT_START and not (REPO / "data").is_dir():
        return
    now = _workspace_files()
    changed = sorted(k for k in now.keys() | _WORKSPACE_AT_START.keys() if now.get(k) != _WORKSPACE_AT_START.get(k))
    if changed:
        print(
            f"\nthe test session changed the repo's workspace (run each stage in a temporary directory; or was a "
            f"pipeline running here meanwhile?): {changed[:10]}",
            file=sys.stderr,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def char_tokenizer():
    from ars_opd.data import synthetic
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    return build_char_word_tokenizer(synthetic.instruction_words())


# ---- a real vLLM (tests marked vllm) -------------------------------------------------------------------------

# the micro teacher with heads of 32, a size vLLM's CPU attention serves (the micro default's are 16)
VLLM_TEACHER_ARCH = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 128}
VLLM_MODEL = "teacher"


# Files that take a minute or more on 2 cores under make test (its --durations), longest first: handed out first
# (the module docstring says why). A new file that takes minutes belongs here, by its time.
SLOW_FILES = (
    "test_real_pipeline.py",
    "test_dvc_pipeline.py",
    "test_engine_rollouts.py",
    "test_endpoint_errors.py",
    "test_vllm.py",
    "test_fsdp.py",
    "test_sft_stage.py",
    "test_version_check_real.py",
    "test_gguf_pruning.py",
    "test_cross_tokenizer_stage.py",
    "test_engine.py",
    "test_engine_stage.py",
    "test_rollouts_bench.py",
    "test_engine_server.py",
    "test_multinode.py",
    "test_opd_endpoint.py",
    "test_dvc_inputs.py",
)


def pytest_collection_modifyitems(config, items):
    """``SLOW_FILES`` first, in their order; within a file, and among the rest, the vllm tests last, so that a
    module's vLLM server starts late and few other tests share the cores with an idle one (about a fifth of a
    core each). Under ``--dist loadfile`` a file's tests run in one worker, in this order."""

    def key(item):
        name = item.path.name
        rank = SLOW_FILES.index(name) if name in SLOW_FILES else len(SLOW_FILES)
        return rank, item.get_closest_marker("vllm") is not None

    items.sort(key=key)  # stable: the rest keep their order


# The vLLMs the tests start themselves run in one process (VLLMOptions(one_process=True)): about 10 s less per
# server on 2 cores, the same forward. The servers a stage starts (its params) keep vLLM's default layout, as a
# user's run has it.


@dataclass(frozen=True)
class VLLMTeacher:
    """A micro workspace (``root``: params, built-in micro models with ``VLLM_TEACHER_ARCH``'s teacher, teacher
    rows, an SFT student) and two real vLLM servers for its teacher, served as ``model``: ``url`` started as the
    README says (``--logprobs-mode raw_logprobs``, no prefix caching), ``raw_logits_url`` with ``raw_logits``."""

    root: Path
    models_dir: Path
    teacher_dir: Path
    url: str
    raw_logits_url: str
    model: str = VLLM_MODEL


@pytest.fixture(scope="module")
def vllm_teacher(tmp_path_factory):
    """Both servers start side by side and stop after the module that asked for them (a session fixture idled
    on until the end of the session, after its one file had run). No vLLM environment, or a server that does not
    start, is an error naming why (never a skip): ``make test`` builds ``.venv-vllm`` first."""
    from ars_opd.config import load_params
    from ars_opd.models.loading import model_path
    from ars_opd.serving.vllm_server import VLLMOptions, VLLMServer
    from micro import distill_workspace

    root = tmp_path_factory.mktemp("vllm") / "workspace"
    distill_workspace(REPO, root, {}, workers=1, models={"teacher_arch": VLLM_TEACHER_ARCH})
    models_dir = root / load_params(root / "params.yaml").paths.models_dir
    teacher_dir = Path(model_path(str(models_dir), "teacher"))
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [
        VLLMServer(
            teacher_dir,
            VLLMOptions(served_model_name=VLLM_MODEL, one_process=True),
            log_path=logs / "raw_logprobs.log",
        ),
        VLLMServer(
            teacher_dir,
            VLLMOptions(served_model_name=VLLM_MODEL, logprobs_mode="raw_logits", one_process=True),
            log_path=logs / "raw_logits.log",
        ),
    ]
    try:
        for server in servers:
            server.start()
        urls = [server.wait_ready() for server in servers]
        yield VLLMTeacher(root, models_dir, teacher_dir, urls[0], urls[1])
    finally:
        for server in servers:
            server.stop()


# the rollout engine's student: heads of 32 (vLLM's CPU attention), tied embeddings, scaled for sharp laws
VLLM_STUDENT_ARCH = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 128}


@dataclass(frozen=True)
class VLLMStudent:
    """A built-in student (``test_engine_server.save_student``: tied embeddings, a generation_config that must
    not leak) served by one real vLLM as a rollout engine (``VLLMOptions(weight_sync=True)``): ``url`` is root +
    ``/v1``, ``root`` the server root (``/collective_rpc``)."""

    model_dir: Path
    url: str
    root: str
    model: str = "student"


@pytest.fixture(scope="module")
def vllm_student(tmp_path_factory, char_tokenizer):
    """Started for the module that asks for it and stopped after it (about 40 s to start); an error, never a
    skip, when it cannot start."""
    from ars_opd.config import ArchConfig
    from ars_opd.serving.vllm_server import VLLMOptions, VLLMServer
    from test_engine_server import save_student

    model_dir = save_student(tmp_path_factory.mktemp("vllm_student"), char_tokenizer, ArchConfig(**VLLM_STUDENT_ARCH))
    log = tmp_path_factory.mktemp("vllm-student-logs") / "vllm.log"
    server = VLLMServer(
        model_dir,
        VLLMOptions(served_model_name="student", weight_sync=True, one_process=True),
        log_path=log,
    )
    try:
        server.start()
        url = server.wait_ready()
        yield VLLMStudent(model_dir, url, server.root)
    finally:
        server.stop()
