"""The GPU path in one command: SFT tokens/s and MFU, static-cache rollouts, the OPD step, and peak memory.

    python -m bench.gpu                       # CUDA: Qwen3-0.6B-shaped student (Qwen3-1.7B-shaped teacher)
    python -m bench.gpu --device cpu --tiny   # the same code paths on tiny shapes, in seconds (CI smoke test)
    python -m bench.gpu --device cpu --tiny --compile on --attention flex   # ... compiled, as on CUDA (minutes)

Run from the repository root: ``-m`` puts the checkout on the path, so a machine needs nothing installed but
torch and transformers (not even this package).

Every workload runs the pipeline's own code: packing (``ars_opd.lm.batching``), the packed attention
(``ars_opd.lm.attention``: flash varlen where installed, else FlexAttention on CUDA, else per-sequence SDPA),
losses from hidden states (``ars_opd.lm.head``, ``ars_opd.lm.cross_entropy``, the objectives registry), the frozen
teacher (``ars_opd.training.opd.teachers.LocalTeacher``, bf16 on CUDA) and the static-cache decode loop
(``ars_opd.lm.decoding``); models are built from config with random weights (no download). Precision is the
pipeline's on CUDA: fp32 master weights under bf16 autocast for the student, bf16 weights for the teacher.
On CUDA each decoder layer is compiled (``torch.compile``) for SFT and the OPD step, and the decode step with
CUDA graphs. One JSON line per workload:

- ``sft``: packed rows of ``pack_length`` tokens from an alpaca-like length mix (log-uniform 64–1024 tokens,
  prompt 20–60% of each), loss on completions, AdamW + clipping; tokens_per_s counts real (non-padding)
  tokens; mfu = model FLOPs per second / the device's dense bf16 peak, with model FLOPs = 6 × (the layers'
  matrix parameters + the head's V·H) per token + 6 × layers × n_heads·head_dim × n² per sequence of n
  tokens (causal attention, forward and backward);
- ``sft_fsdp`` and ``sft_lora``: the same SFT step with the student sharded by FSDP2 (a world of one on this
  device: FSDP's own cost, its bf16 compute / fp32 reduce policy on CUDA; the per-worker memory saving needs
  more devices and is measured by ``bench/scale.py``), and with a LoRA adapter (r = 16, every linear layer of
  the blocks; needs peft, and says ``skipped`` where it is not installed). Not compiled. Each also reports
  ``state_bytes``: weights + gradients + AdamW state, counted exactly from the tensors;
- ``rollout``: B = 256 prompts of 128 tokens, 256 new tokens each (sampled at temperature 1, no early
  stop): generated tokens per second;
- ``opd_step``: one OPD step on 16 × 512 tokens (loss on the last 384 of each row): student forward to
  hidden states, teacher scoring, full-vocabulary reverse KL, backward, optimiser step; step_ms and the
  step's peak memory above what existed before it;
- ``engine``: student rollouts on vLLM CUDA against the trainer's generate (dynamic and static), B = 32 and
  128, fp32 and bf16, on a ~48M Llama, and the weight sync by transport (filesystem; nccl with two GPUs):
  ``bench/rollouts.py --device cuda``, run as a child process and relayed. It needs the pipeline's
  environment and a vLLM one (``$ARS_OPD_VLLM_PYTHON``); otherwise one line says ``skipped`` and why;
- ``opd_loss``: the loss alone at 8,192 tokens × V from given hidden states, through the pipeline's
  ``full_vocab`` objective: chunked (``chunk`` positions at a time) vs naive (all positions in one chunk, so
  both models' (tokens × V) logits and the loss's fp32 temporaries exist at once, as on a logits path): extra
  peak memory above the inputs, and time.

Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the running sum of torch.profiler's
allocation events (as ``bench/loss_memory.py``). Imports only torch, transformers and ars_opd (its lm,
training and config modules), never dvc, datasets, openai, aiohttp or pandas: the GPU machine has torch and
transformers only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import traceback

import torch

from ars_opd.config import OPDConfig, SFTConfig
from ars_opd.lm.attention import packed_model_inputs, use_packed_attention
from ars_opd.lm.batching import pack_sequences
from ars_opd.lm.cross_entropy import causal_lm_loss_from_hidden
from ars_opd.lm.decoding import generate_static
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import TeacherLogits, TeacherScores, get_objective
from ars_opd.lm.optim import autocast_context, clip_gradients, make_optimizer
from ars_opd.training.opd.teachers import LocalTeacher

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
SHAPES = {  # Qwen3 configurations (hidden, intermediate, layers, heads, kv heads, head_dim)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128),
    "tiny-student": (64, 128, 2, 4, 2, 16),
    "tiny-teacher": (96, 192, 2, 4, 2, 24),
}


def build(shape: str, vocab: int, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    hidden, inter, layers, heads, kv, head_dim = SHAPES[shape]
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)


def compile_layers(model: torch.nn.Module) -> None:
    for layer in model.get_decoder().layers:  # per block: the loss, hooks and mask building stay eager
        layer.compile()


def model_flops(model: torch.nn.Module, lengths: list[int]) -> float:
    """Training FLOPs (forward + backward) of sequences of these lengths (see the module docstring)."""
    cfg = model.config
    matrix = sum(p.numel() for n, p in model.get_decoder().layers.named_parameters() if p.dim() == 2)
    head = cfg.vocab_size * cfg.hidden_size
    attn = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return sum(6 * (matrix + head) * n + attn * n * n for n in lengths)


class Memory:
    """Peak memory of a block above what was allocated when it started (CUDA allocator or profiler events)."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self.prof.__exit__(*exc)
        events = sorted(
            (e for e in self.prof.profiler.kineto_results.events() if e.name() == "[memory]"),
            key=lambda e: e.start_ns(),
        )
        live = 0
        for e in events:
            live += e.nbytes()
            self.peak = max(self.peak, live)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def alpaca_like(n: int, lo: int, hi: int, vocab: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(n):
        total = int(round(lo * (hi / lo) ** rng.random()))
        p = max(2, int(total * rng.uniform(0.2, 0.6)))
        out.append(([rng.randrange(2, vocab) for _ in range(p)], [rng.randrange(2, vocab) for _ in range(total - p)]))
    return out


def fill_rows(seqs, rows: int, pack_length: int):
    """The longest prefix of ``seqs`` that packs (in order, as pack_sequences does) into ``rows`` rows."""
    used, r = 0, 1
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        if used + n > pack_length:
            r, used = r + 1, 0
            if r > rows:
                return seqs[:i], seqs[i:]
        used += n
    return seqs, []


def _state_bytes(model, opt) -> int:
    """Weights (this process's storage) + gradients (one per trainable element) + optimizer state, exactly."""
    params = list({id(p): p for p in model.parameters()}.values())  # a tied head once
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    weights = sum(t.numel() * t.element_size() for t in local)
    grads = sum(t.numel() * t.element_size() for t, p in zip(local, params) if p.requires_grad)
    state = [
        v.to_local() if hasattr(v, "to_local") else v
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    return weights + grads + sum(t.numel() * t.element_size() for t in state)


def _world_of_one(device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )


def bench_sft(a, device, vocab, shape, variant: str = "plain") -> dict:
    cfg = SFTConfig(
        steps=1,
        warmup_steps=0,
        global_batch_size=1,
        micro_batch_size=1,
        precision="auto",
        max_grad_norm=1.0,
        packing=True,
        pack_length=a.pack_length,
        max_seq_len=a.pack_length,
        chunk_size=a.chunk,
    )
    name = "sft" if variant == "plain" else f"sft_{variant}"
    model = build(shape, vocab, device, torch.float32, seed=0).train()
    attention = use_packed_attention(model, a.attention)
    if variant == "lora":
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            return {"bench": name, "skipped": "peft is not installed here"}
        from ars_opd.config import LORA_TARGETS, AdapterConfig
        from ars_opd.models.adapters import attach

        model = attach(model, AdapterConfig(kind="lora", r=16, alpha=32.0, target_modules=LORA_TARGETS))
    elif variant == "fsdp":
        from ars_opd.training.sharding import shard_model

        _world_of_one(device)
        model = shard_model(model, device, bf16=device.type == "cuda")
    compiled = a.compile and variant == "plain"
    if compiled:
        compile_layers(model)
    opt = make_optimizer(model, cfg)
    rng = random.Random(0)
    pool = alpaca_like(40 * a.rows * a.pack_length // 300, a.lengths[0], a.lengths[1], vocab, rng)
    real = padded = 0
    flops, elapsed, memory = 0.0, 0.0, Memory(device)

    def next_batch():
        nonlocal pool
        batch, pool = fill_rows(pool, a.rows, a.pack_length)
        if not pool:
            pool = alpaca_like(40 * a.rows * a.pack_length // 300, a.lengths[0], a.lengths[1], vocab, rng)
        t = pack_sequences([p for p, _ in batch], [c for _, c in batch], a.pack_length, 0, full_rows=True)
        return [len(p) + len(c) for p, c in batch], {k: v.to(device) for k, v in t.items()}

    def step(t):
        with autocast_context("auto", device):
            hidden = last_hidden_states(model, **packed_model_inputs(t))
            loss, n = causal_lm_loss_from_hidden(hidden, OutputHead.of(model, vocab), t["labels"], a.chunk)
        (loss / n).backward()
        clip_gradients([p for p in model.parameters() if p.grad is not None], cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(a.warmup + a.steps):
        lengths, t = next_batch()
        _sync(device)
        t0 = time.perf_counter()
        step(t)
        _sync(device)
        if i >= a.warmup:  # warm-up steps (compilation, allocator) not counted
            elapsed += time.perf_counter() - t0
            real += sum(lengths)
            padded += t["input_ids"].numel()
            flops += model_flops(model, lengths)
    with memory:  # one more step, untimed: the profiler (CPU) would slow it down
        step(next_batch()[1])
    peak = next(
        (v for k, v in PEAK_BF16_FLOPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name()), None
    )
    return {
        "bench": name,
        "model": shape,
        "attention": attention,
        "compiled": compiled,
        "rows": a.rows,
        "pack_length": a.pack_length,
        "lengths": a.lengths,
        "tokens_per_s": round(real / elapsed, 1),
        "mfu": round(flops / elapsed / peak, 4) if peak else None,
        "padding_fraction": round(1 - real / padded, 4),
        "peak_bytes": memory.peak,
        "state_bytes": _state_bytes(model, opt),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def bench_rollout(a, device, vocab, shape) -> dict:
    model = build(shape, vocab, device, torch.float32, seed=0).eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(2, vocab) for _ in range(a.prompt_tokens)] for _ in range(a.rollout_batch)]
    with autocast_context("auto", device):  # the pipeline's rollouts: training precision
        for _ in range(a.warmup_rollouts):  # compiles (and records the CUDA graphs of) the decode step
            generate_static(model, prompts, 0, None, a.new_tokens, do_sample=True, compile=a.compile)
        times = []
        for _ in range(a.repeats):
            _sync(device)
            t0 = time.perf_counter()
            out = generate_static(model, prompts, 0, None, a.new_tokens, do_sample=True, compile=a.compile)
            _sync(device)
            times.append(time.perf_counter() - t0)
    generated = sum(len(r) for r in out)
    return {
        "bench": "rollout",
        "model": shape,
        "batch": a.rollout_batch,
        "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new_tokens,
        "cache": "static",
        "compiled": a.compile,
        "tokens_per_s": round(generated / statistics.median(times), 1),
    }


def bench_opd(a, device, vocab, student_shape, teacher_shape) -> list[dict]:
    cfg = OPDConfig(
        steps=1, warmup_steps=0, global_batch_size=1, micro_batch_size=1, chunk_size=a.chunk, precision="auto"
    )
    student = build(student_shape, vocab, device, torch.float32, seed=0).train()
    teacher = build(teacher_shape, vocab, device, torch.bfloat16 if device.type == "cuda" else torch.float32, seed=1)
    if a.compile:
        compile_layers(student)
        compile_layers(teacher)
    local = LocalTeacher(teacher, vocab, a.chunk)
    objective = get_objective("full_vocab")
    opt = make_optimizer(student, cfg)
    B, T = a.opd_batch, a.opd_seq
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, vocab, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, T // 4 - 1 : T - 1] = True  # completions: the last three quarters of each row
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]
    targets[~mask] = -100
    t = {
        k: v.to(device)
        for k, v in {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": mask,
            "targets": targets,
        }.items()
    }

    def step():
        with autocast_context("auto", device):
            hidden = select_rows(last_hidden_states(student, t["input_ids"], t["attention_mask"]), t["loss_mask"])
            scores = local.score(t, objective, 1.0)
            loss, n = objective.loss(
                hidden, OutputHead.of(student, vocab), scores, t["targets"][t["loss_mask"]], 1.0, 1.0, a.chunk
            )
        (loss / n).backward()
        clip_gradients([p for p in student.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    memory = Memory(device)
    with memory:
        step()
    times = []
    for _ in range(a.repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    out = [
        {
            "bench": "opd_step",
            "student": student_shape,
            "teacher": teacher_shape,
            "tokens": B * T,
            "loss_tokens": int(mask.sum()),
            "vocab": vocab,
            "compiled": a.compile,
            "step_ms": round(statistics.median(times) * 1000, 1),
            "peak_bytes": memory.peak,
        }
    ]
    opt.state.clear()  # frees the Adam moments before the loss bench
    out.append(bench_opd_loss(a, device, vocab, student, teacher))
    return out


def bench_opd_loss(a, device, vocab, student, teacher) -> dict:
    """The loss alone from given hidden states: chunked (the pipeline) vs naive (one chunk of all M rows: every
    position's logits materialised at once)."""
    M = a.loss_tokens
    g = torch.Generator(device=device).manual_seed(3)
    s_head, t_head = OutputHead.of(student, vocab), OutputHead.of(teacher, vocab)
    hs = torch.randn(M, s_head.weight.shape[1], device=device, generator=g)
    ht = torch.randn(M, t_head.weight.shape[1], device=device, generator=g, dtype=t_head.weight.dtype)
    targets = torch.randint(0, vocab, (M,), device=device, generator=g)
    objective = get_objective("full_vocab")
    result = {"bench": "opd_loss", "tokens": M, "vocab": vocab}
    for variant, chunk in (("naive", M), ("chunked", a.chunk)):

        def run(chunk=chunk):
            student.zero_grad(set_to_none=True)
            h = hs.detach().requires_grad_(True)
            with autocast_context("auto", device):
                scores = TeacherScores(logits=TeacherLogits(ht, t_head, targets))
                loss, _ = objective.loss(h, s_head, scores, targets, 1.0, 1.0, chunk)
            loss.backward()

        run()
        memory = Memory(device)
        with memory:
            run()
        times = []
        for _ in range(a.repeats):
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            times.append(time.perf_counter() - t0)
        result[f"extra_bytes_{variant}"] = memory.peak
        result[f"ms_{variant}"] = round(statistics.median(times) * 1000, 2)
    student.zero_grad(set_to_none=True)
    return result


def bench_engine(a, device) -> list[dict]:
    """Rollouts on vLLM CUDA against the trainer's generate, and the weight sync over the filesystem and over
    NCCL: ``bench/rollouts.py --device cuda`` on the ~48M Llama, run as a child process (it needs the
    pipeline's environment, aiohttp, and a vLLM environment: ``$ARS_OPD_VLLM_PYTHON`` or ``.venv-vllm``), its
    lines relayed. One line saying ``skipped`` and why where those are missing."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    why = None
    if device.type != "cuda":
        why = "the engine cases measure vLLM on CUDA; on CPU, bench/rollouts.py measures the same paths"
    elif importlib.util.find_spec("aiohttp") is None:
        why = "the engine client needs the pipeline's environment (aiohttp is not installed)"
    else:
        from ars_opd.serving.vllm_server import VLLMUnavailableError, vllm_python

        try:
            vllm_python()  # what bench/rollouts.py's engine will run on
        except VLLMUnavailableError as e:
            why = f"{e} (vLLM >= 0.32)"
    if why:
        return [{"bench": "engine", "skipped": why}]
    cmd = [sys.executable, str(repo / "bench" / "rollouts.py"), "--device", "cuda", "--models", "llama50m"]
    cmd += ["--paths", "trainer_dynamic", "trainer_static", "vllm", "--batches", "32", "128"]
    cmd += ["--dtypes", "fp32", "bf16", "--transports", "filesystem", "nccl", "--repeats", str(a.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0:
        raise RuntimeError(f"bench/rollouts.py exited {out.returncode}: {out.stderr[-1500:]}")
    return [{"bench": "engine", **line} for line in lines]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and sizes: the same code paths in seconds")
    names = ["sft", "sft_fsdp", "sft_lora", "rollout", "opd", "engine"]
    p.add_argument("--only", nargs="+", choices=names, default=names)
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on CUDA only")
    p.add_argument(
        "--attention",
        choices=["auto", "flash", "flex", "sdpa"],
        default="auto",
        help="packed attention for SFT (as sft.packed_attention)",
    )
    a = p.parse_args()
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available()) else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    a.compile = device.type == "cuda" if a.compile == "auto" else a.compile == "on"
    if a.tiny:
        vocab, student, teacher = 1000, "tiny-student", "tiny-teacher"
        a.rows, a.pack_length, a.lengths, a.steps, a.warmup, a.chunk = 2, 256, (16, 128), 2, 1, 64
        a.rollout_batch, a.prompt_tokens, a.new_tokens, a.warmup_rollouts, a.repeats = 8, 16, 16, 1, 2
        a.opd_batch, a.opd_seq, a.loss_tokens = 4, 64, 256
    else:
        vocab, student, teacher = 151936, "qwen3-0.6b", "qwen3-1.7b"
        a.rows, a.pack_length, a.lengths, a.steps, a.warmup, a.chunk = 8, 4096, (64, 1024), 10, 3, 256
        a.rollout_batch, a.prompt_tokens, a.new_tokens, a.warmup_rollouts, a.repeats = 256, 128, 256, 2, 3
        a.opd_batch, a.opd_seq, a.loss_tokens = 16, 512, 8192
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    info = {"device": dev, "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    workloads = {
        "sft": lambda: [bench_sft(a, device, vocab, student)],
        "sft_fsdp": lambda: [bench_sft(a, device, vocab, student, "fsdp")],
        "sft_lora": lambda: [bench_sft(a, device, vocab, student, "lora")],
        "rollout": lambda: [bench_rollout(a, device, vocab, student)],
        "opd": lambda: bench_opd(a, device, vocab, student, teacher),
        "engine": lambda: bench_engine(a, device),
    }
    failed = []
    for name in a.only:  # one failing workload (e.g. a compiler error) must not cost the others' figures
        try:
            for line in workloads[name]():
                print(json.dumps({**line, **info}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported as a JSON line, and in the exit status
            failed.append(name)
            print(json.dumps({"bench": name, "error": f"{type(e).__name__}: {str(e)[:2000]}", **info}), flush=True)
            traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
