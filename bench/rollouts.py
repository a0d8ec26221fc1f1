"""Student rollouts in the trainer vs on an inference engine: tokens/s, and the cost of one weight sync.

Three models, saved as Hugging Face directories that every path loads:

- ``builtin_student``: the default pipeline's student (params.yaml ``models.student_arch``, the built-in
  tokenizer);
- ``real_student``: not random: the student the models stage wrote to ``paths.models_dir`` with its tokenizer
  (after ``make repro-real``, SmolLM2-135M-Instruct pruned to 15 layers, 81.4M parameters, vocabulary 49,152);
- ``llama50m``: a ~48M Llama as the issue measured (10 layers, width 512, 8 heads of 64, MLP 1376, vocabulary
  32,000, tied head), with a word-level tokenizer of exactly 32,000 ids (``w<i>`` words plus pad/EOS/unk and
  the built-in tokenizer's chat template) so that every sampled id decodes on both servers.

Paths: ``trainer_dynamic`` / ``trainer_static`` (``ars_opd.lm.generation.generate_token_ids`` in this process,
``cache="dynamic"`` / ``"static"``, one batch of B), ``bundled`` (``python -m ars_opd.serving.server
--weight-updates``, ``--max-batch-size`` ≥ B) and ``vllm`` (``.venv-vllm``, ``VLLMOptions(weight_sync=True)``,
eager, no prefix caching), both asked through ``ars_opd.rollouts.engine_api.EngineClient`` exactly as the opd
stage asks: one seeded token-id request per prompt, all B in flight. The engine and the trainer are pinned to
one core each, as on separate devices: this process (trainer, and the HTTP client) runs on core 1 with one
torch thread; each engine is started with core 0 as its only CPU (the launching thread's affinity, which the
server and every process it spawns inherit; vLLM also binds its OpenMP thread there,
``VLLM_CPU_OMP_THREADS_BIND=0``; the bundled server runs ``--threads 1``). Each line's ``engine_cpus`` /
``trainer_cpus`` is read back from ``/proc``. On a machine with fewer than two cores nothing is pinned
(``"pinned": false``).

Sampling: temperature 1, top-p 1, 32-token prompts (random ids, no EOS or pad among them), up to
``--new-tokens`` new tokens. A rollout ends at the model's EOS as it would in OPD (servers always stop at the
model's own EOS), so ``tokens_per_s`` = tokens actually sampled (the sum of the rollouts' lengths, EOS
included) / wall seconds of the whole batch; ``sampled_tokens``, ``full_length`` (rollouts that ran to
``new_tokens``) and ``lengths`` say how many. A random 32,000-word model almost never samples its EOS; the
built-in student (a vocabulary of a few hundred) sometimes does, and the trainer's batch still steps its
finished rows until the last one ends.

Lines (JSON, one per measurement):

1. ``{"kind": "rollout_throughput", "model", "path", "dtype", "batch", "new_tokens", "tokens_per_s",
   "sampled_tokens", "seconds", ...}``: the median-time run of ``--repeats`` timed batches (fresh seeds each),
   after one warm-up batch per (path, dtype) at the smallest B. bf16: the trainer's model ``.to(bfloat16)``,
   vLLM ``--dtype bfloat16``, the bundled server ``--dtype bfloat16``. The bundled server also reports how
   many ``generate`` calls the batch took and its largest batch (``server_generate_calls``, from ``/stats``).
2. ``{"kind": "sync", "model", "transport", "engine", "dtype", "bytes", "state_s", "write_s",
   "load_s", "probe_s", "total_s", ...}``: publishing one version as the opd stage does
   (``ars_opd.rollouts.schedule``): ``engine_state_dict`` (``state_s``), ``write_version`` (``write_s``),
   ``EngineClient.load_weights`` (``load_s``), then the probe (``probe_s``: the engine's ``prompt_logprobs`` of
   ``probe_ids`` + ``trainer_logprobs`` + ``check_probe``); the median of ``--repeats`` syncs after one
   warm-up, each of a freshly perturbed trainer (so the probe must see the new version). fp32 checks the
   derived bound (``probe_bound``); bf16 engines are not covered by that rounding model, so they are checked
   against ``--bf16-probe-tolerance`` (as a run states ``opd.engine.probe_tolerance``); the line carries the
   largest difference seen.
3. with ``--opd-steps N``: ``{"kind": "opd_step", "lag", "step_s", "gen_s", "sync_s", ...}`` for lag 0 and lag
   1 and ``{"kind": "opd_lag", "lag1_over_lag0", "rollout_share_lag0", "sync_share_lag0"}``: the opd stage
   itself on a ~50M built-in student with its rollouts on vLLM (``bench/opd_lag.py``);
4. ``{"kind": "summary", "vllm_over_trainer_dynamic": {"<model>/<dtype>/B<b>": ratio}, ...}``: ratios of
   tokens/s measured in this run (also bundled / trainer_dynamic, and trainer_static / trainer_dynamic where
   measured).

Each engine is started once per (model, engine, dtype) and stopped at the end of its measurements, also on
errors.

    python bench/rollouts.py                                   # everything (long: see --paths / --batches)
    python bench/rollouts.py --models llama50m --paths trainer_dynamic vllm --batches 128 --repeats 3
    python bench/rollouts.py --models real_student --batches 32 --new-tokens 48 --dtypes fp32   # after repro-real
    python bench/rollouts.py --quick                           # builtin student, B=4, 8 tokens (the test's)
    python bench/rollouts.py --opd-only --opd-steps 6          # the opd stage at lag 0 and 1 (after dvc repro)
    python bench/rollouts.py --opd-only --opd-steps 8 --opd-batch 8 --new-tokens 48 --opd-student pipeline
                                                               # the same at real size (real-smollm2 applied)
    python bench/rollouts.py --device cuda --models llama50m --paths trainer_dynamic trainer_static vllm \
        --transports filesystem nccl                           # GPUs (bench/gpu.py's engine case runs this)

On CUDA (``--device cuda``) nothing is pinned: the trainer runs on cuda:0 and a started vLLM on
``--engine-gpu`` (its ``CUDA_VISIBLE_DEVICES``; default 1 when there are two GPUs). ``--transports nccl`` adds
sync lines of transport ``nccl`` (``ars_opd.rollouts.nccl_sync``: vLLM started with
``--weight-transfer-config``); it needs two GPUs, and says ``skipped`` with the reason where it cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/rollouts.py` from anywhere runs this checkout's ars_opd
    sys.path.insert(0, str(REPO))

from ars_opd.config import EndpointConfig, TeacherServerConfig, load_params  # noqa: E402
from ars_opd.lm.generation import eos_token_ids, generate_token_ids  # noqa: E402
from ars_opd.rollouts.engine_api import EngineClient, SamplingSpec  # noqa: E402
from ars_opd.rollouts.verify import check_probe, probe_bound, probe_ids, trainer_logprobs  # noqa: E402
from ars_opd.rollouts.weights import FilesystemTransport, engine_state_dict  # noqa: E402
from ars_opd.teacher.client.endpoint import ClientSettings  # noqa: E402

MODELS = ("builtin_student", "llama50m", "real_student")
TRAINER_PATHS = ("trainer_dynamic", "trainer_static")
ENGINE_PATHS = ("bundled", "vllm")
PATHS = TRAINER_PATHS + ENGINE_PATHS
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SERVER_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
SERVED = "student"
PROMPT_TOKENS = 32
ENGINE_CPU, TRAINER_CPU = 0, 1
LLAMA50M = dict(
    vocab_size=32_000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# -- pinning ---------------------------------------------------------------------------------------------------


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and {ENGINE_CPU, TRAINER_CPU} <= os.sched_getaffinity(0)


@contextlib.contextmanager
def affinity(cpus: set[int] | None) -> Iterator[None]:
    """This thread on ``cpus`` for the duration (processes started meanwhile inherit them); None: unchanged."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpus_allowed(pid: int) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def engine_cpus() -> str:
    """The CPUs the engine processes (every descendant of this process) may run on, e.g. "0"."""
    lists = {c for pid in _descendants(os.getpid()) if (c := _cpus_allowed(pid)) is not None}
    return ",".join(sorted(lists)) or "?"


