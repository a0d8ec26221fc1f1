"""How well a real teacher answers the natural prompts' checkable kinds, under the evaluate stage's rule.

Reads the committed prompt file as the subset stage does (``normalise_row``: the same chat messages), lets the
teacher answer greedily through the evaluate stage's own path (``encode_prompts``, ``generate_token_ids``,
``decode_completion``), scores each answer with ``ars_opd.data.natural_check.is_correct`` and prints one JSON
object: per kind n, correct and accuracy, the total, and how many tokens the answers' first sentences took
(the part the rule reads; an ``evaluate.max_new_tokens`` below that cuts right answers). ``--answers`` writes
every answer with its verdict, for reading by eye.

    python studies/natural_teacher.py --teacher /tmp/smollm2-hf --answers /tmp/natural_answers.jsonl

``--rows data/subset/eval.jsonl`` reads the subset stage's held-out split instead (its rows are normalised already),
and ``--max-examples N`` keeps its first N checkable rows: a teacher and a student scored on the same held-out
prompts (``--model`` names either), as docs/larger-teacher.md compares them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ars_opd.artifacts import read_jsonl, write_jsonl
from ars_opd.data.natural import DEFAULT_OUT
from ars_opd.data.natural_check import CHECKABLE_KINDS, first_sentence, is_correct
from ars_opd.data.normalise import normalise_row
from ars_opd.data.prompts import encode_prompts
from ars_opd.lm.generation import decode_completion, eos_token_ids, generate_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", "--model", dest="teacher", required=True, help="a local Hugging Face model directory")
    ap.add_argument("--data", default=DEFAULT_OUT)
    ap.add_argument("--rows", default=None, help="the subset stage rows (data/subset/eval.jsonl), not --data")
    ap.add_argument("--max-examples", type=int, default=0, help="the first N checkable rows (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-kind", type=int, default=0, help="a seeded sample of this many per kind (0: all)")
    ap.add_argument("--answers", default=None, help="write every answer and its verdict here (JSON Lines)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for raw in read_jsonl(args.rows or args.data):
        if args.rows:  # the subset stage wrote them normalised
            messages, reference, task = raw["messages"], raw["reference"], raw["task"]
        else:
            messages, reference, task, _ = normalise_row(raw, "auto")
        if task in CHECKABLE_KINDS and reference is not None:
            rows.append({"task": task, "messages": messages, "reference": reference})
    if args.max_examples:
        rows = rows[: args.max_examples]
    if args.per_kind:
        by_kind = defaultdict(list)
        for r in rows:
            by_kind[r["task"]].append(r)
        rng = random.Random(0)
        rows = [r for k in sorted(by_kind) for r in rng.sample(by_kind[k], min(args.per_kind, len(by_kind[k])))]
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)
    model = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    eos = eos_token_ids(model, tokenizer)
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    start = time.perf_counter()
    with torch.no_grad():
        ids = generate_token_ids(
            model, tokenizer, prompts, args.max_new_tokens, batch_size=args.batch_size, eos_ids=eos
        )
    seconds = time.perf_counter() - start
    per_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    sentence_tokens = []
    for r, g in zip(rows, ids):
        r["answer"] = decode_completion(tokenizer, g, eos)
        r["correct"] = is_correct(r["task"], r["answer"], r["reference"], r["messages"][-1]["content"])
        per_kind[r["task"]][0] += r["correct"]
        per_kind[r["task"]][1] += 1
        sentence_tokens.append(len(tokenizer(first_sentence(r["answer"]), add_special_tokens=False)["input_ids"]))
    if args.answers:
        write_jsonl(
            args.answers,
            [
                {k: r[k] for k in ("task", "reference", "correct", "answer")} | {"prompt": r["messages"][-1]["content"]}
                for r in rows
            ],
        )
    total = sum(c for c, _ in per_kind.values())
    st = sorted(sentence_tokens)
    print(
        json.dumps(
            {
                "teacher": str(Path(args.teacher)),
                "data": args.rows or args.data,
                "max_new_tokens": args.max_new_tokens,
                "examples": len(rows),
                "correct": total,
                "accuracy": round(total / len(rows), 4),
                "per_kind": {
                    k: {"n": n, "correct": c, "accuracy": round(c / n, 4)} for k, (c, n) in sorted(per_kind.items())
                },
                "first_sentence_tokens": {
                    "p50": statistics.median(st),
                    "p95": st[int(0.95 * (len(st) - 1))],
                    "max": st[-1],
                },
                "seconds": round(seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
