"""A real vLLM against our own path on the default teacher: greedy answers and prompt log-probabilities.

Two measurements, one JSON line each:

- ``greedy_answers``: two ``teacher_gen`` outputs of the same prompts (``--bundled``: the default pipeline's
  ``data/teacher``, answered by the bundled server; ``--vllm``: the same stage's output with
  ``teacher_gen.endpoint`` on vLLM, e.g. ``make repro-vllm``'s), compared row by row: the share of identical
  answers (text and finish_reason), and for each pair that parts, the first token where they do and the gap
  between the two tokens' logits in this process's HF forward of the teacher (prompt + the common prefix),
  with that forward's largest |logit| and length, from which the rounding bound of two fp32 forwards
  (``tests/tolerances.py``'s ``forward_bound``) is computed;
- ``scoring``: vLLM (started here from ``.venv-vllm``) scores ``--sequences`` sequences (held-out prompts +
  the teacher's own completions) through the OPD scoring client, against ``LocalTeacher`` (the same weights
  in this process): the largest |Δ log p| of the trained tokens and of the top-k entries, the largest |logit|
  and the longest sequence (the bound's inputs).

    python -m bench.vllm_agreement --bundled data/teacher --vllm /tmp/vllm-run/data/teacher
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ars_opd.artifacts import read_jsonl
from ars_opd.config import EndpointConfig
from ars_opd.data.prompts import encode_completions, encode_prompts
from ars_opd.lm.batching import build_rollout_batch
from ars_opd.lm.opd_objectives import get_objective
from ars_opd.models.loading import load_model, load_tokenizer, model_path
from ars_opd.serving.vllm_server import VLLMOptions, vllm_server
from ars_opd.teacher.client.endpoint import ClientSettings
from ars_opd.training.opd.teachers import EndpointTeacher, LocalTeacher


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _rows(directory: Path) -> dict[str, dict]:
    return {r["id"]: r for split in ("train", "eval") for r in read_jsonl(directory / f"{split}.jsonl")}


def _ids(tokenizer, row: dict) -> list[int]:
    ids = tokenizer.encode(row["completion"], add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] if row["finish_reason"] == "stop" else ids


def greedy_answers(models: str, bundled: Path, served: Path) -> dict:
    ours, theirs = _rows(bundled), _rows(served)
    common = sorted(set(ours) & set(theirs))
    same = [
        i
        for i in common
        if (ours[i]["completion"], ours[i]["finish_reason"]) == (theirs[i]["completion"], theirs[i]["finish_reason"])
    ]
    tokenizer, model = load_tokenizer(models), load_model(models, "teacher")
    parts = []
    for i in sorted(set(common) - set(same)):
        a, b = _ids(tokenizer, ours[i]), _ids(tokenizer, theirs[i])
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prompt = encode_prompts(tokenizer, [ours[i]["messages"]])[0]
        if j >= min(len(a), len(b)):
            parts.append({"id": i, "token": j, "prefix_of_the_other": True})
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + a[:j]])).logits[0, -1]
        parts.append(
            {
                "id": i,
                "token": j,
                "logit_gap": float((logits[a[j]] - logits[b[j]]).abs()),
                "max_abs_logit": float(logits.abs().max()),
                "length": len(prompt) + j + 1,
            }
        )
    return {
        "what": "greedy_answers",
        "prompts": len(common),
        "only_one_side": len(set(ours) ^ set(theirs)),
        "identical": len(same),
        "share": len(same) / len(common) if common else None,
        "parting": parts,
    }


def scoring(models: str, n: int, k: int, eval_rows: Path) -> dict:
    tokenizer = load_tokenizer(models)
    rows = read_jsonl(eval_rows)[:n]
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    completions = encode_completions(tokenizer, [r["completion"] for r in rows])
    batches = [
        build_rollout_batch(
            prompts[i : i + 16], completions[i : i + 16], tokenizer.pad_token_id, tokenizer.eos_token_id
        )
        for i in range(0, len(rows), 16)
    ]
    local = LocalTeacher(load_model(models, "teacher"), len(tokenizer), chunk_size=256, topk=k)
    worst = {"sampled_token": 0.0, "topk": 0.0}
    with vllm_server(model_path(models, "teacher"), VLLMOptions(max_logprobs=k)) as url:
        remote = EndpointTeacher(
            ClientSettings(url, limits=EndpointConfig(endpoint=url, model="teacher", concurrency=16)),
            "teacher",
            len(tokenizer),
            topk=k,
        )
        try:
            for name in worst:
                objective = get_objective(name)
                scored = [dict(b) for b in batches]
                remote.attach(scored, objective)
                for b in scored:
                    mine, theirs = local.score(b, objective, 1.0), remote.score(b, objective, 1.0)
                    if name == "sampled_token":
                        gap = (mine.target_logprobs() - theirs.target_logprobs()).abs().max()
                    else:  # the same support, aligned by id (both sorted by the teacher's top-k)
                        gap = max(
                            abs(mv - tv)
                            for r in range(mine.support_ids.shape[0])
                            for mv, tv in _aligned(mine, theirs, r)
                        )
                    worst[name] = max(worst[name], float(gap))
        finally:
            remote.close()
    with torch.no_grad():
        top = max(
            local.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.abs().max().item()
            for b in batches
        )
    return {
        "what": "scoring",
        "sequences": len(rows),
        "k": k,
        "max_abs_dlogp_sampled_token": worst["sampled_token"],
        "max_abs_dlogp_topk": worst["topk"],
        "max_abs_logit": top,
        "longest": max(b["input_ids"].shape[1] for b in batches),
    }


def _aligned(mine, theirs, r: int):
    a = {int(i): float(v) for i, v in zip(mine.support_ids[r], mine.support_logprobs[r]) if v > -1e30}
    c = {int(i): float(v) for i, v in zip(theirs.support_ids[r], theirs.support_logprobs[r]) if v > -1e30}
    if set(a) != set(c):
        raise AssertionError(f"position {r}: top-k sets differ: {sorted(a)} vs {sorted(c)}")
    return [(a[i], c[i]) for i in a]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="data/models")
    ap.add_argument("--bundled", type=Path, default=Path("data/teacher"), help="teacher_gen output, bundled server")
    ap.add_argument("--vllm", type=Path, required=True, help="teacher_gen output of the same prompts, vLLM")
    ap.add_argument("--sequences", type=int, default=200, help="held-out sequences vLLM scores")
    ap.add_argument("--k", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    emit(greedy_answers(args.models, args.bundled, args.vllm))
    emit(scoring(args.models, args.sequences, args.k, args.bundled / "eval.jsonl"))


if __name__ == "__main__":
    main()
