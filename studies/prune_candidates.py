"""Which teacher layers should a depth-pruned student keep? Candidates compared by the pruned start's distance
to the teacher on held-out prompts.

Run after the real profile's models and teacher_gen stages (``make repro-real``, or ``dvc repro teacher_gen`` with
its params applied): it reads the teacher the models stage pinned and the teacher_gen eval split (prompts with the
teacher's completions), prunes the teacher in memory to each candidate (``ars_opd.models.pruning.prune_model``,
the models stage's own code) and scores each with the evaluate stage's own ``score_model``:

    python studies/prune_candidates.py --examples 96 > reports/prune_candidates.jsonl

Candidates, all keeping the same number of layers k (half the teacher's, rounded up, by default):

- ``every_other``: layers 0, 2, 4, ... (the cut spread evenly);
- ``every_other_odd``: layers 1, 3, 5, ... (the same spread, the first layer dropped);
- ``deep_block``: the first k - 1 layers and the last (one contiguous block of deep layers dropped, the last kept);
- ``first_k``: the first k layers (the deepest block dropped, the last layer with it);
- ``angular``: Gromov et al. 2024 ("The Unreasonable Ineffectiveness of the Deeper Layers"): drop the block of
  n = L - k consecutive layers l..l+n-1 whose input and output residual streams are closest in angular distance
  arccos(cos(h_l, h_{l+n})) / pi, averaged over the prompts' last token, measured on training prompts;
- ``block_influence``: ShortGPT (Men et al. 2024): drop the n layers of lowest Block Influence
  1 - cos(h_in, h_out), averaged over every prompt token of training prompts.

The two data-driven choices read the teacher_gen train split (as many prompts as ``--examples``), so the layers
are never chosen on the held-out prompts that then score them.

Each candidate's line: the kept layers, the held-out reverse KL to the teacher on the candidate's own samples
(temperature 1, the evaluate stage's seed), the NLL of the teacher's completions, and exact match where the rows
have checkable answers. The models stage's default is the candidate with the lowest reverse KL: the quantity OPD
minimises, from the start both arms share.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ars_opd.artifacts import read_jsonl  # noqa: E402
from ars_opd.config import EvaluateConfig, load_params  # noqa: E402
from ars_opd.data.prompts import encode_prompts, encode_teacher_completions  # noqa: E402
from ars_opd.evaluation.evaluate import HeldOut, is_checkable, score_model  # noqa: E402
from ars_opd.models.loading import load_model, load_tokenizer  # noqa: E402
from ars_opd.models.pruning import decoder_layers, prune_model  # noqa: E402


@torch.no_grad()
def residual_streams(model, data: HeldOut, batch_size: int = 16) -> list[torch.Tensor]:
    """Each prompt's hidden states at the input of every layer and after the last: L + 1 tensors (T_i, H) per
    prompt, as a list over prompts of (L + 1, T_i, H)."""
    out = []
    for ids in data.prompts:
        x = torch.tensor([ids])
        h = model(input_ids=x, output_hidden_states=True).hidden_states  # L + 1 of (1, T, H); the last is normed
        out.append(torch.stack([t[0] for t in h]).double())
    return out


def angular_choice(streams: list[torch.Tensor], n_drop: int) -> list[int]:
    """Gromov et al.: the block l..l+n-1 minimising the mean angular distance between h_l and h_{l+n} at the last
    token. hidden_states[L] is after the final norm, so the comparison stops at the last layer's input pair."""
    layers = streams[0].shape[0] - 1
    best, best_d = 0, float("inf")
    for start in range(0, layers - n_drop + 1):
        end = start + n_drop
        if end == layers:  # h_L is normed: not comparable with a raw residual stream
            continue
        d = 0.0
        for s in streams:
            a, b = s[start, -1], s[end, -1]
            d += float(torch.arccos(torch.clamp(torch.dot(a, b) / (a.norm() * b.norm()), -1, 1)) / torch.pi)
        if d < best_d:
            best, best_d = start, d
    return [i for i in range(layers) if not best <= i < best + n_drop]