# -- models ----------------------------------------------------------------------------------------------------


def _builtin_tokenizer():
    from ars_opd.data.synthetic import instruction_words
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    return build_char_word_tokenizer(instruction_words())


def word_tokenizer(vocab: int, chat_template: str):
    """A word-level fast tokenizer of exactly ``vocab`` ids: <pad> 0, <eos> 1, <unk> 2, then w3 … w<vocab-1>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    raw = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = chat_template
    return tok


def save_model(name: str, directory: Path, seed: int = 0) -> Path:
    """A random model ``name`` (see the module docstring) with its tokenizer, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    if name == "builtin_student":
        from ars_opd.models.builtin import save_builtin_model

        return save_builtin_model(directory, load_params().models.student_arch, _builtin_tokenizer(), seed=seed)
    if name == "llama50m":
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

        tok = word_tokenizer(LLAMA50M["vocab_size"], _builtin_tokenizer().chat_template)
        torch.manual_seed(seed)
        cfg = LlamaConfig(**LLAMA50M, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
        model = LlamaForCausalLM(cfg)
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(directory)
        tok.save_pretrained(directory)
        return directory
    if name == "real_student":  # the student the models stage wrote (make repro-real: SmolLM2-135M pruned to 15 layers)
        models_dir = Path(load_params(sections=("paths",)).paths.models_dir)
        if not (models_dir / "student" / "config.json").is_file():
            raise SystemExit(f"real_student: no student in {models_dir}: run `make repro-real` first")
        shutil.copytree(models_dir / "student", directory, dirs_exist_ok=True)
        shutil.copytree(models_dir / "tokenizer", directory, dirs_exist_ok=True)
        return directory
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")


def make_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of PROMPT_TOKENS ids drawn from the tokenizer's ids, never an EOS, pad or other special."""
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


# -- engines ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def start_engine(
    path: str, model_dir: Path, dtype: str, max_batch: int, args, pin: bool, log_dir: Path
) -> Iterator[str]:
    """The engine ``path`` serving ``model_dir`` in ``dtype``, started on the engine core; yields its URL."""
    cpus = {ENGINE_CPU} if pin else None
    if path == "bundled":
        from ars_opd.serving.local_server import local_server

        server = TeacherServerConfig(max_batch_size=max_batch, max_wait_ms=args.bundled_wait_ms, threads=1)
        extra = ("--weight-updates", "--dtype", SERVER_DTYPE[dtype])
        with contextlib.ExitStack() as stack:
            with affinity(cpus):
                url = stack.enter_context(local_server(str(model_dir), server, SERVED, extra_args=extra))
            yield url
    elif path == "vllm":
        from ars_opd.serving.vllm_server import VLLMOptions, VLLMServer

        config = json.loads((model_dir / "config.json").read_text())
        kv_bytes = 2 * config["num_hidden_layers"] * config["hidden_size"] * 4 * max_batch * 256  # fp32 K and V
        from ars_opd.rollouts.engines import NCCL_ENGINE_ARGS

        opts = VLLMOptions(
            served_model_name=SERVED,
            dtype=SERVER_DTYPE[dtype],
            max_model_len=256,
            kv_cache_bytes=max(256 << 20, kv_bytes),
            cpus=str(ENGINE_CPU) if pin else None,
            weight_sync=True,
            extra_args=NCCL_ENGINE_ARGS if "nccl" in args.transports and nccl_problem(args) is None else (),
        )
        server = VLLMServer(model_dir, opts, log_path=log_dir / f"vllm-{model_dir.name}-{dtype}.log")
        try:
            with affinity(cpus), engine_gpu(args):
                server.start()
            yield server.wait_ready()
        finally:
            server.stop()
    else:
        raise ValueError(path)


