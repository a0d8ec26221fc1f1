"""How vLLM is launched for the build it is, without starting one (``ars_opd.serving.vllm_server``).

- **The build decides the CPU settings.** A CPU build gets fp32, ``--enforce-eager`` and a 256 MiB KV cache,
  the command byte for byte as before the build was asked; a GPU build gets vLLM's ``--dtype auto``, CUDA
  graphs (no ``--enforce-eager``) and ``--gpu-memory-utilization`` instead of a KV-cache size; explicit
  options win on either. ``auto`` asks the environment's python (here a stand-in interpreter that answers the
  probe as a CUDA or a CPU torch would, and records the command it is then started with).
- **A rollout engine's context is what the stage asks for**, the longest kept prompt plus the longest rollout
  (or a probe sequence), at most the student's context; not the student's 40,960 positions, which vLLM
  refuses to start with on a GPU's memory.
- **A precision the version check cannot hold is refused before the start**: a GPU build's bf16 with the
  first sync held to the derived fp32 bound (``opd.engine.probe_tolerance`` null).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest

from ars_opd.config import ConfigError, OPDConfig, RolloutEngineConfig
from ars_opd.rollouts import engines, stage
from ars_opd.serving import vllm_server
from ars_opd.serving.vllm_server import (
    PYTHON_ENV,
    VLLMOptions,
    VLLMServer,
    VLLMUnavailableError,
    resolve_build,
    resolve_options,
    vllm_command,
    vllm_env,
)

PY = Path("/envs/vllm/bin/python")
# the command every CPU start had before the build was asked (VLLMOptions() for model m on 127.0.0.1:8000)
CPU_COMMAND = [
    str(PY),
    "-m",
    "vllm.entrypoints.openai.api_server",
    "--model",
    "m",
    "--served-model-name",
    "teacher",
    "--host",
    "127.0.0.1",
    "--port",
    "8000",
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--max-logprobs",
    "20",
    "--logprobs-mode",
    "raw_logprobs",
    "--no-enable-prefix-caching",
    "--kv-cache-memory-bytes",
    "268435456",
    "--seed",
    "0",
    "--disable-log-stats",
    "--uvicorn-log-level",
    "warning",
    "--enforce-eager",
]


def _command(opts: VLLMOptions, build: str) -> list[str]:
    return vllm_command(PY, "m", "127.0.0.1", 8000, resolve_options(opts, build))


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_a_cpu_build_is_started_as_before_fp32_eager_in_a_small_kv_cache():
    assert _command(VLLMOptions(), "cpu") == CPU_COMMAND
    assert _command(VLLMOptions(build="cpu"), "cpu") == CPU_COMMAND


def test_a_gpu_build_gets_the_checkpoints_dtype_cuda_graphs_and_a_share_of_the_gpu():
    cmd = _command(VLLMOptions(), "gpu")
    assert _flag(cmd, "--dtype") == "auto"
    assert "--enforce-eager" not in cmd
    assert "--kv-cache-memory-bytes" not in cmd
    assert _flag(cmd, "--gpu-memory-utilization") == "0.9"
    # everything the build does not decide is as on CPU
    rest = [a for a in cmd if a not in ("auto", "--gpu-memory-utilization", "0.9")]
    assert rest == [a for a in CPU_COMMAND if a not in ("float32", "--kv-cache-memory-bytes", "268435456")][:-1]


def test_explicit_options_win_over_the_build():
    gpu = _command(
        VLLMOptions(dtype="float32", enforce_eager=True, kv_cache_bytes=1 << 30, gpu_memory_utilization=0.3), "gpu"
    )
    assert _flag(gpu, "--dtype") == "float32" and "--enforce-eager" in gpu
    assert _flag(gpu, "--kv-cache-memory-bytes") == str(1 << 30) and _flag(gpu, "--gpu-memory-utilization") == "0.3"
    cpu = _command(VLLMOptions(dtype="bfloat16", enforce_eager=False), "cpu")
    assert _flag(cpu, "--dtype") == "bfloat16" and "--enforce-eager" not in cpu
    assert "--gpu-memory-utilization" not in cpu  # vLLM CPU reads it as a share of the NUMA node: never passed


def test_unresolved_options_and_unknown_settings_are_refused():
    with pytest.raises(ValueError, match="resolved"):
        vllm_command(PY, "m", "127.0.0.1", 8000, VLLMOptions())
    with pytest.raises(ValueError, match="build"):
        VLLMOptions(build="tpu")
    with pytest.raises(ValueError, match="dtype"):
        VLLMOptions(dtype="fp32")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMOptions(gpu_memory_utilization=1.5)


def test_the_cpu_cores_go_to_a_cpu_build_only_and_the_projects_path_never():
    base = {"PYTHONPATH": "/work/repo", "HOME": "/root"}
    cpu = vllm_env(resolve_options(VLLMOptions(cpus="0"), "cpu"), base)
    assert cpu["VLLM_CPU_OMP_THREADS_BIND"] == "0" and "PYTHONPATH" not in cpu and cpu["HOME"] == "/root"
    gpu = vllm_env(resolve_options(VLLMOptions(cpus="0"), "gpu"), base)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in gpu and "PYTHONPATH" not in gpu


def test_one_process_sets_both_halves_and_the_default_neither():
    """The uni executor alone is turned back into vLLM CPU's multiprocess executor while its V1 multiprocessing
    variable is on: one_process sets the flag and the variable together, the default layout touches neither."""
    base = {"HOME": "/root", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    for build in ("cpu", "gpu"):
        opts = resolve_options(VLLMOptions(one_process=True), build)
        cmd = _command(VLLMOptions(one_process=True), build)
        assert _flag(cmd, "--distributed-executor-backend") == "uni"
        assert vllm_env(opts, base)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        plain = resolve_options(VLLMOptions(), build)
        assert "--distributed-executor-backend" not in _command(VLLMOptions(), build)
        assert vllm_env(plain, base)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert _command(VLLMOptions(one_process=True), "cpu")[: len(CPU_COMMAND)] == CPU_COMMAND
    with pytest.raises(ValueError, match="cpus"):  # the thread binding needs vLLM's multiprocess executor
        VLLMOptions(one_process=True, cpus="0")


def _fake_python(tmp_path: Path, answer: str) -> Path:
    """An interpreter that answers the build probe with ``answer`` and otherwise records how it was started
    (its argv after the exit-with-parent wrapper, and its environment) in ``started.json`` beside it."""
    script = tmp_path / answer / "python"
    script.parent.mkdir(parents=True)
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"if sys.argv[1:3] == ['-c', {vllm_server.BUILD_PROBE!r}]:\n"
        f"    print({answer!r}); sys.exit(0 if {answer!r} in ('cpu', 'gpu') else 1)\n"
        "out = os.path.join(os.path.dirname(sys.argv[0]), 'started.json')\n"
        "json.dump({'argv': sys.argv[4:], 'env': dict(os.environ)}, open(out, 'w'))\n"
    )
    script.chmod(0o755)
    return script


def _model(tmp_path: Path, head_dim: int = 64, context: int = 40960) -> Path:
    model = tmp_path / "student"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"head_dim": head_dim, "max_position_embeddings": context}))
    return model


@pytest.mark.parametrize("answer", ["cpu", "gpu"])
def test_auto_asks_the_environments_python_and_starts_what_its_build_needs(tmp_path, monkeypatch, answer):
    python = _fake_python(tmp_path, answer)
    monkeypatch.setenv(PYTHON_ENV, str(python))
    monkeypatch.setenv("PYTHONPATH", "/work/repo")
    assert resolve_build(VLLMOptions()) == answer
    server = VLLMServer(_model(tmp_path), VLLMOptions(cpus="0"), port=8000, log_path=tmp_path / "vllm.log")
    try:
        server.start()
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()
    started = json.loads((python.parent / "started.json").read_text())
    expected = [a if a != "m" else str(tmp_path / "student") for a in CPU_COMMAND]
    expected[0] = str(python)
    if answer == "cpu":
        assert started["argv"] == expected
        assert started["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    else:
        assert _flag(started["argv"], "--dtype") == "auto" and "--enforce-eager" not in started["argv"]
        assert _flag(started["argv"], "--gpu-memory-utilization") == "0.9"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in started["env"]
    assert "PYTHONPATH" not in started["env"] and server.launched.build == answer


def test_a_failed_probe_and_a_cpu_head_size_are_refused_before_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, "broken")))
    with pytest.raises(VLLMUnavailableError, match="which vLLM build"):
        resolve_build(VLLMOptions())
    assert resolve_build(VLLMOptions(build="gpu")) == "gpu"  # an explicit build asks nothing
    odd = _model(tmp_path, head_dim=48)
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, "cpu")))
    with pytest.raises(VLLMUnavailableError, match="heads of size 48"):
        VLLMServer(odd, VLLMOptions(), port=8000, log_path=tmp_path / "cpu.log").start()
    monkeypatch.setenv(PYTHON_ENV, str(_fake_python(tmp_path, "gpu")))  # a GPU's attention serves it
    server = VLLMServer(odd, VLLMOptions(), port=8000, log_path=tmp_path / "gpu.log")
    try:
        assert server.start().proc.wait(timeout=60) == 0
    finally:
        server.stop()


def _engine_opts(tmp_path: Path, cfg: OPDConfig, context: int = 40960, build: str = "cpu", **engine) -> VLLMOptions:
    """The options the opd stage starts a vLLM rollout engine with (``stage_engine``, ``vllm_server`` a stand-in)."""
    cfg = dataclasses.replace(cfg, rollouts="engine", engine=RolloutEngineConfig(server="vllm", build=build, **engine))
    student = _model(tmp_path, context=context)
    started = []

    @contextlib.contextmanager
    def fake_server(model_dir, opts, log_path=None):
        started.append(opts)
        yield "http://127.0.0.1:9/v1"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_server, "vllm_server", fake_server)
        mp.setattr(stage, "model_path", lambda models_dir, role: str(student))
        with stage.stage_engine(cfg, str(tmp_path / "models"), str(tmp_path / "ckpt")):
            pass
    (opts,) = started
    return opts


def test_a_rollout_engines_context_is_the_stages_need_not_the_students_full_context(tmp_path):
    cfg = OPDConfig()
    assert engines.stage_context(cfg) == cfg.max_prompt_tokens + cfg.max_new_tokens == 268
    assert _engine_opts(tmp_path, cfg).max_model_len == 268  # a Qwen3-like student: 40,960 positions
    long = dataclasses.replace(cfg, max_prompt_tokens=2048, max_new_tokens=1024)
    assert _engine_opts(tmp_path, long).max_model_len == 3072
    assert _engine_opts(tmp_path, long, context=512).max_model_len == 512  # never past the student's context
    assert _engine_opts(tmp_path, cfg, max_model_len=1000).max_model_len == 1000  # an explicit one wins
    probe = dataclasses.replace(cfg, max_prompt_tokens=8, max_new_tokens=4)
    assert _engine_opts(tmp_path, probe, probe_tokens=64).max_model_len == 65  # a probe sequence and its one token


def test_a_rollout_engine_is_launched_for_its_build(tmp_path):
    cpu = _engine_opts(tmp_path, OPDConfig(), cpus="0")
    assert (cpu.build, cpu.dtype, cpu.enforce_eager, cpu.kv_cache_bytes, cpu.cpus) == (
        "cpu",
        "float32",
        True,
        256 << 20,
        "0",
    )
    assert cpu.weight_sync
    gpu = _engine_opts(tmp_path, OPDConfig(), build="gpu", dtype="float32", gpu_memory_utilization=0.25)
    assert (gpu.dtype, gpu.enforce_eager, gpu.kv_cache_bytes, gpu.gpu_memory_utilization) == (
        "float32",
        False,
        None,
        0.25,
    )
    eager = _engine_opts(tmp_path, OPDConfig(), build="gpu", dtype="float32", enforce_eager=True)
    assert eager.enforce_eager


def test_a_gpu_builds_bf16_is_refused_while_the_first_sync_holds_to_the_fp32_bound(tmp_path):
    with pytest.raises(ConfigError, match=r"opd.engine.dtype: a gpu vLLM computes in auto .*probe_tolerance"):
        _engine_opts(tmp_path, OPDConfig(), build="gpu")
    with pytest.raises(ConfigError, match="opd.engine.dtype: a cpu vLLM computes in bfloat16"):
        _engine_opts(tmp_path, OPDConfig(), dtype="bfloat16")
    assert _engine_opts(tmp_path, OPDConfig(), build="gpu", probe_tolerance=0.05).dtype == "auto"


def test_the_engine_settings_are_checked_where_they_are_read():
    for bad in ({"build": "tpu"}, {"dtype": "fp32"}, {"gpu_memory_utilization": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RolloutEngineConfig(**bad)


def test_vllm_serve_passes_the_launch_settings_through(monkeypatch):
    from ars_opd import cli

    started = []

    @contextlib.contextmanager
    def fake_server(model_dir, opts, port=0, log_path=None):
        started.append(opts)
        yield "http://127.0.0.1:1/v1"

    monkeypatch.setattr(vllm_server, "vllm_server", fake_server)
    check = [sys.executable, "-c", "pass"]
    assert cli.main(["vllm", "serve", "d", "--", *check]) == 0
    argv = ["vllm", "serve", "d", "--build", "gpu", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5"]
    assert cli.main([*argv, "--enforce-eager", "--", *check]) == 0
    default, gpu = started
    assert (default.build, default.dtype, default.enforce_eager, default.gpu_memory_utilization) == (
        "auto",
        None,
        None,
        0.9,
    )
    assert (gpu.build, gpu.dtype, gpu.enforce_eager, gpu.gpu_memory_utilization) == ("gpu", "bfloat16", True, 0.5)
    assert os.environ.get("ARS_OPD_VLLM_URL") is None  # only the command's environment carries it