def block_influence_choice(streams: list[torch.Tensor], n_drop: int) -> list[int]:
    """ShortGPT: drop the n layers whose output is most like their input (lowest 1 - cos, over every token)."""
    layers = streams[0].shape[0] - 1
    bi = []
    for i in range(layers - 1):  # the last layer's output is normed (see above): it is always kept
        cos = torch.cat([torch.nn.functional.cosine_similarity(s[i], s[i + 1], dim=-1) for s in streams])
        bi.append(float(1 - cos.mean()))
    drop = sorted(range(layers - 1), key=lambda i: bi[i])[:n_drop]
    return [i for i in range(layers) if i not in drop]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=96, help="held-out prompts scored per candidate")
    ap.add_argument("--keep", type=int, default=None, help="layers each candidate keeps (default: half, rounded up)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: evaluate.max_new_tokens")
    args = ap.parse_args()
    p = load_params(sections=("paths", "evaluate", "models"))
    cfg = (
        p.evaluate
        if args.max_new_tokens is None
        else EvaluateConfig(**{**vars(p.evaluate), "max_new_tokens": args.max_new_tokens})
    )
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    tokenizer = load_tokenizer(p.paths.models_dir)
    rows = read_jsonl(p.paths.completions("eval"))[: args.examples]
    data = HeldOut(
        rows,
        encode_prompts(tokenizer, [r["messages"] for r in rows]),
        encode_teacher_completions(tokenizer, rows),
        [is_checkable(r) for r in rows],
    )
    teacher = load_model(p.paths.models_dir, "teacher").eval().requires_grad_(False)
    n_layers = len(decoder_layers(teacher))
    keep = args.keep or (n_layers + 1) // 2
    t0 = time.perf_counter()
    # the data-driven choices see training prompts only, never the held-out ones they are scored on
    train_rows = read_jsonl(p.paths.completions("train"))[: args.examples]
    train = HeldOut(train_rows, encode_prompts(tokenizer, [r["messages"] for r in train_rows]), [], [])
    streams = residual_streams(teacher, train)
    candidates = {
        "every_other": list(range(0, n_layers, 2))[:keep],
        "every_other_odd": list(range(1, n_layers, 2))[:keep],
        "deep_block": list(range(keep - 1)) + [n_layers - 1],
        "first_k": list(range(keep)),
        "angular": angular_choice(streams, n_layers - keep),
        "block_influence": block_influence_choice(streams, n_layers - keep),
    }
    print(
        json.dumps(
            {
                "teacher_layers": n_layers,
                "keep": keep,
                "examples": len(rows),
                "streams_from": f"the first {len(train_rows)} training prompts",
                "streams_s": round(time.perf_counter() - t0, 1),
            }
        ),
        flush=True,
    )
    device = torch.device("cpu")
    vocab = len(tokenizer)
    seen: dict[tuple, dict] = {}
    for name, kept in candidates.items():
        t0 = time.perf_counter()
        if tuple(kept) in seen:
            m = seen[tuple(kept)]
        else:
            student = prune_model(teacher, kept).requires_grad_(False)
            m, _ = score_model(student, teacher, tokenizer, data, cfg, vocab, device)
            seen[tuple(kept)] = m
        line = {
            "candidate": name,
            "kept_layers": kept,
            "reverse_kl": m["reverse_kl"],
            "teacher_nll": m["teacher_nll"],
            "exact_match": m.get("exact_match"),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(json.dumps(line), flush=True)
    teacher_m, _ = score_model(teacher, teacher, tokenizer, data, cfg, vocab, device, is_teacher=True)
    print(
        json.dumps(
            {
                "candidate": "teacher",
                "teacher_nll": teacher_m["teacher_nll"],
                "exact_match": teacher_m.get("exact_match"),
            }
        )
    )


if __name__ == "__main__":
    main()