def _server_stats(url: str) -> dict | None:
    root = url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{root}/stats", timeout=10) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


# -- measurements ----------------------------------------------------------------------------------------------


def _median_run(runs: list[dict]) -> dict:
    """The run with the median time (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return ordered[(len(ordered) - 1) // 2]


def trainer_batch(model, tokenizer, prompts, new_tokens: int, cache: str, eos: tuple[int, ...], seed: int) -> dict:
    t0 = time.perf_counter()
    rows = generate_token_ids(
        model,
        tokenizer,
        prompts,
        new_tokens,
        batch_size=len(prompts),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        generator_seed=seed,
        cache=cache,
        eos_ids=eos,
    )
    return {"seconds": time.perf_counter() - t0, "lengths": [len(r) for r in rows]}


def engine_batch(client: EngineClient, prompts, spec: SamplingSpec, seed: int) -> dict:
    seeds = [(seed * 1_000_003 + j) & 0x7FFFFFFF for j in range(len(prompts))]
    before = _server_stats(client.url)
    t0 = time.perf_counter()
    rollouts = client.generate(prompts, spec, seeds)
    run = {"seconds": time.perf_counter() - t0, "lengths": [len(r.token_ids) for r in rollouts]}
    after = _server_stats(client.url)
    if before is not None and after is not None and "generate_calls" in after:  # the bundled server
        run["server_generate_calls"] = after["generate_calls"] - before["generate_calls"]
        run["server_largest_batch"] = after.get("largest_batch")
    return run


def throughput_line(
    model: str, path: str, dtype: str, batch: int, new_tokens: int, runs: list[dict], cpus: dict
) -> dict:
    run = _median_run(runs)
    tokens = sum(run["lengths"])
    line = {
        "kind": "rollout_throughput",
        "model": model,
        "path": path,
        "dtype": dtype,
        "batch": batch,
        "new_tokens": new_tokens,
        "tokens_per_s": tokens / run["seconds"],
        "sampled_tokens": tokens,
        "seconds": run["seconds"],
        "repeats": len(runs),
        "all_seconds": [r["seconds"] for r in runs],
        "full_length": sum(n == new_tokens for n in run["lengths"]),
        "lengths": run["lengths"],
        **{k: v for k, v in run.items() if k.startswith("server_")},
        **cpus,
    }
    return line


def measure_trainer(model_name, path, dtype, model, tokenizer, prompts, args, eos, pin) -> list[dict]:
    cache = "dynamic" if path == "trainer_dynamic" else "static"
    cpus = {"pinned": pin, "trainer_cpus": _cpus_allowed(os.getpid()), "threads": torch.get_num_threads()}
    trainer_batch(model, tokenizer, prompts[min(args.batches)], args.new_tokens, cache, eos, seed=10**6)  # warm-up
    lines = []
    for b in args.batches:
        runs = [
            trainer_batch(model, tokenizer, prompts[b], args.new_tokens, cache, eos, seed=r)
            for r in range(args.repeats)
        ]
        lines.append(throughput_line(model_name, path, dtype, b, args.new_tokens, runs, cpus))
        emit(lines[-1])
    return lines


def measure_engine(model_name, path, dtype, client, prompts, args, eos, pin) -> list[dict]:
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, eos_ids=eos)
    cpus = {"pinned": pin, "engine_cpus": engine_cpus(), "trainer_cpus": _cpus_allowed(os.getpid())}
    engine_batch(client, prompts[min(args.batches)], spec, seed=10**6)  # warm-up
    lines = []
    for b in args.batches:
        runs = [engine_batch(client, prompts[b], spec, seed=r) for r in range(args.repeats)]
        lines.append(throughput_line(model_name, path, dtype, b, args.new_tokens, runs, cpus))
        emit(lines[-1])
    return lines


@contextlib.contextmanager
def engine_gpu(args) -> Iterator[None]:
    """On CUDA, an engine started meanwhile sees only ``--engine-gpu`` (CUDA_VISIBLE_DEVICES, inherited)."""
    if args.device != "cuda":
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = args.engine_gpu
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@torch.no_grad()
def _perturb(model, seed: int) -> None:
    """A small update of every weight, as one optimizer step would make (the probe must see it)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_((torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype).to(p.device))


