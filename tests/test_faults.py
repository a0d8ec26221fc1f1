"""Injected faults change exactly what they claim; the drift fingerprint and the noise scale are exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ars_opd.config import ConfigError, InjectConfig, ParallelConfig, parse_section
from ars_opd.lm.batching import IGNORE_INDEX
from ars_opd.training.consistency import noise_scale_terms
from ars_opd.training.distributed import launch
from ars_opd.training.drift import fingerprint, mismatched_ranks, tensor_fingerprint
from ars_opd.training.faults import Fault
from ddp_probe import drift_probe, fault_probe, noise_scale_probe, tiny_model
from tolerances import chain_bound, decoder_lengths, dot_bound, gamma, propagate, softmax_length, two_computations


def _fault(kind, magnitude, rank=1, start=5, task=None, me=1):
    return Fault(InjectConfig(kind=kind, rank=rank, start_step=start, magnitude=magnitude, task=task), "sft", me, 0)


def test_inject_config_validates_each_kind():
    assert (
        parse_section(ParallelConfig, {"inject": {"kind": "loss_scale", "magnitude": 2}}, "ddp").inject.magnitude == 2.0
    )
    for raw, key in (
        ({"kind": "loss_scale", "magnitude": 1.0}, "ddp.inject.magnitude"),
        ({"kind": "label_noise", "magnitude": 1.5}, "ddp.inject.magnitude"),
        ({"kind": "drop_microbatch", "magnitude": 1.5}, "ddp.inject.magnitude"),
        ({"kind": "label_noise", "magnitude": 0.1, "stages": ["opd"]}, "ddp.inject.stages"),
        ({"kind": "bitflip", "magnitude": 1}, "ddp.inject.kind"),
    ):
        with pytest.raises(ConfigError) as e:
            parse_section(ParallelConfig, {"inject": raw}, "ddp")
        assert e.value.key == key
    with pytest.raises(ConfigError) as e:
        parse_section(
            ParallelConfig, {"workers": 2, "inject": {"kind": "loss_scale", "magnitude": 2, "rank": 3}}, "ddp"
        )
    assert e.value.key == "ddp.inject.rank"


def test_faults_touch_only_their_rank_stage_and_steps():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX]] * 40)
    other_rank = _fault("label_noise", 0.5, me=0)
    other_stage = Fault(InjectConfig(kind="loss_scale", rank=1, start_step=0, magnitude=2.0), "opd", 1, 0)
    mine = _fault("label_noise", 0.5)
    assert torch.equal(other_rank.corrupt_labels(labels, 10, 100), labels)
    assert torch.equal(mine.corrupt_labels(labels, 4, 100), labels)  # before start_step
    assert other_stage.loss_factor(3) == 1.0 and not other_stage.active(3)
    assert mine.active(5) and not mine.active(4) and other_rank.active(5)  # what the log records


def test_label_noise_replaces_the_asked_fraction_of_valid_labels_only():
    labels = torch.randint(0, 50, (64, 30))
    labels[:, :10] = IGNORE_INDEX  # prompt positions
    fault = _fault("label_noise", 0.1)
    noisy = fault.corrupt_labels(labels, 7, 1000)
    assert torch.equal(noisy[:, :10], labels[:, :10])  # ignored positions untouched
    changed = (noisy != labels).float().mean().item() * 30 / 20  # fraction of the valid positions
    assert 0.07 < changed < 0.13  # 1,280 valid tokens at 10% (random ids can repeat the original: 1/1000)
    assert torch.equal(fault.corrupt_labels(labels, 7, 1000), noisy)  # deterministic per step
    assert not torch.equal(fault.corrupt_labels(labels, 8, 1000), noisy)


def test_shard_skew_draws_the_asked_share_from_one_task():
    tasks = ["add", "reverse", "sort_digits", "length", "uppercase"] * 40
    idx = list(range(100, 116))
    half = _fault("shard_skew", 0.5, task="reverse")
    out = half.select(9, idx, tasks)
    assert len(out) == 16 and out[8:] == idx[8:]
    assert all(tasks[i] == "reverse" for i in out[:8])
    full = _fault("shard_skew", 1.0).select(9, idx, tasks)
    assert {tasks[i] for i in full} == {"add"}  # the first task in sorted order
    assert _fault("shard_skew", 1.0, me=0).select(9, idx, tasks) == idx
    with pytest.raises(ValueError, match="task label"):
        _fault("shard_skew", 1.0).select(9, idx, [None] * 200)


def test_drop_microbatch_never_drops_the_last_and_refuses_too_few():
    fault = _fault("drop_microbatch", 2)
    assert [fault.drops(6, i, 4) for i in range(4)] == [True, True, False, False]
    assert not any(fault.drops(4, i, 4) for i in range(4))
    with pytest.raises(ValueError, match="more micro-batches"):
        fault.drops(6, 0, 2)


def test_param_desync_perturbs_once_by_the_asked_relative_size():
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 300)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fault = _fault("param_desync", 1e-3, start=5)
    fault.perturb(model, 4)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    fault.perturb(model, 5)
    w0, w1 = before["weight"], model.weight.detach()
    rel = ((w1 - w0).std() / w0.pow(2).mean().sqrt()).item()
    # statistical, not rounding: the sample std of 60,000 normal draws has a relative standard error of
    # 1/√(2·60,000) ≈ 0.3%, so ±10% is ~35 of them
    assert 0.9e-3 < rel < 1.1e-3
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    fault.perturb(model, 6)  # one-off
    assert all(torch.equal(after[n], p) for n, p in model.named_parameters())
    _fault("param_desync", 1e-3, start=5, me=0).perturb(model, 5)
    assert all(torch.equal(after[n], p) for n, p in model.named_parameters())


def _batches(vocab: int, workers: int, micro: int, seed: int):
    rng = random.Random(seed)
    return [
        [
            (
                [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 8))] for _ in range(2)],
                [[rng.randrange(4, vocab) for _ in range(rng.randint(1, 5))] for _ in range(2)],
            )
            for _ in range(micro)
        ]
        for _ in range(workers)
    ]


@pytest.mark.ddp
@pytest.mark.slow
def test_loss_scale_multiplies_only_that_ranks_local_gradient(char_tokenizer):
    res = launch(
        fault_probe,
        {"batches": _batches(len(char_tokenizer), 3, 2, 1), "kind": "loss_scale", "magnitude": 4.0, "rank": 1},
        workers=3,
    )
    G = np.array(res["micro_grads"]).sum(axis=1)  # (K, P) healthy local gradients
    h, f = res["healthy"], res["fault"]
    assert f["loss_sum"] == h["loss_sum"] and f["tokens"] == h["tokens"]  # the logged loss is the true one
    # exact: a power-of-two factor on the loss scales every rounded step of the backward, the bucket norms and
    # their squares exactly (nothing here is near overflow or underflow)
    assert f["sq"][1] == 16 * h["sq"][1]
    assert f["sq"][0] == h["sq"][0] and f["sq"][2] == h["sq"][2]  # other ranks bit for bit
    expected = (G.sum(0) + 3 * G[1]) / 3
    # the same micro-batch gradients summed in fp32: two micro-batches, the division by K, the sum over the
    # 3 ranks: at most 4 roundings on the terms' absolute sum (sum_bound, any order)
    terms = (np.abs(np.array(res["micro_grads"])).sum(axis=1) * np.array([1, 4, 1])[:, None]).sum(0) / 3
    assert (np.abs(np.array(f["reduced"]) - expected) <= gamma(4) * terms).all()


@pytest.mark.ddp
@pytest.mark.slow
def test_drop_microbatch_drops_one_gradient_but_counts_its_tokens(char_tokenizer):
    res = launch(
        fault_probe,
        {"batches": _batches(len(char_tokenizer), 3, 2, 2), "kind": "drop_microbatch", "magnitude": 1.0, "rank": 2},
        workers=3,
    )
    micro = np.array(res["micro_grads"])  # (K, 2, P)
    h, f = res["healthy"], res["fault"]
    assert f["tokens"] == h["tokens"]  # the dropped micro-batch's tokens still count
    assert f["loss_sum"][:2] == h["loss_sum"][:2] and f["loss_sum"][2] < h["loss_sum"][2]
    expected = (micro[0].sum(0) + micro[1].sum(0) + micro[2, 1]) / 3  # rank 2 keeps only its last micro-batch
    terms = (np.abs(micro[0]).sum(0) + np.abs(micro[1]).sum(0) + np.abs(micro[2, 1])) / 3
    assert (np.abs(np.array(f["reduced"]) - expected) <= gamma(4) * terms).all()  # as above
    # the hook's fp32 squared norm of those same fp32 values: a dot product over the P parameters (in buckets,
    # any order), one sqrt and one square (relative u each, the sqrt's twice)
    sq = float((micro[2, 1] ** 2).sum())
    assert abs(f["sq"][2] - sq) <= dot_bound(micro.shape[-1] + 3, sq)


def test_fingerprint_catches_a_one_ulp_change_anywhere():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Linear(40, 3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 50)).sum().backward()
    opt.step()
    base = fingerprint(model, opt)
    for p in model.parameters():
        for i in (0, p.numel() // 2, p.numel() - 1):
            with torch.no_grad():
                old = p.view(-1)[i].clone()
                p.view(-1)[i] = torch.nextafter(old, torch.tensor(float("inf")))
                assert not torch.equal(fingerprint(model, opt), base)
                p.view(-1)[i] = old
    assert torch.equal(fingerprint(model, opt), base)
    state = opt.state[next(iter(model.parameters()))]["exp_avg_sq"]
    state.view(-1)[3] = torch.nextafter(state.view(-1)[3], torch.tensor(float("inf")))
    assert not torch.equal(fingerprint(model, opt)[2:], base[2:])  # optimizer state is covered too
    # two changes that cancel in the plain sum are still seen by the weighted one
    t = torch.zeros(1000)
    u = t.clone()
    u.view(torch.int16)[10] += 1
    u.view(torch.int16)[700] -= 1
    assert tensor_fingerprint([t])[0] == tensor_fingerprint([u])[0]
    assert tensor_fingerprint([t])[1] != tensor_fingerprint([u])[1]


def test_mismatched_ranks_names_the_minority():
    same = torch.tensor([[1, 2, 3, 4]] * 4)
    assert mismatched_ranks(same) == []
    odd = same.clone()
    odd[2, 1] = 9
    assert mismatched_ranks(odd) == [2]
    assert mismatched_ranks(torch.tensor([[1, 2], [1, 3]])) == [0, 1]  # two replicas: either may be wrong


@pytest.mark.ddp
@pytest.mark.slow
def test_drift_check_catches_one_ulp_on_one_rank_in_ddp(char_tokenizer):
    before, after = launch(
        drift_probe, {"rank": 1, "param": "model.layers.0.mlp.up_proj.weight", "index": 17}, workers=3
    )
    assert before == [] and after == [1]


def test_noise_scale_estimates_are_unbiased_on_gaussian_gradients():
    """Per-token gradients drawn as G + noise (known |G|², tr Σ): the step estimates average to the truth."""
    rng = np.random.default_rng(0)
    P, K, n = 40, 4, 25  # parameters, workers, tokens per worker
    G = rng.normal(0, 0.3, P)
    sigma = rng.uniform(0.5, 2.0, P)  # diagonal per-token covariance
    g2s, traces = [], []
    for _ in range(4000):
        tokens = G + rng.normal(0, 1, (K, n, P)) * sigma  # (K, n, P)
        N = K * n
        local = tokens.sum(1) * K / N  # the engine's scale: K / N times each worker's summed gradient
        mean = local.mean(0)
        g2, tr = noise_scale_terms((local**2).sum(1).tolist(), [n] * K, float((mean**2).sum()))
        g2s.append(g2)
        traces.append(tr)
    # statistical, not rounding: the means of 4,000 estimates have relative standard errors of 0.33% (|G|²) and
    # 0.24% (tr Σ) here, so 5% and 3% are 15 and 12 of them
    assert np.mean(g2s) == pytest.approx((G**2).sum(), rel=0.05)
    assert np.mean(traces) == pytest.approx((sigma**2).sum(), rel=0.03)
    assert np.isnan(noise_scale_terms([1.0], [10], 1.0)[0])


@pytest.mark.ddp
@pytest.mark.slow
def test_noise_scale_terms_equal_brute_force_on_per_sequence_gradients(char_tokenizer):
    res = launch(noise_scale_probe, {"batches": _batches(len(char_tokenizer), 3, 2, 3)}, workers=3)
    seqs = [np.array(s) for s in res["per_seq"]]  # each worker's per-sequence summed gradients
    counts = [np.array(c) for c in res["counts"]]
    N = sum(c.sum() for c in counts)
    K = len(seqs)
    assert [c.sum() for c in counts] == res["tokens"]
    worker_means = [s.sum(0) / c.sum() for s, c in zip(seqs, counts)]  # each worker's token-mean gradient
    big = sum(s.sum(0) for s in seqs) / N
    # token-weighted (ars_opd.training.consistency.noise_scale_terms): unbiased at B_small = N/K for any split
    small_sq = sum(c.sum() / N * (w**2).sum() for w, c in zip(worker_means, counts))
    b_small, b_big = N / K, N
    g2 = (b_big * (big**2).sum() - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - (big**2).sum()) / (1 / b_small - 1 / b_big)
    est = noise_scale_terms(res["sq"], [int(t) for t in res["tokens"]], res["mean_sq"])
    # two fp32 computations of each gradient (the engine's padded micro-batches and chunked head, one sequence
    # at a time through full logits): the chain of the decoder's forward and backward, the head, the
    # log-softmax, the sums over positions, sequences and workers, relative to the gradient's 2-norm; a
    # squared norm then has twice that relative error (plus its square), the hook's fp32 one a dot product more
    model = tiny_model(char_tokenizer)
    cfg, V, P = model.config, len(char_tokenizer), big.shape[0]
    seqs_flat = [p + c for w in _batches(len(char_tokenizer), 3, 2, 3) for ps, cs in w for p, c in zip(ps, cs)]
    with torch.no_grad():
        top = max(model(input_ids=torch.tensor([ids])).logits.abs().max().item() for ids in seqs_flat)
    T = max(map(len, seqs_flat))
    lengths = (
        decoder_lengths(cfg, T)
        + [cfg.hidden_size, softmax_length(V, top)]
        + decoder_lengths(cfg, T)
        + [sum(map(len, seqs_flat)), len(seqs_flat), K]
    )
    c = two_computations(chain_bound(lengths))
    rel = 2 * c + c * c
    assert abs(res["mean_sq"] - (big**2).sum()) <= rel * (big**2).sum()
    bounds = [(rel + gamma(P + 3)) * s for s in res["sq"]] + [rel * res["mean_sq"]]
    tokens = [int(t) for t in res["tokens"]]
    est_bound = propagate(lambda v: noise_scale_terms(v[:K], tokens, v[K]), res["sq"] + [res["mean_sq"]], bounds)
    assert abs(est[0] - g2) <= est_bound[0] and abs(est[1] - trace) <= est_bound[1]
