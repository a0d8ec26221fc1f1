"""bench/peer_trl.py: how it reads back what a step trained on, the evidence that both sides saw the same batches.

The benchmark itself needs trl and the real models; these check, without either, that the sequences it recovers from
our micro-batches are exactly the rows that went in: padded rows cut at their attention mask, packed rows split at
their boundaries with the rows' trailing padding left out, rollout rows split into prompt and completion length.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ars_opd.lm.batching import build_rollout_batch, pack_sequences, pad_right_with_labels

BENCH = Path(__file__).resolve().parents[1] / "bench" / "peer_trl.py"
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
COMPLETIONS = [[20, 21], [22, 23, 24, 2], [25], [26, 27, 28]]


def _bench():
    spec = importlib.util.spec_from_file_location("peer_trl_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_padded_and_packed_sft_batches_give_back_their_rows_in_order():
    bench = _bench()
    rows = [tuple(p + c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert bench.sft_sequences(pad_right_with_labels(PROMPTS, COMPLETIONS, pad_id=2)) == rows
    # rows of 8: the first two sequences fill one (5 + 6 > 8 starts a second), each row padded to the longest
    packed = pack_sequences(PROMPTS, COMPLETIONS, pack_length=8, pad_id=2)
    assert packed["input_ids"].shape[0] > 1 and len(packed["cu_seq_lens"]) - 1 > len(rows)  # padding segments too
    assert bench.sft_sequences(packed) == rows


def test_rollout_batches_give_back_each_prompt_and_its_completion_length_up_to_the_first_eos():
    bench = _bench()
    completions = [[20, 2, 21], [22, 23], [2], [24, 25, 26]]  # EOS is 2: the rows keep up to and including it
    batch = build_rollout_batch(PROMPTS, completions, pad_id=2, eos_id=2)
    got = bench.opd_sequences(batch)
    assert got == [(tuple(p), n) for p, n in zip(PROMPTS, [2, 2, 1, 3])]


def test_summary_ratios_take_the_best_of_each_side_per_round_and_fp32_only_like_for_like():
    """Per round: TRL's fastest variant over each of ours; ``fp32_trl_over_ours`` pairs only the variants that compute
    in fp32 throughout, so a bf16 setting on either side cannot make the like-for-like ratio."""
    bench = _bench()
    times = {  # (side, variant) -> median step seconds in rounds 0 and 1
        ("ours", "trainer_rollouts"): (6.0, 6.2),
        ("ours", "static_rollouts"): (5.0, 5.5),
        ("ours", "bf16_rollouts"): (4.0, 4.4),
        ("ours", "bf16_rollouts_teacher"): (3.0, 3.3),
        ("trl", "on_policy"): (6.5, 6.6),
        ("trl", "on_policy_bf16_teacher"): (6.0, 6.05),
    }
    lines = [
        {"kind": "opd", "side": side, "variant": v, "threads": 2, "round": r, "median_step_s": t[r], "tokens_per_s": 1}
        for (side, v), t in times.items()
        for r in (0, 1)
    ]
    out = bench.summary("opd", 2, lines)
    assert out["trl_best"] == "on_policy_bf16_teacher"
    assert out["trl_over_ours"] == round((6.0 / 6.0 + 6.05 / 6.2) / 2, 3)  # median of two rounds: their mean
    assert out["trl_over_ours_best"] == round((6.0 / 3.0 + 6.05 / 3.3) / 2, 3)
    assert out["trl_best_over"]["bf16_rollouts"]["ratio"] == round((6.0 / 4.0 + 6.05 / 4.4) / 2, 3)
    # like for like: TRL's fp32 teacher (on_policy) over our fastest fp32 variant (static_rollouts)
    assert out["fp32_trl_over_ours"] == round((6.5 / 5.0 + 6.6 / 5.5) / 2, 3)
    assert out["fp32_variants"] == ["on_policy", "static_rollouts", "trainer_rollouts"]
