"""The OPD step at rollout lag 0 and lag 1 on a vLLM engine: ``python bench/rollouts.py --opd-steps N``.

The opd stage itself (``run_opd``: one training worker, the pipeline's teacher and prompts) trains a ~50M
built-in student (width 512, 12 layers, 8 heads of 64, MLP 2048, the pipeline's tokenizer) for ``N`` steps
at a learning rate of 1e-9 (the same rollout work every step; see ``opd_params``)
with its rollouts on a vLLM CPU engine that this script starts with the worker extension (the stage is given
its URL, as a user names a server they started), once with ``opd.engine.max_lag: 0`` and once with 1. The
engine runs on core 0 and the trainer on core 1, as on separate devices. One JSON line per lag:
``{"kind": "opd_step", "lag", "steps", "step_s" (median over the steps after the first), "gen_s" (the step's
wait for its rollouts), "sync_s", "rollout_share" (gen_s / step_s at lag 0: what a lag can hide), ...}``, then
``{"kind": "opd_lag", "lag1_over_lag0": ratio of the median step times}``.

It needs the pipeline's outputs (``dvc repro``: the teacher, the prompts) and ``.venv-vllm`` (``make vllm``);
without them it prints one ``skipped`` line saying why.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

STUDENT = dict(hidden_size=512, num_layers=12, num_heads=8, num_kv_heads=8, intermediate_size=2048)


def problem(params) -> str | None:
    """Why the OPD lag cannot be measured here, or None."""
    from ars_opd.serving.vllm_server import VLLMUnavailableError, vllm_python

    try:
        vllm_python()
    except VLLMUnavailableError as e:
        return str(e)
    for need in (Path(params.paths.models_dir) / "manifest.json", Path(params.paths.subset_train)):
        if not need.exists():
            return f"{need} is missing: run the pipeline first (dvc repro)"
    return None


def student_dir(params, which: str, directory: Path) -> Path:
    """The student to train: ``pipeline`` is the opd stage's own start (``paths.distill_init``, as the pipeline
    left it: on the real profile the pruned SmolLM2 after SFT), ``llama50m`` the ~50M built-in one."""
    if which == "pipeline":
        start = Path(params.paths.distill_init)
        if not (start / "config.json").is_file():
            raise SystemExit(f"--opd-student pipeline: no model in {start}: run the pipeline first")
        return start
    return save_student(params, directory)


def save_student(params, directory: Path) -> Path:
    """The ~50M built-in student with the pipeline's tokenizer (so the pipeline's teacher can score it)."""
    from ars_opd.config import ArchConfig
    from ars_opd.models.builtin import save_builtin_model
    from ars_opd.models.loading import load_tokenizer

    tokenizer = load_tokenizer(params.paths.models_dir)
    arch = dataclasses.replace(ArchConfig(), **STUDENT)
    return save_builtin_model(directory, arch, tokenizer, seed=0)


def opd_params(params, student: Path, url: str, served: str, lag: int, steps: int, batch: int, new_tokens: int, work):
    """The pipeline's params with the opd stage pointed at ``student``, the engine at ``url``, outputs under
    ``work`` (relative to the repository root, as the stage's paths must be)."""
    out = Path(work) / f"lag{lag}"
    paths = dataclasses.replace(
        params.paths,
        distill_init=str(student),
        opd_model=str(out / "model"),
        opd_log=str(out / "log"),
        opd_live=str(out / "live"),
        opd_checkpoints=str(out / "checkpoints"),
    )
    engine = dataclasses.replace(params.opd.engine, server=url, model=served, max_lag=lag, sync_dir=str(out / "sync"))
    opd = dataclasses.replace(
        params.opd,
        steps=steps,
        global_batch_size=batch,
        micro_batch_size=min(batch, 8),
        max_new_tokens=new_tokens,
        rollouts="engine",
        engine=engine,
        snapshot_every=0,
        warmup_steps=0,
        # a rate too small to move the student: every step samples the same policy, so both lags do the same work
        # (trained at the stage's rate, the random student learns to stop early, and sooner at one lag than the
        # other: the first try measured 4.9 tokens a rollout at lag 0 against 1.1 at lag 1). Syncs and probes
        # run as in training.
        lr=1e-9,
    )
    ddp = dataclasses.replace(params.ddp, workers=1, threads_per_worker=1, device="cpu", consistency=False)
    return dataclasses.replace(params, paths=paths, opd=opd, ddp=ddp)


def step_line(lag: int, checkpoints: Path) -> dict:
    """The medians of the run's steps after the first (the first syncs version 0 and warms the engine), read
    from its last checkpoint's log (the stage's steps.jsonl leaves the wall-clock columns out; the checkpoint
    keeps every column)."""
    last = sorted(checkpoints.glob("step_*"))[-1]
    rows = [json.loads(x) for x in (last / "steps.jsonl").read_text().splitlines() if x.strip()]
    later = rows[1:] or rows

    def med(key: str) -> float:
        values = [r[key] for r in later if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
        return statistics.median(values) if values else float("nan")

    return {
        "kind": "opd_step",
        "lag": lag,
        "steps": len(rows),
        "step_s": med("step_s"),
        "gen_s": med("task/gen_s"),
        "sync_s": med("task/sync_s"),
        "rollout_lag": med("task/rollout_lag"),
        "response_length": med("task/response_length"),
        "engine_tok_per_s": med("task/engine_tok_per_s"),
        "all_step_s": [r["step_s"] for r in rows],
    }
