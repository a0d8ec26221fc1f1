"""Peak extra memory and time of the full-vocabulary divergence: naive autograd vs chunked.

For each (tokens, vocab) size, in a fresh process per variant: allocate student logits (with grad) and
teacher logits, then time forward + backward of reverse KL and record the peak memory above what the
inputs already held (CUDA: max_memory_allocated; CPU: the process's peak RSS). Prints one JSON line per
size: tokens, vocab, dtype, peak_bytes_naive, peak_bytes_chunked, ms_naive, ms_chunked.

    python bench/divergence_memory.py                                  # CPU: 1,024 x 32,000 fp32
    python bench/divergence_memory.py --sizes 8192x151936 --dtype bf16 # H200
Imports neither dvc, datasets nor openai.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _measure(variant: str, tokens: int, vocab: int, dtype: str, chunk: int, repeats: int) -> dict:
    import torch

    from ars_opd.lm.divergences import token_divergence, token_divergence_reference

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    student = (torch.randn(tokens, vocab, device=device, generator=g) * 2).to(dt).requires_grad_(True)
    teacher = (torch.randn(tokens, vocab, device=device, generator=g) * 2).to(dt)
    mask = torch.ones(tokens, dtype=torch.bool, device=device)

    def run():
        student.grad = None
        if variant == "naive":
            loss, _ = token_divergence_reference(student, teacher, mask, beta=1.0)
        else:
            loss, _ = token_divergence(student, teacher, mask, beta=1.0, chunk_size=chunk)
        loss.backward()

    if gpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:  # current RSS, not the high-water mark (which still holds the inputs' creation temporaries)
        base = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        if gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    peak = (torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    # the gradient of the logits (one logits-sized tensor) is part of both figures: autograd must return it
    return {"peak_bytes": int(peak), "ms": round(statistics.median(times), 2),
            "device": torch.cuda.get_device_name() if gpu else "cpu"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["1024x32000", "2048x32000"])
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._one:
        variant, tokens, vocab = a._one
        print(json.dumps(_measure(variant, int(tokens), int(vocab), a.dtype, a.chunk, a.repeats)))
        return
    for size in a.sizes:
        tokens, vocab = (int(x) for x in size.split("x"))
        out = {"tokens": tokens, "vocab": vocab, "dtype": a.dtype, "chunk": a.chunk}
        for variant in ("naive", "chunked"):
            r = subprocess.run([sys.executable, __file__, "--dtype", a.dtype, "--chunk", str(a.chunk), "--repeats",
                                str(a.repeats), "--_one", variant, str(tokens), str(vocab)],
                               capture_output=True, text=True, check=True)
            m = json.loads(r.stdout.strip().splitlines()[-1])
            out.update({f"peak_bytes_{variant}": m["peak_bytes"], f"ms_{variant}": m["ms"], "device": m["device"]})
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