def one_sync(model, client: EngineClient, version: int, dtype: str, args, transport) -> dict:
    """Publish ``model`` as ``version`` to the engine through ``transport`` (the opd stage's: a
    ``FilesystemTransport`` writes the file, then the engine loads it; an ``NcclWeightSync`` writes nothing and
    its broadcast round trip is ``load_s``) and prove the engine serves it: timed parts, probe figures."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = probe_ids(vocab, args.probe_tokens, seed=0)
    previous, _ = trainer_logprobs(model, ids, device)  # what the engine serves now
    _perturb(model, seed=version)
    t0 = time.perf_counter()
    state = engine_state_dict(model)
    t1 = time.perf_counter()
    sent = transport.publish(state, version)
    t3 = time.perf_counter()
    t2 = t3 - sent.load_s  # the end of the write (nothing written over nccl)
    engine = client.prompt_logprobs(ids)
    trainer, max_logit = trainer_logprobs(model, ids, device)
    bound = probe_bound(model.config, len(ids) - 1, max_logit, vocab) if dtype == "fp32" else args.bf16_probe_tolerance
    probe = check_probe(engine, trainer, previous, bound, client.root, version)
    t4 = time.perf_counter()
    return {
        "bytes": sent.bytes,
        "state_s": t1 - t0,
        "write_s": t2 - t1,
        "load_s": t3 - t2,
        "probe_s": t4 - t3,
        "total_s": t4 - t0,
        "probe_max_abs_diff": probe.max_abs_diff,
        "probe_bound": probe.bound,
        "probe_separation": probe.separation,
    }


def nccl_problem(args) -> str | None:
    """Why transport nccl cannot be measured here, or None."""
    if args.device != "cuda":
        return "transport nccl needs --device cuda"
    if torch.cuda.device_count() < 2:
        gpus = torch.cuda.device_count()
        return f"transport nccl needs two GPUs (the trainer's and the engine's); this machine has {gpus}"
    if args.engine_gpu == "0":
        return "transport nccl needs the engine on another GPU than the trainer's cuda:0 (--engine-gpu)"
    return None


def measure_sync(model_name, engine, dtype, model, client, args, sync_dir: Path, transport: str = "filesystem") -> dict:
    head = {"kind": "sync", "model": model_name, "transport": transport, "engine": engine, "dtype": dtype}
    sync = FilesystemTransport(client, sync_dir)
    if transport == "nccl":
        why = nccl_problem(args) if engine == "vllm" else "transport nccl is vLLM's (the bundled engine loads files)"
        if why:
            emit({**head, "skipped": why})
            return {**head, "skipped": why}
        from ars_opd.rollouts.nccl_sync import NcclWeightSync

        sync = NcclWeightSync(client, torch.device(args.device))
    try:
        one_sync(model, client, 0, dtype, args, sync)  # warm-up (first file or group, first load)
        runs = [one_sync(model, client, v, dtype, args, sync) for v in range(1, args.repeats + 1)]
    finally:
        sync.close()
    run = sorted(runs, key=lambda r: r["total_s"])[(len(runs) - 1) // 2]
    line = {
        **head,
        **run,
        "probe_max_abs_diff": max(r["probe_max_abs_diff"] for r in runs),
        "probe_tokens": args.probe_tokens,
        "repeats": len(runs),
        "all_total_s": [r["total_s"] for r in runs],
    }
    emit(line)
    return line


def summary(lines: list[dict]) -> dict:
    speed = {
        (x["model"], x["path"], x["dtype"], x["batch"]): x["tokens_per_s"]
        for x in lines
        if x.get("kind") == "rollout_throughput"
    }
    out: dict = {"kind": "summary"}
    for path in ("vllm", "bundled", "trainer_static"):
        ratios = {
            f"{m}/{d}/B{b}": tps / speed[(m, "trainer_dynamic", d, b)]
            for (m, p, d, b), tps in speed.items()
            if p == path and (m, "trainer_dynamic", d, b) in speed
        }
        if ratios:
            out[f"{path}_over_trainer_dynamic"] = ratios
    return out


def measure_opd_lag(args, pin: bool, log_dir: Path) -> list[dict]:
    """The opd stage's step at lag 0 and lag 1 on a vLLM engine (``bench/opd_lag.py``): one line per lag and
    their ratio, or one ``skipped`` line."""
    from bench import opd_lag

    params = load_params()
    why = opd_lag.problem(params)
    if why:
        emit({"kind": "opd_step", "skipped": why})
        return []
    work = Path("build") / f"opd-lag-{os.getpid()}"  # the stage's paths are relative to the repo root (ignored)
    lines = []
    try:
        student = opd_lag.student_dir(params, args.opd_student, work / "student")
        with start_engine("vllm", student.resolve(), "fp32", args.opd_batch, args, pin, log_dir) as url:
            lines = _opd_lag_runs(args, params, student, url, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lag0, lag1 = lines
    ratio = {
        "kind": "opd_lag",
        "student": args.opd_student,
        "lag1_over_lag0": lag1["step_s"] / lag0["step_s"],
        "rollout_share_lag0": lag0["gen_s"] / lag0["step_s"],
        "sync_share_lag0": lag0["sync_s"] / lag0["step_s"],
    }
    emit(ratio)
    return lines + [ratio]


def _opd_lag_runs(args, params, student: Path, url: str, work: Path) -> list[dict]:
    from ars_opd.training.opd.stage import run_opd
    from ars_opd.training.worker import TrainingJob
    from bench import opd_lag

    lines = []
    for lag in (0, 1):
        p = opd_lag.opd_params(params, student, url, SERVED, lag, args.opd_steps, args.opd_batch, args.new_tokens, work)
        t0 = time.perf_counter()
        run_opd(TrainingJob.from_params("opd", p, progress=False))
        line = {
            **opd_lag.step_line(lag, Path(p.paths.opd_checkpoints)),
            "batch": args.opd_batch,
            "new_tokens": args.new_tokens,
            "run_s": time.perf_counter() - t0,
            "engine_cpus": engine_cpus(),
            "trainer_cpus": _cpus_allowed(os.getpid()),
            "student": args.opd_student,
        }
        emit(line)
        lines.append(line)
    return lines


# -- main ------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--batches", nargs="+", type=int, default=[32, 128])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-sync", action="store_true", help="skip the sync lines")
    p.add_argument("--probe-tokens", type=int, default=32)
    p.add_argument("--bf16-probe-tolerance", type=float, default=0.25, help="probe tolerance of bf16 engines (nats)")
    p.add_argument(
        "--bundled-wait-ms",
        type=float,
        default=TeacherServerConfig.max_wait_ms,
        help="the bundled server's --max-wait-ms",
    )
    p.add_argument("--log-dir", type=Path, help="keep the engines' logs here (default: a temporary directory)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the trainer's device (and vLLM's)")
    p.add_argument(
        "--engine-gpu",
        default=None,
        help="CUDA_VISIBLE_DEVICES of a started vLLM (default: 1 with two GPUs or more, else 0)",
    )
    p.add_argument(
        "--transports",
        nargs="+",
        choices=["filesystem", "nccl"],
        default=["filesystem"],
        help="sync transports to time (nccl: CUDA, two GPUs, vLLM >= 0.32)",
    )
    p.add_argument(
        "--opd-steps",
        type=int,
        default=0,
        help="also time the opd stage on vLLM at lag 0 and lag 1 for this many steps (bench/opd_lag.py; 0: no)",
    )
    p.add_argument("--opd-batch", type=int, default=32, help="the opd stage's global batch for --opd-steps")
    p.add_argument(
        "--opd-student",
        choices=["llama50m", "pipeline"],
        default="llama50m",
        help="the student --opd-steps trains: a ~50M random Llama, or the stage's own start (paths.distill_init: "
        "on the real profile, SmolLM2 pruned to 15 layers after SFT)",
    )
    p.add_argument("--opd-only", action="store_true", help="with --opd-steps: only the OPD lag lines")
    p.add_argument(
        "--quick",
        action="store_true",
        help="builtin student, fp32, B=4, 8 new tokens, 1 repeat: trainer_dynamic, bundled, vllm if installed",
    )
    args = p.parse_args(argv)
    if args.quick:
        from ars_opd.serving.vllm_server import VLLMUnavailableError, vllm_python

        try:
            vllm_python()
            has_vllm = True
        except VLLMUnavailableError:
            has_vllm = False
        args.models, args.dtypes, args.batches, args.new_tokens, args.repeats = ["builtin_student"], ["fp32"], [4], 8, 1
        args.paths = ["trainer_dynamic", "bundled"] + (["vllm"] if has_vllm else [])
    if args.opd_only and args.opd_steps < 1:
        p.error("--opd-only needs --opd-steps N (N >= 1)")
    if min(args.batches) < 1 or args.new_tokens < 1 or args.repeats < 1:
        p.error("--batches, --new-tokens and --repeats must be >= 1")
    args.batches = sorted(set(args.batches))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no GPU")
    if args.engine_gpu is None:
        args.engine_gpu = "1" if args.device == "cuda" and torch.cuda.device_count() >= 2 else "0"
    return args


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse_args(argv)
    device = torch.device(args.device)
    pin = can_pin() and device.type == "cpu"
    if pin:
        os.sched_setaffinity(0, {TRAINER_CPU})
    torch.set_num_threads(1)
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ars-opd-bench-rollouts-") as tmp:
        log_dir = args.log_dir or Path(tmp) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for model_name in [] if args.opd_only else args.models:
            model_dir = save_model(model_name, Path(tmp) / model_name)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            prompts = {b: make_prompts(tokenizer, b, seed=b) for b in args.batches}
            for dtype in args.dtypes:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()
                eos = eos_token_ids(model, tokenizer)
                for path in args.paths:
                    if path in TRAINER_PATHS:
                        lines += measure_trainer(model_name, path, dtype, model, tokenizer, prompts, args, eos, pin)
                        continue
                    with start_engine(path, model_dir, dtype, max(args.batches), args, pin, log_dir) as url:
                        limits = EndpointConfig(
                            endpoint=url,
                            model=SERVED,
                            concurrency=max(args.batches),
                            request_timeout_s=1800.0,
                            max_attempts=1,
                        )
                        client = EngineClient(
                            url, SERVED, ClientSettings(url, limits=limits), concurrency=max(args.batches)
                        )
                        lines += measure_engine(model_name, path, dtype, client, prompts, args, eos, pin)
                        if not args.no_sync:
                            for transport in args.transports:
                                synced = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
                                synced = synced.to(device).eval()
                                sync_dir = Path(tmp) / "sync" / path
                                measure_sync(model_name, path, dtype, synced, client, args, sync_dir, transport)
        if args.opd_steps:
            lines += measure_opd_lag(args, pin, log_dir)
    emit(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
