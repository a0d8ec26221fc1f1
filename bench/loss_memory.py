"""Extra peak memory and time of one SFT step and one OPD step: losses from hidden states (chunked) vs logits.

Each step is forward + loss + backward of a Qwen3-shaped student (hidden 256, one layer, tied embeddings) at
a real vocabulary (V = 151,936 by default) on 16 × 512 tokens; the OPD step adds a no-grad teacher of the
same width (two layers) and reverse KL over the full vocabulary. Variants:

- ``naive``: every position's logits at once. SFT: ``model(...).logits`` (B, T, V), then
  ``causal_lm_token_loss_sum``; OPD: the ``full_vocab`` objective and the teacher's scores with all M scored
  positions in one chunk, so (M × V) logits of the student and of the teacher exist together;
- ``chunked``: the current one: last hidden states, then ``causal_lm_loss_from_hidden`` (SFT) or
  ``LocalTeacher.score`` + the ``full_vocab`` objective (OPD), one chunk of positions at a time.

Extra peak = the highest memory the step holds above what existed before it (weights and inputs; parameter
gradients, which both variants create, count as extra). On CUDA from ``torch.cuda.max_memory_allocated``.
On CPU, where torch keeps no allocator statistics, the step runs once under ``torch.profiler`` with
``profile_memory=True``: every allocation and free of torch's CPU allocator, on every thread (the backward's
included), is recorded with its size, and the peak of their running sum is the extra peak. Allocator caching,
fragmentation and the process's baseline (which hid the difference in RSS-based figures) do not enter. Each
(step, variant) is measured in a fresh process, one at a time, after a warm-up step. Time: the median of
``--repeats`` unprofiled steps per variant, the two variants alternating in one more process (the machine's
load then weighs on both alike), after a warm-up step each. The naive variant needs several (tokens × V × 4)-
byte tensors, so the parent first checks that the machine has the memory (``MemAvailable``) and, if not,
reports it as not run (with the need) instead of swapping or being killed.

    python bench/loss_memory.py                          # CPU: V = 151,936, 16 x 512, fp32
    python bench/loss_memory.py --batch 4                # a machine with under ~20 GB free
    python bench/loss_memory.py --batch 16 --seq 512     # CUDA (bf16 autocast, bf16 teacher), same command

Prints one JSON line per step: step, vocab, tokens, extra_bytes_naive, extra_bytes_chunked, ms_naive,
ms_chunked, and the ratios. Imports neither dvc, datasets nor openai.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _models(vocab: int, hidden: int, step: str, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    def build(layers: int, seed: int, dtype):
        cfg = Qwen3Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=3 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)

    student = build(1, 0, torch.float32).train()
    teacher = None
    if step == "opd":
        teacher_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        teacher = build(2, 1, teacher_dtype).eval().requires_grad_(False)
    return student, teacher


def _batch(batch: int, seq: int, vocab: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    prompt = int(seq * 0.4)  # loss on the last 60% of every row, as a completion after its prompt
    labels = ids.clone()
    labels[:, :prompt] = -100
    loss_mask = torch.zeros(batch, seq, dtype=torch.bool)
    loss_mask[:, prompt - 1 : seq - 1] = True
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    targets[~loss_mask] = -100
    t = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
        "loss_mask": loss_mask,
        "targets": targets,
    }
    return {k: v.to(device) for k, v in t.items()}


def _step_fn(step: str, variant: str, student, teacher, t: dict, vocab: int, chunk: int):
    import torch

    from ars_opd.lm.cross_entropy import causal_lm_loss_from_hidden, causal_lm_token_loss_sum
    from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
    from ars_opd.lm.opd_objectives import get_objective
    from ars_opd.training.opd.teachers import LocalTeacher

    local_teacher = LocalTeacher(teacher, vocab, chunk) if teacher is not None else None
    objective = get_objective("full_vocab")

    def sft_naive():
        logits = student(input_ids=t["input_ids"], attention_mask=t["attention_mask"]).logits  # (B, T, V)
        return causal_lm_token_loss_sum(logits, t["labels"])[0]

    def sft_chunked():
        hidden = last_hidden_states(student, t["input_ids"], t["attention_mask"])
        return causal_lm_loss_from_hidden(hidden, OutputHead.of(student, vocab), t["labels"], chunk)[0]

    def opd_naive():  # the same objective with every scored position in one chunk: (M x V) at once
        mask = t["loss_mask"]
        rows = int(mask.sum())
        hidden = select_rows(last_hidden_states(student, t["input_ids"], t["attention_mask"]), mask)
        scores = LocalTeacher(teacher, vocab, rows).score(t, objective, 1.0)
        loss, _ = objective.loss(hidden, OutputHead.of(student, vocab), scores, t["targets"][mask], 1.0, 1.0, rows)
        scores.target_logprobs().sum().item()
        return loss

    def opd_chunked():
        mask = t["loss_mask"]
        hidden = select_rows(last_hidden_states(student, t["input_ids"], t["attention_mask"]), mask)
        scores = local_teacher.score(t, objective, 1.0)
        loss, _ = objective.loss(hidden, OutputHead.of(student, vocab), scores, t["targets"][mask], 1.0, 1.0, chunk)
        scores.target_logprobs().sum().item()  # the logged teacher log-probability, as the task reads it
        return loss

    fn = {
        ("sft", "naive"): sft_naive,
        ("sft", "chunked"): sft_chunked,
        ("opd", "naive"): opd_naive,
        ("opd", "chunked"): opd_chunked,
    }[(step, variant)]

    def run():
        for p in student.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=t["input_ids"].is_cuda):
            loss = fn()
        loss.backward()
        for p in student.parameters():  # the step's gradients are its output: freed only after the peak is read
            assert p.grad is not None
        return float(loss)

    return run


def cpu_extra_peak(run) -> int:
    """Peak of the running sum of every CPU allocation and free recorded while ``run`` executes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return profiled_peak(prof)


