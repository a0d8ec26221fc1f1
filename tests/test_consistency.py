"""Worker-consistency statistics: hook vs brute force on all-gathered local gradients (gloo DDP)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ars_opd.seeding import scenario_seeds, set_seeds
from ars_opd.training.batch_plan import epoch_shard
from ars_opd.training.consistency import consistency_metrics
from ars_opd.training.distributed import launch
from ddp_probe import bitwise_probe, consistency_probe
from tolerances import U64, consistency_bounds, consistency_inputs, gamma, propagate

KEYS = ("loss_dispersion", "grad_norm_dispersion", "gradient_diversity", "grad_direction_consistency")


def _batches(vocab: int, workers: int, micro: int, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for _ in range(workers):
        mine = []
        for _ in range(micro):
            n = rng.randint(1, 3)
            p = [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))] for _ in range(n)]
            c = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 6))] for _ in range(n)]
            mine.append((p, c))
        out.append(mine)
    return out


def _bounds(step):
    """The hook's fp32 statistics against the brute force's float64 ones (tests/tolerances.py)."""
    inputs = dict(step["inputs"])
    gram = inputs.pop("gram")
    return consistency_bounds(**inputs, n_params=step["params"], gram=None if gram is None else torch.tensor(gram))


def _compare(steps):
    for i, s in enumerate(steps):
        h, b, bound = s["hook"], s["brute"], _bounds(s)
        # the same fp32 local gradients on both sides: each divided by K, then K − 1 sums (sum_bound)
        assert s["reduced_rel"] <= gamma(len(h["worker_grad_norm"])), (i, s["reduced_rel"])
        for k in KEYS:
            assert abs(h[k] - b[k]) <= bound[k], (i, k, h[k], b[k], bound[k])
        for k in ("worker_grad_norm", "worker_cos_to_mean"):
            assert all(abs(x - y) <= e for x, y, e in zip(h[k], b[k], bound[k])), (i, k)
        assert max(h["worker_grad_norm"]) > 0


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_hook_statistics_equal_brute_force_with_accumulation_and_bucket_rebuild(char_tokenizer, workers):
    job = {"batches": _batches(len(char_tokenizer), workers, micro=2), "steps": 3, "gram_every": 1}
    steps = launch(consistency_probe, job, workers=workers)
    # DDP starts with one large first bucket and rebuilds after step 0: later steps see many small buckets
    assert steps[0]["buckets"] < steps[1]["buckets"] and steps[1]["buckets"] > 3
    _compare(steps)
    assert all(s["hook"]["gdc_exact"] for s in steps)


@pytest.mark.ddp
@pytest.mark.slow
def test_three_workers_between_gram_steps_estimate_within_its_bound(char_tokenizer):
    job = {
        "batches": _batches(len(char_tokenizer), 3, micro=1, seed=4),
        "steps": 3,
        "gram_every": 2,
        "bucket_view": False,
    }
    steps = launch(consistency_probe, job, workers=3)
    for i, s in enumerate(steps):
        h, b = s["hook"], s["brute"]
        assert h["gdc_exact"] == (i % 2 == 0)
        err = abs(h["grad_direction_consistency"] - b["grad_direction_consistency"])
        # the estimate's own bound (exact inputs) plus the fp32 inputs' error carried through it
        bound = _bounds(s)
        assert err <= h["gdc_error_bound"] + bound["grad_direction_consistency"], (i, err, h["gdc_error_bound"])
        for k in ("loss_dispersion", "grad_norm_dispersion", "gradient_diversity"):
            assert abs(h[k] - b[k]) <= bound[k]


@pytest.mark.ddp
@pytest.mark.slow
def test_identical_data_gives_zero_dispersion_and_unit_cosine(char_tokenizer):
    job = {"batches": _batches(len(char_tokenizer), 2, micro=2), "steps": 2, "identical": True}
    for s in launch(consistency_probe, job, workers=2):
        h, bound = s["hook"], _bounds(s)
        # exact: the same data on both workers gives bit-identical losses and gradients, so equal numbers
        assert h["loss_dispersion"] == 0 and h["grad_norm_dispersion"] == 0
        # fp32 statistics: a cosine of 1 within the fp32 inputs' error (never above 1)
        gdc, cos = h["grad_direction_consistency"], h["worker_cos_to_mean"]
        assert 1 - bound["grad_direction_consistency"] <= gdc <= 1
        assert all(1 - e <= c <= 1 for c, e in zip(cos, bound["worker_cos_to_mean"]))
        # K identical gradients: K g² / (K g)² = 1/K
        assert abs(h["gradient_diversity"] - 0.5) <= bound["gradient_diversity"]


@pytest.mark.ddp
@pytest.mark.slow
def test_world_size_one(char_tokenizer):
    steps = launch(consistency_probe, {"batches": _batches(len(char_tokenizer), 1, micro=2), "steps": 2}, workers=1)
    h = steps[0]["hook"]
    assert h["loss_dispersion"] == 0 and h["grad_norm_dispersion"] == 0
    bound = _bounds(steps[0])["worker_cos_to_mean"][0]  # ‖g‖² in fp32 (the hook) and float64 (the mean)
    assert math.isnan(h["grad_direction_consistency"]) and abs(h["worker_cos_to_mean"][0] - 1) <= bound


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.parametrize("bucket_view", [True, False])
def test_reduced_gradients_bit_identical_to_plain_ddp(char_tokenizer, bucket_view):
    assert launch(
        bitwise_probe, {"batches": _batches(len(char_tokenizer), 2, micro=2), "bucket_view": bucket_view}, workers=2
    )


def test_weighted_estimate_bound_on_random_gradients():
    """The K > 2 every-step estimate stays within its stated bound of the exact mean pairwise cosine."""
    torch.manual_seed(0)
    for trial in range(200):
        K = random.Random(trial).randint(3, 6)
        G = torch.randn(K, 50, dtype=torch.float64) * torch.rand(K, 1, dtype=torch.float64) * 5 + torch.randn(50) * 0.5
        mean = G.mean(0)
        sq, dot = (G**2).sum(1).tolist(), (G @ mean).tolist()
        est = consistency_metrics([0.0] * K, sq, dot, float(mean @ mean))
        exact = consistency_metrics([0.0] * K, sq, dot, float(mean @ mean), gram=G @ G.T)
        assert exact["gdc_exact"] and not est["gdc_exact"]
        err = abs(est["grad_direction_consistency"] - exact["grad_direction_consistency"])
        # the estimate's own bound, plus both sides' float64 rounding: the estimate's inputs are float64 sums
        # of 50, and a cosine from the float64 Gram matrix is within 3·γ_50 of the exact one (Cauchy–Schwarz)
        rounding = consistency_bounds([0.0] * K, sq, dot, float(mean @ mean), 50, u=U64)["grad_direction_consistency"]
        assert err <= est["gdc_error_bound"] + rounding + 3 * gamma(50, U64)
    # equal norms: the estimate is exact
    G = torch.nn.functional.normalize(torch.randn(4, 30, dtype=torch.float64), dim=1)
    mean = G.mean(0)
    est = consistency_metrics([0.0] * 4, (G**2).sum(1).tolist(), (G @ mean).tolist(), float(mean @ mean))
    exact = consistency_metrics([0.0] * 4, (G**2).sum(1).tolist(), (G @ mean).tolist(), float(mean @ mean), G @ G.T)
    # 0 at exactly equal norms; here the norms are 1 within float64 rounding (normalize's 2·γ_32, the sum's)
    sq, dot, mean_sq = (G**2).sum(1).tolist(), (G @ mean).tolist(), float(mean @ mean)
    xs, bs = consistency_inputs(sq, dot, mean_sq, 30, U64)
    bs[:4] = [b + 2 * gamma(32, U64) * x for b, x in zip(bs[:4], xs[:4])]
    bound = propagate(lambda v: consistency_metrics([0.0] * 4, v[:4], v[4:8], v[8])["gdc_error_bound"], xs, bs)[0]
    assert est["gdc_error_bound"] <= bound
    rounding = sum(
        consistency_bounds([0.0] * 4, sq, dot, mean_sq, 30, gram, U64)["grad_direction_consistency"]
        for gram in (None, G @ G.T)
    )
    assert abs(est["grad_direction_consistency"] - exact["grad_direction_consistency"]) <= bound + rounding


def test_loss_dispersion_definitions():
    m = consistency_metrics([1.0, 2.0, 4.0], [1.0] * 3, [1.0] * 3, 1.0)
    assert m["loss_range"] == 3.0 and m["loss_dispersion"] == pytest.approx(math.sqrt(14 / 9))


def test_scenarios_wire_sampler_and_rng_seeds_as_described():
    seed, K, n = 1234, 4, 400
    for scenario in ("S1-1", "S1-2", "S1-3"):
        seeds = [scenario_seeds(scenario, seed, r) for r in range(K)]
        streams = []
        for _, rng_seed in seeds:
            set_seeds(rng_seed)
            streams.append(torch.rand(5))
        shards = [epoch_shard(n, 0, sampler_seed, r, K) for r, (sampler_seed, _) in enumerate(seeds)]
        same_as_baseline = [torch.equal(streams[r], _stream(seed)) for r in range(K)]
        if scenario == "S1-1":
            flat = [i for s in shards for i in s]
            assert len(set(flat)) == len(flat) == n  # disjoint and covering
            assert all(same_as_baseline)
        elif scenario == "S1-2":
            assert same_as_baseline == [False, True, True, True]
        else:
            assert not any(same_as_baseline) and len({tuple(s.tolist()) for s in streams}) == K


def _stream(seed: int) -> torch.Tensor:
    set_seeds(seed)
    return torch.rand(5)
