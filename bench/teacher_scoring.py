"""OPD scoring on a served teacher vs in the trainer: agreement, scoring throughput, OPD step time (CPU).

Builds the default pipeline's teacher and student architectures (params.yaml ``models.*_arch``, random
weights, the built-in tokenizer), starts the bundled server (``ars-opd serve``) on the teacher as its own
process, and prints one JSON line per measurement:

- ``agreement``: ``max_abs_logprob_diff`` between the endpoint's ``prompt_logprobs`` and the local forward
  (``LocalTeacher``) over every scored token of ``--sequences`` sequences, for the trained tokens and for the
  top-k entries (``opd.loss: topk``);
- ``throughput``: prompt tokens scored per second through the scoring client and the bundled server, at
  each ``--concurrency``;
- ``opd_step``: the OPD step (rollouts, teacher scores, loss, backward) with the teacher local vs behind the
  endpoint, the median over ``--steps`` steps after one warm-up, and their ratio (endpoint / local).

    python bench/teacher_scoring.py
    python bench/teacher_scoring.py --server-threads 2 --trainer-threads 2 --concurrency 1 8 32

On one CPU machine the server and the trainer share the cores, so the step-time ratio says what moving the
teacher's forward into another process costs or saves here, not on separate machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ars_opd.config import EndpointConfig, OPDConfig, TeacherServerConfig, load_params
from ars_opd.data import synthetic
from ars_opd.data.prompts import alpaca_messages, encode_completions, encode_prompts
from ars_opd.lm.batching import build_rollout_batch
from ars_opd.lm.opd_objectives import get_objective
from ars_opd.models.builtin import build_causal_lm
from ars_opd.models.tokenizer import build_char_word_tokenizer
from ars_opd.serving.local_server import local_server
from ars_opd.teacher.client.endpoint import ClientSettings
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.opd.data import OPDData
from ars_opd.training.opd.task import OPDTask
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher
from ars_opd.training.worker import WorkerSetup

MODEL = "ars-opd-teacher"


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def data(tokenizer, n: int) -> tuple[list[list[int]], list[list[int]]]:
    rows = synthetic.generate(n, seed=7)
    prompts = encode_prompts(tokenizer, [alpaca_messages(r["instruction"], r["input"]) for r in rows])
    return prompts, encode_completions(tokenizer, [r["output"] for r in rows])


def endpoint(url: str, vocab: int, concurrency: int, k: int) -> EndpointTeacher:
    limits = EndpointConfig(endpoint=url, model=MODEL, concurrency=concurrency)
    return EndpointTeacher(ClientSettings(url, limits=limits), MODEL, vocab, k)


def agreement(url: str, teacher: torch.nn.Module, tokenizer, prompts, completions, k: int) -> dict:
    vocab = len(tokenizer)
    local = LocalTeacher(teacher, vocab, topk=k)
    batches = [
        build_rollout_batch(
            prompts[i : i + 16], completions[i : i + 16], tokenizer.pad_token_id, tokenizer.eos_token_id
        )
        for i in range(0, len(prompts), 16)
    ]
    worst = {"sampled_token": 0.0, "topk": 0.0}
    remote = endpoint(url, vocab, 8, k)
    tokens = 0
    for name in worst:
        objective = get_objective(name)
        cpu = [dict(b) for b in batches]
        remote.attach(cpu, objective)
        for b in cpu:
            a, e = local.score(b, objective, 1.0), remote.score(b, objective, 1.0)
            tokens += int(b["loss_mask"].sum()) if name == "topk" else 0
            if name == "sampled_token":
                worst[name] = max(worst[name], float((a.target_logprobs() - e.target_logprobs()).abs().max()))
                continue
            for r in range(a.support_ids.shape[0]):
                la = {int(i): float(v) for i, v in zip(a.support_ids[r], a.support_logprobs[r]) if v > -1e30}
                le = {int(i): float(v) for i, v in zip(e.support_ids[r], e.support_logprobs[r]) if v > -1e30}
                if set(la) != set(le):  # a tie at the k-th place may pick another token; compare the common ones
                    la = {i: v for i, v in la.items() if i in le}
                worst[name] = max(worst[name], max(abs(v - le[i]) for i, v in la.items()))
    remote.close()
    return {
        "bench": "agreement",
        "sequences": len(prompts),
        "trained_positions": tokens,
        "k": k,
        "max_abs_logprob_diff": worst["sampled_token"],
        "max_abs_topk_logprob_diff": worst["topk"],
    }


def throughput(url: str, tokenizer, prompts, completions, concurrency: int, k: int) -> dict:
    sequences = [p + c for p, c in zip(prompts, completions)]
    batch = build_rollout_batch(prompts, completions, tokenizer.pad_token_id, tokenizer.eos_token_id)
    remote = endpoint(url, len(tokenizer), concurrency, k)
    remote.attach([dict(batch)], get_objective("topk"))  # warm-up: connections, first forward
    t0 = time.perf_counter()
    remote.attach([dict(batch)], get_objective("topk"))
    seconds = time.perf_counter() - t0
    remote.close()
    tokens = int(batch["attention_mask"].sum())
    return {
        "bench": "throughput",
        "concurrency": concurrency,
        "sequences": len(sequences),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "scored_tokens_per_s": round(tokens / seconds, 1),
        "sequences_per_s": round(len(sequences) / seconds, 1),
        "k": k,
    }


def step_time(task: OPDTask, student: torch.nn.Module, steps: int) -> list[float]:
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        for mb in task.micro_batches(step, student):
            loss, _ = task.loss_sum(student, mb)
            loss.backward()
        student.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first step warms up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="OPD global batch (one worker)")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--trainer-threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.trainer_threads)
    models = load_params(Path(__file__).resolve().parents[1] / "params.yaml", sections=("models",)).models
    tokenizer = build_char_word_tokenizer(synthetic.instruction_words())
    teacher = build_causal_lm(models.teacher_arch, tokenizer, seed=0).eval()
    student = build_causal_lm(models.student_arch, tokenizer, seed=1)
    prompts, completions = data(tokenizer, a.sequences)
    with tempfile.TemporaryDirectory() as tmp:
        teacher.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        server = TeacherServerConfig(max_batch_size=64, max_wait_ms=5.0, threads=a.server_threads)
        with local_server(tmp, server, MODEL, max_logprobs=a.topk) as url:
            emit(agreement(url, teacher, tokenizer, prompts, completions, a.topk))
            for c in a.concurrency:
                emit(throughput(url, tokenizer, prompts, completions, c, a.topk))
            cfg = OPDConfig(
                loss="sampled_token",
                max_new_tokens=16,
                global_batch_size=a.batch,
                micro_batch_size=a.micro,
                steps=a.steps + 1,
                warmup_steps=0,
            )
            geometry = BatchGeometry.check(a.batch, 1, a.micro, "opd")
            ctx = WorkerContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
            setup = WorkerSetup(ctx, tokenizer, geometry, sampler_seed=0, stage_seed=0, fault=None)
            result = {
                "bench": "opd_step",
                "loss": cfg.loss,
                "global_batch": a.batch,
                "micro_batch": a.micro,
                "max_new_tokens": cfg.max_new_tokens,
                "steps": a.steps,
                "server_threads": a.server_threads,
                "trainer_threads": a.trainer_threads,
            }
            for name, scorer in (
                ("local", LocalTeacher(teacher, len(tokenizer))),
                ("endpoint", endpoint(url, len(tokenizer), 8, a.topk)),
            ):
                torch.manual_seed(0)
                task = OPDTask(OPDData(prompts, completions), scorer, cfg, setup)
                result[f"{name}_step_s"] = round(statistics.median(step_time(task, student, a.steps)), 4)
                if isinstance(scorer, EndpointTeacher):
                    scorer.close()
            result["endpoint_over_local"] = round(result["endpoint_step_s"] / result["local_step_s"], 3)
            emit(result)


if __name__ == "__main__":
    main()