def profiled_peak(prof) -> int:
    """The peak of the running sum of the allocations and frees a finished ``torch.profiler.profile`` (started with
    ``profile_memory=True``) recorded: for code that cannot be wrapped in one call (a step inside another
    library's loop, started and stopped from its callbacks)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _setup(step: str, batch: int, seq: int, vocab: int, hidden: int):
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    student, teacher = _models(vocab, hidden, step, device)
    return device, student, teacher, _batch(batch, seq, vocab, device)


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


def measure_memory(step: str, variant: str, batch: int, seq: int, vocab: int, hidden: int, chunk: int) -> dict:
    """Extra peak of one step of ``variant`` (after a warm-up step), in this fresh process."""
    import torch

    device, student, teacher, t = _setup(step, batch, seq, vocab, hidden)
    run = _step_fn(step, variant, student, teacher, t, vocab, chunk)
    run()  # warm-up (allocator, kernels)
    for p in student.parameters():
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = run()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    else:
        loss = None
        extra = cpu_extra_peak(run)
    return {
        "extra_bytes": int(extra),
        "loss": loss,
        "device": _device_name(device),
        "method": "cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler allocation events",
    }


def measure_time(
    step: str, variants: list[str], batch: int, seq: int, vocab: int, hidden: int, chunk: int, repeats: int
) -> dict:
    """Median ms per step of each variant, the variants alternating (one warm-up each), in this process."""
    import torch

    device, student, teacher, t = _setup(step, batch, seq, vocab, hidden)
    runs = {v: _step_fn(step, v, student, teacher, t, vocab, chunk) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses = {v: runs[v]() for v in variants}
    for _ in range(repeats):
        for v in variants:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runs[v]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[v].append((time.perf_counter() - t0) * 1000)
    return {v: {"ms": round(statistics.median(times[v]), 1), "loss": losses[v]} for v in variants}


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", nargs="+", choices=["sft", "opd"], default=["sft", "opd"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--_memory", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_time", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args()
    shape = (a.batch, a.seq, a.vocab, a.hidden, a.chunk)
    if a._memory:
        print(json.dumps(measure_memory(*a._memory, *shape)))
        return
    if a._time:
        print(json.dumps(measure_time(a._time[0], a._time[1:], *shape, a.repeats)))
        return
    tokens = a.batch * a.seq
    common = [
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--vocab",
        str(a.vocab),
        "--hidden",
        str(a.hidden),
        "--chunk",
        str(a.chunk),
        "--repeats",
        str(a.repeats),
    ]

    def child(*args) -> dict:
        r = subprocess.run([sys.executable, __file__, *common, *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    for step in a.steps:
        out = {"step": step, "vocab": a.vocab, "tokens": tokens, "hidden": a.hidden, "chunk": a.chunk}
        # the naive step's peak grows by fp32 (tokens x V) tensors: about three for SFT (measured: 1.85 MB per
        # token at V = 151,936), about two for OPD's single chunk (measured: 1.98 at 2,048 tokens), on top of
        # about a GiB of weights, inputs and gradients
        need = {"sft": 3.2, "opd": 2.2}[step] * tokens * a.vocab * 4 + 2**30
        free = _mem_available()
        variants = ["naive", "chunked"]
        if free is not None and need > 0.85 * free:
            variants = ["chunked"]
            out.update(
                {
                    "extra_bytes_naive": None,
                    "ms_naive": None,
                    "note_naive": f"not run: needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB "
                    "available (rerun with a smaller --batch)",
                }
            )
        for variant in variants:
            m = child("--_memory", step, variant)
            out.update({f"extra_bytes_{variant}": m["extra_bytes"], "device": m["device"], "method": m["method"]})
        timed = child("--_time", step, *variants)
        for variant in variants:
            out.update({f"ms_{variant}": timed[variant]["ms"], f"loss_{variant}": round(timed[variant]["loss"], 4)})
        if out["extra_bytes_naive"]:
            out["extra_ratio"] = round(out["extra_bytes_chunked"] / out["extra_bytes_naive"], 4)
            out["time_ratio"] = round(out["ms_chunked"] / out["ms_naive"], 3)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
