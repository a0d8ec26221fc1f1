"""The sharded hook (ars_opd.training.sharding) where FSDP2 reduces differently: one worker, where FSDP2 skips
the reduce-scatter the hook reads, and reductions whose input is not the local gradient (refused)."""

from __future__ import annotations

import math

import pytest

from ars_opd.training.distributed import launch
from sharding_probe import one_worker_probe, reduction_probe
from test_consistency import _batches
from tolerances import U32, gamma


def test_one_fsdp_worker_reports_the_statistics_one_ddp_worker_does(char_tokenizer):
    """K = 1 in-process, 2 steps: FSDP2 copies the gradient instead of reduce-scattering it, so every
    statistic was NaN under fsdp while ddp reported them. Now both report the same: ‖g_1‖ equal to the
    pre-clip norm (g_1 is ḡ), cos(g_1, ḡ) = 1, diversity 1, and no pairwise or noise-scale terms (NaN: they
    need two workers)."""
    job = {"batches": _batches(len(char_tokenizer), 1, micro=2), "steps": 2}
    out = launch(one_worker_probe, job, workers=1)
    for strategy in ("ddp", "fsdp"):
        for row in out[strategy]["rows"]:
            c, norm = row["consistency"], row["grad_norm"]
            assert row["reductions"] > 0, strategy
            # ‖g_1‖² and ‖ḡ‖² are two fp32 sums of the same P squares (per bucket, group or parameter, then
            # in fp64): each within γ_P·‖g‖² of the exact value (tolerances.dot_bound)
            (g1,) = c["worker_grad_norm"]
            assert math.isfinite(g1) and abs(g1**2 - norm**2) <= 2 * gamma(out[strategy]["params"], U32) * norm**2
            assert c["worker_cos_to_mean"][0] == pytest.approx(1.0, abs=4 * gamma(out[strategy]["params"], U32))
            assert c["gradient_diversity"] == pytest.approx(1.0, abs=4 * gamma(out[strategy]["params"], U32))
            assert c["loss_dispersion"] == 0.0 and c["grad_norm_dispersion"] == 0.0
            assert math.isnan(c["grad_direction_consistency"]) and all(math.isnan(x) for x in row["noise"])
    # the same model, batches and steps: the same statistics under both strategies, to the same bound
    for a, b in zip(out["ddp"]["rows"], out["fsdp"]["rows"]):
        (ga,), (gb,) = a["consistency"]["worker_grad_norm"], b["consistency"]["worker_grad_norm"]
        assert abs(ga - gb) <= 4 * gamma(out["ddp"]["params"], U32) * max(ga, gb)


@pytest.mark.ddp
@pytest.mark.parametrize("case", ["fp16", "force_sum"])
def test_a_reduction_the_statistics_cannot_read_is_refused(char_tokenizer, case):
    """An fp16 reduce dtype (FSDP divides the input by √K first: ‖g_k‖² came out 4× too small at K = 2) and a
    forced sum reduction (another op than the average the engine's scaling assumes) stop the step, naming the
    op, the dtype and ddp.consistency; FSDP's own reduction (AVG in fp32) passes."""
    job = {"batches": _batches(len(char_tokenizer), 2, micro=1), "case": case}
    message = launch(reduction_probe, job, workers=2)
    assert message is not None, case
    assert "ddp.consistency: false" in message and "ReduceOp.AVG" in message
    assert ("torch.float16" in message) if case == "fp16" else ("SUM" in message)
    assert launch(reduction_probe, {**job, "case": "default"}, workers=2) is None
