"""Where a real-size OPD step's time goes: torch.profiler's top operators of our step, and the step split into phases.

The same setting as bench/peer_trl.py's OPD runs (its ``real_params``: the real profile, one CPU worker, the base
pruned SmolLM2 student, the local teacher, reverse KL over the full vocabulary, ``--max-new-tokens`` 64): for each of
``--variants`` (peer_trl's ``OPD_SETTINGS``: ``trainer_rollouts``, the profile's; ``static_rollouts``;
``bf16_rollouts``; ``bf16_rollouts_teacher``), ``--warmup`` untimed steps, then one step under ``torch.profiler``
(CPU activities, ``record_shapes`` off). Prints JSON lines:

- ``{"kind": "opd_profile", "variant", "settings", "threads", "step_s", "phases": {"rollouts_s", "teacher_forward_s",
  "rest_s"}, "top": [{"op", "self_cpu_s", "share", "calls"}, ...]}``: the ``--top`` operators by self CPU time, and
  the step's three phases: sampling (the task's own ``gen_s``), the teacher's forward (its body; the products with its
  head run inside the chunked loss) and the rest (the student's forward, the chunked loss, backward and AdamW).

    python bench/opd_profile.py --threads 2                 # after make repro-real (reads its models and completions)

``--profile`` takes another profile's settings (its models must be in ``--models``), ``--quick`` a global batch of 4
in micro-batches of 2, ``--adapter lora`` the student adapted by LoRA (``models.student_adapter``, its params.yaml
rank) where a full student's AdamW moments do not fit beside the teacher, and ``--teacher-dtype`` the teacher's
weights. docs/larger-teacher.md times the Qwen2.5-Coder 1.5B -> 0.5B pair (profiles/qwen_pair.yaml) so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from peer_trl import OPD_SETTINGS, link_inputs, real_params, worker_setup  # noqa: E402

from ars_opd.config import AdapterConfig, load_params  # noqa: E402
from ars_opd.training.distributed import init_worker, shutdown_worker  # noqa: E402
from ars_opd.training.loop import Trainer  # noqa: E402
from ars_opd.training.opd.stage import prepare_opd  # noqa: E402
from ars_opd.training.task import RunHooks  # noqa: E402
from ars_opd.training.worker import TrainingJob  # noqa: E402


def profile_step(
    ctx, params, variant: str, threads: int, warmup: int, top: int, adapter=AdapterConfig(), teacher_dtype=None
) -> dict:
    torch.set_num_threads(threads)
    cfg = dataclasses.replace(params.opd, **OPD_SETTINGS[variant])
    if teacher_dtype is not None:
        cfg = dataclasses.replace(cfg, teacher_dtype=teacher_dtype)
    job = TrainingJob("opd", cfg, params.ddp, params.paths, progress=False, control=params.control, adapter=adapter)
    job.check()
    run = prepare_opd(job, worker_setup(ctx, params, "opd", cfg))
    run.model.train()
    trainer = Trainer.build(ctx, run.model, run.task, cfg, params.ddp, RunHooks(progress=False))
    metas: list[dict] = []
    make = run.task.micro_batches

    def recording(step, model):
        micro = make(step, model)
        metas.append(micro[0].meta)
        return micro

    run.task.micro_batches = recording
    teacher_s = [0.0]
    score = run.task.teacher.score

    def timed_score(*args, **kwargs):  # the teacher's forward (its head's products run inside the loss)
        t0 = time.perf_counter()
        out = score(*args, **kwargs)
        teacher_s[0] += time.perf_counter() - t0
        return out

    run.task.teacher.score = timed_score
    for _ in range(warmup):
        trainer.step()
        trainer.state.step += 1
    teacher_s[0] = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        trainer.step()
        step_s = time.perf_counter() - t0
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    meta = metas[-1]
    gen_s = meta["gen_s"][0]
    return {
        "kind": "opd_profile",
        "variant": variant,
        "settings": OPD_SETTINGS[variant],
        "adapter": adapter.kind,
        "teacher_dtype": cfg.teacher_dtype,
        "threads": threads,
        "new_tokens": cfg.max_new_tokens,
        "batch": cfg.global_batch_size,
        "step_s": round(step_s, 3),
        "phases": {
            "rollouts_s": round(gen_s, 3),
            "teacher_forward_s": round(teacher_s[0], 3),
            "rest_s": round(step_s - gen_s - teacher_s[0], 3),
        },
        "top": [
            {
                "op": e.key,
                "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3),
                "share": round(e.self_cpu_time_total / total, 3),
                "calls": e.count,
            }
            for e in ranked
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=None, help="models dir (default: the params' paths.models_dir)")
    ap.add_argument("--teacher-rows", type=Path, default=None, help="default: the params' teacher_dir/train.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=list(OPD_SETTINGS),
        choices=list(OPD_SETTINGS),
        help="settings of the opd stage, as bench/peer_trl.py names them",
    )
    ap.add_argument("--profile", type=Path, default=REPO / "profiles" / "real.yaml", help="the profile whose settings")
    ap.add_argument("--quick", action="store_true", help="a global batch of 4 in micro-batches of 2")
    ap.add_argument("--adapter", choices=["none", "lora"], default="none", help="lora: the student adapted by LoRA")
    ap.add_argument("--teacher-dtype", choices=["auto", "fp32", "bf16"], default=None, help="default: the profile's")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args(argv)
    workspace = load_params(REPO / "params.yaml", sections=("paths",), base=REPO).paths
    models = (a.models or REPO / workspace.models_dir).resolve()
    rows = (a.teacher_rows or REPO / workspace.completions("train")).resolve()
    with tempfile.TemporaryDirectory(prefix="opd-profile-") as tmp:
        work = Path(tmp)
        params = real_params(work, a.quick, a.max_new_tokens, a.profile.resolve())
        adapter = AdapterConfig(kind="lora") if a.adapter == "lora" else AdapterConfig()
        link_inputs(work, params, models, rows)
        here = os.getcwd()
        os.chdir(work)
        try:
            ctx = init_worker("cpu", "gloo", threads=a.threads)
            try:
                for variant in a.variants:
                    line = profile_step(ctx, params, variant, a.threads, a.warmup, a.top, adapter, a.teacher_dtype)
                    print(json.dumps({"profile": a.profile.name, **line}), flush=True)
            finally:
                shutdown_worker()
        finally:
            os.chdir(here)
    return 0


if __name__ == "__main__":
    sys.exit(main())
