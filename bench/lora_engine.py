"""A LoRA student on a vLLM CPU rollout engine: ship the merged weights (what the opd stage does) or only the
adapter (vLLM's runtime LoRA loading)? ``python bench/lora_engine.py`` prints JSON lines, then a summary.

The ~48M Llama of ``bench/rollouts.py`` (fp32, vocabulary 32,000, tied embeddings) with a LoRA adapter of
rank ``--rank`` on every linear layer of its blocks (peft; ``B`` drawn at random so the adapter changes the
model), the engine on core 0 and this process on core 1 (as in ``bench/rollouts.py``). Two engines, one after
the other:

1. ``merged``: vLLM started as the opd stage starts it (our worker extension). A sync is the stage's: the
   merged state dict (``engine_state_dict``), written and loaded through ``FilesystemTransport``, then the
   probe against the trainer's forward of the adapted model.
2. ``adapter``: vLLM started with ``--enable-lora --max-lora-rank R --max-loras 1`` and
   ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``. A sync writes the adapter (peft's ``save_pretrained``), loads it
   under a new name (``/v1/load_lora_adapter``), unloads the previous one, and scores the same probe through
   the adapter.

Lines: ``{"kind": "sync", "engine", "bytes", "state_s", "write_s", "load_s", "probe_s", "total_s",
"probe_max_abs_diff", "probe_bound"}`` per sync (``--syncs`` each); ``bench/rollouts.py``'s
``{"kind": "rollout_throughput", "path" (the engine), "model" (llama50m: the base as served; llama50m+lora:
through the adapter), "batch", "tokens_per_s", ...}`` (its ``measure_engine``: the run of median time among
``--repeats``, 64 new tokens, 32-token prompts, no stop ids asked); then ``{"kind": "summary"}``
with the ratios that decide it: what a sync costs against what serving through the adapter costs per rollout
batch. Needs ``.venv-vllm`` (``make vllm``); without it one ``skipped`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ars_opd.rollouts.engine_api import EngineClient  # noqa: E402
from ars_opd.rollouts.verify import probe_bound, probe_ids, trainer_logprobs  # noqa: E402
from ars_opd.rollouts.weights import FilesystemTransport, engine_state_dict  # noqa: E402
from bench.rollouts import (  # noqa: E402
    ENGINE_CPU,
    SERVED,
    TRAINER_CPU,
    affinity,
    can_pin,
    emit,
    make_prompts,
    measure_engine,
    save_model,
)

BASE, ADAPTED = "llama50m", "llama50m+lora"  # the throughput lines' model: the base as served, or its adapter
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted_model(model_dir: Path, rank: int):
    """The Llama with a peft LoRA adapter on every block's linear layers, B drawn at random (peft starts it at 0)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    perturb_adapter(model, seed=0)
    return model.eval()


