"""base.cpu_kernels: the caps are set where they must be (this process's environment, on x86-64 only), torch
then dispatches to AVX2 (asked of torch itself in a fresh process, where nothing has dispatched yet), and a stage
run through ``run_stage`` runs on the params' kernels and records them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ars_opd.config import ConfigError, load_params
from ars_opd.seeding import KERNEL_ENV, pin_cpu_kernels

REPO = Path(__file__).resolve().parents[1]
CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CAPS}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_the_caps_go_into_the_environment_on_x86_only():
    env = {"ATEN_CPU_CAPABILITY": "avx512", "OTHER": "1"}
    assert pin_cpu_kernels("avx2", env, machine="x86_64") == KERNEL_ENV["avx2"]
    assert env == {"OTHER": "1", **KERNEL_ENV["avx2"]}  # the params override what was there
    assert set(KERNEL_ENV["avx2"]) == set(CAPS)
    for machine in ("aarch64", "arm64", "ppc64le"):
        env = {}
        assert pin_cpu_kernels("avx2", env, machine=machine) == {} and env == {}
    env = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert pin_cpu_kernels("native", env, machine="AMD64") == {} and env == {"ATEN_CPU_CAPABILITY": "avx512"}
    with pytest.raises(ValueError):
        pin_cpu_kernels("avx512", {}, machine="x86_64")


def test_params_refuse_an_unknown_kernel_choice(tmp_path):
    (tmp_path / "params.yaml").write_text("base:\n  cpu_kernels: avx512\n")
    with pytest.raises(ConfigError, match="cpu_kernels"):
        load_params(tmp_path / "params.yaml", sections=("base",))


def _capability(code: str, env: dict, cwd: Path | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


ASK = "import torch; torch.ones(2) @ torch.ones(2); print(torch.backends.cpu.get_cpu_capability())"


@pytest.mark.skipif(os.uname().machine.lower() not in ("x86_64", "amd64"), reason="the caps name x86 instruction sets")
def test_torch_dispatches_to_avx2_once_pinned():
    """In a fresh process: pinned, torch reports AVX2 (this holds on any x86-64 CPU with AVX2, the CI's included);
    unpinned, it reports the CPU's own best, which on a CPU with AVX-512 is not AVX2 (so the assertion above
    could fail)."""
    env = _clean_env()
    native = _capability(ASK, env)
    pinned = _capability("from ars_opd.seeding import pin_cpu_kernels; pin_cpu_kernels('avx2'); " + ASK, env)
    assert pinned == "AVX2", (native, pinned)
    assert native in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX", "AVX512_FP16", "AVX10")


@pytest.mark.skipif(os.uname().machine.lower() not in ("x86_64", "amd64"), reason="the caps name x86 instruction sets")
@pytest.mark.parametrize("choice", ["avx2", "native"])
def test_a_stage_runs_on_its_params_kernels_and_records_them(tmp_path, choice):
    """A stage's ``main`` started through ``run_stage`` in a workspace whose params name the kernels: what torch
    dispatched to inside it is what the params asked, and ``paths.stage_runs`` records it."""
    (tmp_path / "params.yaml").write_text(f"base:\n  cpu_kernels: {choice}\n")
    (tmp_path / "kernel_probe.py").write_text(
        "def main():\n"
        "    import torch\n"
        "    torch.ones(2) @ torch.ones(2)\n"
        "    print(torch.backends.cpu.get_cpu_capability())\n"
    )
    env = _clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)])
    seen = _capability("import stages, kernel_probe; stages.run_stage(kernel_probe.main)", env, cwd=tmp_path)
    native = _capability(ASK, _clean_env())
    assert seen == ("AVX2" if choice == "avx2" else native)
    runs = [json.loads(x) for x in (tmp_path / "data" / "logs" / "stage_runs.jsonl").read_text().splitlines()]
    assert runs[-1]["stage"] == "kernel_probe" and runs[-1]["ok"] and runs[-1]["cpu_kernels"] == seen


def test_run_stage_reads_params_once(tmp_path, monkeypatch):
    """``run_stage`` reads params.yaml once and takes the kernels and ``paths.stage_runs`` from that one reading
    (it read the file once per use before)."""
    import ars_opd.config as config
    import stages

    (tmp_path / "params.yaml").write_text("base:\n  cpu_kernels: native\npaths:\n  stage_runs: runs/here.jsonl\n")
    monkeypatch.chdir(tmp_path)
    reads = []
    real = config.read_params_file

    def counting(*args, **kwargs):
        reads.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(config, "read_params_file", counting)
    ran = []
    stages.run_stage(lambda: ran.append(True))
    assert ran == [True] and len(reads) == 1
    runs = [json.loads(x) for x in (tmp_path / "runs" / "here.jsonl").read_text().splitlines()]
    assert runs[-1]["ok"]
