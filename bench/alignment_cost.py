"""What cross-tokenizer OPD's alignment costs on the CPU: ``CrossTokenizer.align`` per completion, by length.

For each pair of tokenizers (the student's and the teacher's: SmolLM2's BPE from the real profile's models and the
built-in character tokenizer, both ways) and each completion length N (student tokens), the time to render the text,
tokenise it for the teacher and align the two (``ars_opd.lm.token_alignment``), the median of ``--repeats`` passes
over ``--rows`` completions. Completions are the student tokenizer's encoding of random text (lowercase words of
2-8 letters, numbers, some punctuation; cut to N tokens), with its EOS: text the two tokenizers split very
differently. Prints one JSON line per (pair, N):
``{"kind": "alignment_cost", "student", "teacher", "tokens", "ms_per_row", "teacher_tokens_per_row", "spans_per_row"}``.

    python bench/alignment_cost.py                      # after make repro-real (SmolLM2's tokenizer in data/models)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transformers import AutoTokenizer  # noqa: E402

from ars_opd.data import synthetic  # noqa: E402
from ars_opd.lm.token_alignment import CrossTokenizer, teacher_end_id  # noqa: E402
from ars_opd.models.tokenizer import build_char_word_tokenizer  # noqa: E402


def completions(tok, n_tokens: int, rows: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(rows):  # random lowercase words of 2-8 letters, numbers and punctuation
        words = [
            "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
            if rng.random() < 0.8
            else str(rng.randint(0, 999))
            for _ in range(4 * n_tokens)
        ]
        text = " ".join(w + (rng.choice(",.") if rng.random() < 0.1 else "") for w in words)
        ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
        out.append(ids + [tok.eos_token_id])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bpe", type=Path, default=REPO / "data" / "models" / "tokenizer", help="a BPE tokenizer dir")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    bpe = AutoTokenizer.from_pretrained(str(a.bpe))
    char = build_char_word_tokenizer(synthetic.instruction_words())
    for s_name, student, t_name, teacher in (("bpe", bpe, "char", char), ("char", char, "bpe", bpe)):
        cross = CrossTokenizer(student, teacher, [student.eos_token_id], teacher_end_id(teacher))
        for n in a.tokens:
            rows = completions(student, n, a.rows, seed=n)
            times, aligned = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                aligned = [cross.align(r) for r in rows]
                times.append(time.perf_counter() - t0)
            line = {
                "kind": "alignment_cost",
                "student": s_name,
                "teacher": t_name,
                "tokens": n,
                "rows": a.rows,
                "ms_per_row": round(1000 * statistics.median(times) / a.rows, 3),
                "teacher_tokens_per_row": statistics.mean(len(r.teacher_ids) for r in aligned),
                "spans_per_row": statistics.mean(r.alignment.n_spans for r in aligned),
                "unaligned_per_row": statistics.mean(r.alignment.unaligned_student for r in aligned),
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