@torch.no_grad()
def perturb_adapter(model, seed: int) -> None:
    """A small change of every adapter weight, as an optimizer step would make (the probe must see it)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)


def adapter_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _probe(model, client: EngineClient, ids, previous) -> dict:
    trainer, max_logit = trainer_logprobs(model, ids, torch.device("cpu"))
    bound = probe_bound(model.config, len(ids) - 1, max_logit, model.config.vocab_size)
    engine = torch.tensor(client.prompt_logprobs(ids), dtype=torch.float64)
    diff = float((engine - trainer).abs().max())
    return {
        "probe_max_abs_diff": diff,
        "probe_bound": bound,
        "within_bound": diff <= bound,  # the stage's check (check_probe) would refuse the engine otherwise
        "probe_separation": float((trainer - previous).abs().max()),  # how far the update moved the probe
    }


def sync_merged(model, client: EngineClient, sync_dir: Path, version: int, ids) -> dict:
    previous, _ = trainer_logprobs(model, ids, torch.device("cpu"))
    perturb_adapter(model, seed=version)
    t0 = time.perf_counter()
    state = engine_state_dict(model)
    t1 = time.perf_counter()
    sent = FilesystemTransport(client, sync_dir).publish(state, version)
    t3 = time.perf_counter()
    probe = _probe(model, client, ids, previous)
    t4 = time.perf_counter()
    return {
        "kind": "sync",
        "engine": "merged",
        "version": version,
        "bytes": sent.bytes,
        "state_s": t1 - t0,
        "write_s": t3 - t1 - sent.load_s,
        "load_s": sent.load_s,
        "probe_s": t4 - t3,
        "total_s": t4 - t0,
        **probe,
    }


def lora_route(client: EngineClient, what: str, body: dict) -> str:
    """``POST /v1/{load,unload}_lora_adapter``: vLLM answers in plain text ("Success: ..."), or an error status."""
    import urllib.request

    request = urllib.request.Request(
        f"{client.root}/v1/{what}_lora_adapter", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return r.read().decode()


def sync_adapter(model, root: EngineClient, sync_dir: Path, version: int, ids) -> tuple[dict, EngineClient]:
    """Write the adapter as ``student-v<version>``, load it, unload the previous one; the client that asks it."""
    previous, _ = trainer_logprobs(model, ids, torch.device("cpu"))
    perturb_adapter(model, seed=version)
    name, old = f"{SERVED}-v{version}", f"{SERVED}-v{version - 1}"
    t0 = time.perf_counter()
    target = sync_dir / name
    tmp = sync_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # adapter_config.json and adapter_model.safetensors
    os.replace(tmp, target)
    t1 = time.perf_counter()
    lora_route(root, "load", {"lora_name": name, "lora_path": str(target)})
    if version > 1:
        lora_route(root, "unload", {"lora_name": old})
        shutil.rmtree(sync_dir / old, ignore_errors=True)
    t2 = time.perf_counter()
    client = EngineClient(root.url, name)
    probe = _probe(model, client, ids, previous)
    t3 = time.perf_counter()
    line = {
        "kind": "sync",
        "engine": "adapter",
        "version": version,
        "bytes": adapter_bytes(target),
        "state_s": 0.0,
        "write_s": t1 - t0,
        "load_s": t2 - t1,
        "probe_s": t3 - t2,
        "total_s": t3 - t0,
        **probe,
    }
    return line, client


def start(model_dir: Path, lora_rank: int | None, pin: bool, log: Path):
    from ars_opd.serving.vllm_server import VLLMOptions, VLLMServer

    extra: tuple[str, ...] = ()
    if lora_rank is not None:
        extra = ("--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1")
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    opts = VLLMOptions(
        served_model_name=SERVED,
        max_model_len=256,
        kv_cache_bytes=512 << 20,
        cpus=str(ENGINE_CPU) if pin else None,
        weight_sync=True,
        extra_args=extra,
    )
    server = VLLMServer(model_dir, opts, log_path=log)
    with affinity({ENGINE_CPU} if pin else None):
        server.start()
    server.wait_ready()
    return server


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batches", nargs="+", type=int, default=[32, 128])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--syncs", type=int, default=3)
    p.add_argument("--log-dir", type=Path)
    args = p.parse_args(argv)
    from ars_opd.serving.vllm_server import VLLMUnavailableError, vllm_python

    try:
        vllm_python()
    except VLLMUnavailableError as e:
        emit({"kind": "skipped", "why": str(e)})
        return 0
    pin = can_pin()
    torch.set_num_threads(1)
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ars-opd-lora-bench-") as tmp:
        work = Path(tmp)
        log_dir = args.log_dir or work
        log_dir.mkdir(parents=True, exist_ok=True)
        with affinity({TRAINER_CPU} if pin else None):
            model_dir = save_model("llama50m", work / "llama50m")
            model = adapted_model(model_dir, args.rank)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = {b: make_prompts(tokenizer, b, seed=b) for b in args.batches}
        ids = probe_ids(model.config.vocab_size, 32, seed=0)
        for engine in ("merged", "adapter"):
            server = start(model_dir, args.rank if engine == "adapter" else None, pin, log_dir / f"vllm-{engine}.log")
            try:
                base = EngineClient(server.url, SERVED)
                with affinity({TRAINER_CPU} if pin else None):
                    lines += measure_engine(BASE, engine, "fp32", base, prompts, args, (), pin)  # as served
                    client = base
                    for v in range(1, args.syncs + 1):
                        if engine == "merged":
                            line = sync_merged(model, base, work / "sync-merged", v, ids)
                        else:
                            line, client = sync_adapter(model, base, work / "sync-adapter", v, ids)
                        lines.append(line)
                        emit(line)
                    if engine == "adapter":
                        lines += measure_engine(ADAPTED, engine, "fp32", client, prompts, args, (), pin)
            finally:
                server.stop()
    emit(summary(lines, args))
    return 0


def summary(lines: list[dict], args) -> dict:
    syncs = {
        e: statistics.median(x["total_s"] for x in lines if x["kind"] == "sync" and x["engine"] == e)
        for e in ("merged", "adapter")
    }
    rate = {(x["path"], x["model"], x["batch"]): x["tokens_per_s"] for x in lines if x["kind"] == "rollout_throughput"}
    out = {
        "kind": "summary",
        "sync_s": syncs,
        "sync_bytes": {
            e: max(x["bytes"] for x in lines if x["kind"] == "sync" and x["engine"] == e) for e in ("merged", "adapter")
        },
    }
    for b in args.batches:
        merged, adapter = rate[("merged", BASE, b)], rate[("adapter", ADAPTED, b)]
        tokens = b * args.new_tokens
        # one on-policy step: a sync, then a rollout batch, on each path
        out[f"B{b}"] = {
            "merged_tok_per_s": merged,
            "adapter_tok_per_s": adapter,
            "lora_enabled_base_tok_per_s": rate[("adapter", BASE, b)],
            "adapter_over_merged_throughput": adapter / merged,
            "step_s_merged": syncs["merged"] + tokens / merged,
            "step_s_adapter": syncs["adapter"] + tokens / adapter,
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
