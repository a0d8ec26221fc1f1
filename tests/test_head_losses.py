"""Losses from hidden states, chunk by chunk, against the logits path they replace (values and every gradient).

The reference: ``model(...).logits`` then ``causal_lm_token_loss_sum`` or the oracles of tests/oracles.py (the
textbook divergences and sampled-token surrogate over whole tensors, with autograd). fp32 on CPU, both paths
from the same hidden states (bit for bit: the same decoder ops in the same order), so they differ only in the
head's products and the losses' sums (and the order of the losses' operations): the loss to
twice its first-order fp32 bound (tests/tolerances.py, from the float64 oracle of the head and loss), every
parameter's gradient (the tied embedding included) to twice the chain bound of its backward path, relative to
its own max |value|.
"""

from __future__ import annotations

import random

import pytest
import torch

from ars_opd.lm.cross_entropy import (
    causal_lm_loss_from_hidden,
    causal_lm_token_loss_sum,
    cross_entropy_terms,
    shifted_targets,
)
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.opd_objectives import TeacherLogits, TeacherScores, get_objective
from oracles import divergence_sum, sampled_token_loss
from tolerances import (
    U32,
    U_BF16,
    chain_bound,
    cross_entropy_grad_bound,
    decoder_lengths,
    head_grad_bound,
    linear_bound,
    log_softmax_bound,
    loss_bound,
    softmax_length,
    two_computations,
    vs_oracle,
)

V, ROWS = 53, 58  # scored vocabulary; output rows (5 padding rows beyond the tokenizer, as Qwen3 has)


def _model(family="llama", tied=True, seed=0, hidden=32, rows=ROWS, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    cfg = cls(
        vocab_size=rows,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        tie_word_embeddings=tied,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # a larger logit scale than the init's, so distributions are far from uniform
        model.get_output_embeddings().weight.mul_(8.0)
        if not tied:
            model.get_input_embeddings().weight.normal_()
    return model.to(dtype)


def _batch(n=4, seed=0):
    rng = random.Random(seed)
    lens = [(rng.randint(2, 9), rng.randint(1, 8)) for _ in range(n)]
    width = max(p + c for p, c in lens)
    ids = torch.zeros(n, width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros(n, width, dtype=torch.bool)  # positions predicting a completion token
    for i, (p, c) in enumerate(lens):
        ids[i, : p + c] = torch.tensor([rng.randrange(V) for _ in range(p + c)])
        attn[i, : p + c] = 1
        labels[i, p : p + c] = ids[i, p : p + c]
        mask[i, p - 1 : p + c - 1] = True
    targets = torch.roll(ids, -1, dims=1)
    return ids, attn, labels, mask, targets


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _head_bound(kind, student, ref_student, ids, attn, mask, targets, teacher=None, beta=1.0, tau=1.0):
    """The fp32 bound of one evaluation of the loss from the student's hidden states, and the gradients'
    reduction lengths (the chain of ``chain_bound``) from the loss back to every parameter."""
    with torch.no_grad():
        hidden = last_hidden_states(student, ids, attn)
        # the premise of comparing two paths on the head alone: the same decoder ops in the same order
        assert torch.equal(hidden, last_hidden_states(ref_student, ids, attn))
        hs, head = select_rows(hidden, mask), OutputHead.of(student, V)
        zs = torch.nn.functional.linear(hs.double(), head.weight.double())  # exact products of the fp32 rows
        zt = bt = None
        if teacher is not None:
            ht, t_head = select_rows(last_hidden_states(teacher, ids, attn), mask), OutputHead.of(teacher, V)
            zt, bt = torch.nn.functional.linear(ht.double(), t_head.weight.double()), linear_bound(ht, t_head.weight)
    _, bound = loss_bound(kind, zs, linear_bound(hs, head.weight), zt, bt, targets[mask], beta, tau)
    cfg, (B, T), M = student.config, ids.shape, hs.shape[0]
    rows = student.get_output_embeddings().weight.shape[0]
    # head: logits (H), log-softmax, the row sum a KL gradient takes, about 8 elementwise operations, then
    # dz·W (over the output rows) and dzᵀ·h (over the M rows); the decoder's backward; the weight gradients'
    # sum over the B·T positions
    lengths = [cfg.hidden_size, softmax_length(V, zs.abs().max().item() / tau), V, 8, max(rows, M)]
    return bound, lengths + decoder_lengths(cfg, T) + [B * T]


def _assert_close(loss, ref_loss, loss_tol, grads, ref_grads, lengths):
    assert abs(loss - ref_loss) <= loss_tol, (loss, ref_loss, loss_tol)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item()
        assert scale > 0, name  # every parameter takes part
        err = (grads[name] - ref).abs().max().item()
        assert err <= two_computations(chain_bound(lengths, scale)), (name, err, scale)


@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("qwen3", True)])
@pytest.mark.parametrize("chunk", [1, 5, 4096])
def test_sft_cross_entropy_from_hidden_equals_logits_path(family, tied, chunk):
    ids, attn, labels, _, _ = _batch(seed=1)
    ref_model, model = _model(family, tied, rows=V), _model(family, tied, rows=V)
    ref, _ = causal_lm_token_loss_sum(ref_model(input_ids=ids, attention_mask=attn).logits, labels)
    ref.backward()
    hidden = last_hidden_states(model, ids, attn)
    loss, n = causal_lm_loss_from_hidden(hidden, OutputHead.of(model), labels, chunk_size=chunk)
    loss.backward()
    assert n == int((labels[:, 1:] != -100).sum()) and loss.dtype == torch.float32
    mask, _ = shifted_targets(labels)
    bound, lengths = _head_bound("cross_entropy", model, ref_model, ids, attn, mask, torch.roll(labels, -1, 1))
    _assert_close(loss.item(), ref.item(), two_computations(bound), _grads(model), _grads(ref_model), lengths)


def _opd_reference(student, teacher, ids, attn, mask, targets, loss, beta, tau):
    s_logits = student(input_ids=ids, attention_mask=attn).logits[..., :V]
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=attn).logits[..., :V]
    if loss == "full_vocab":
        value, _ = divergence_sum(s_logits, t_logits, mask, beta, tau)
        return value, 0.0
    logp = torch.log_softmax(t_logits.float() / tau, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    surrogate, estimate, _ = sampled_token_loss(s_logits, logp, targets, mask, tau)
    # the value is fl(s + fl(e − s)): two more roundings than the estimate e itself
    extra = U32 * (abs(estimate.item() - surrogate.item()) + abs(estimate.item()))
    return surrogate + (estimate - surrogate).detach(), extra


def _opd_chunked(student, teacher, ids, attn, mask, targets, loss, beta, tau, chunk):
    objective = get_objective(loss)
    hidden = select_rows(last_hidden_states(student, ids, attn), mask)  # (M, H)
    y = targets[mask]
    with torch.no_grad():
        t_hidden = select_rows(last_hidden_states(teacher, ids, attn), mask)
        t_head = OutputHead.of(teacher, V)
        if objective.teacher_signal == "logits":
            scores = TeacherScores(logits=TeacherLogits(t_hidden, t_head, y))
        else:
            lp1, lpt = target_logprobs(t_hidden, t_head, y, (1.0, tau), chunk_size=chunk)
            scores = TeacherScores(token_logprobs=lpt, logged_logprobs=lp1)
    value, n = objective.loss(hidden, OutputHead.of(student, V), scores, y, beta, tau, chunk)
    return value, n, scores


@pytest.mark.parametrize(
    "loss, beta",
    [("full_vocab", 0.0), ("full_vocab", 1.0), ("full_vocab", 0.3), ("full_vocab", 0.5), ("sampled_token", 1.0)],
)
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("tied", [True, False])
def test_opd_losses_from_hidden_equal_logits_path(loss, beta, tau, tied):
    ids, attn, _, mask, targets = _batch(seed=2)
    teacher = _model("qwen3", True, seed=7, hidden=48).eval()  # another width and family: only the vocabulary is shared
    ref_model, model = _model("llama", tied, seed=3), _model("llama", tied, seed=3)
    ref, extra = _opd_reference(ref_model, teacher, ids, attn, mask, targets, loss, beta, tau)
    ref.backward()
    value, n, scores = _opd_chunked(model, teacher, ids, attn, mask, targets, loss, beta, tau, chunk=3)
    value.backward()
    assert n == int(mask.sum())
    grads, ref_grads = _grads(model), _grads(ref_model)
    out_rows = "lm_head.weight" if not tied else "model.embed_tokens.weight"
    assert grads[out_rows][V:].abs().max() == 0  # padding rows beyond the vocabulary take no part in the loss
    for g in (grads, ref_grads):  # ... and are compared over the vocabulary only (the reference slices the same way)
        g[out_rows] = g[out_rows][:V]
    kind = "sampled_token" if loss == "sampled_token" else "divergence"
    bound, lengths = _head_bound(kind, model, ref_model, ids, attn, mask, targets, teacher, beta, tau)
    _assert_close(value.item(), ref.item(), two_computations(bound, bound + extra), grads, ref_grads, lengths)
    with torch.no_grad():  # the logged teacher log-probability at tau = 1, for either kind of teacher signal
        t_logits = teacher(input_ids=ids, attention_mask=attn).logits[..., :V]
        logged = torch.log_softmax(t_logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)[mask]
        # both from fp32 logits (within linear_bound of h·Wᵀ), passed through the log-softmax (gain: the
        # logit's own error plus the softmax-weighted mean of the row's), one of them then rounded by its fp32
        # log-softmax; the float64 one is the oracle
        ht, t_head = select_rows(last_hidden_states(teacher, ids, attn), mask), OutputHead.of(teacher, V)
        zt, bz = torch.nn.functional.linear(ht.double(), t_head.weight.double()), linear_bound(ht, t_head.weight)
        gain = bz + (torch.softmax(zt, -1) * bz).sum(-1, keepdim=True)
        y = targets[mask][:, None]
        bound = (2 * gain + log_softmax_bound(zt)).gather(-1, y).squeeze(-1)
    assert ((scores.target_logprobs().double() - logged).abs() <= vs_oracle(bound)).all()


def test_bf16_weights_accumulate_in_fp32():
    """bf16 model: the chunked loss and gradients are the fp32 evaluation of the chunks' bf16 logits (no sum in
    bf16), close to a float64 evaluation of the same bf16 hidden states and head, and no worse than the logits
    path (which rounds (tokens x vocabulary) logits to bf16)."""
    ids, attn, labels, _, _ = _batch(n=6, seed=4)
    model = _model("llama", True, rows=V, hidden=64, dtype=torch.bfloat16)
    hidden = last_hidden_states(model, ids, attn).detach().requires_grad_(True)
    head = OutputHead.of(model)
    loss, _ = causal_lm_loss_from_hidden(hidden, head, labels, chunk_size=4)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == torch.bfloat16
    assert model.lm_head.weight.grad.dtype == torch.bfloat16
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = head.weight.detach().double().requires_grad_(True)
    oracle, _ = causal_lm_token_loss_sum(h64 @ w64.T, labels)
    oracle.backward()
    mask, y = shifted_targets(labels)
    rows = select_rows(hidden.detach(), mask)
    with torch.no_grad():  # the bf16 logits the loss formed: the same products of the same chunks of rows
        zb = torch.cat([head.logits(rows[i : i + 4]) for i in range(0, len(rows), 4)]).double()
    # the loss is the fp32 evaluation of those logits (a bf16 sum would be off by ~2^-8 of it)
    at_zb, bound = loss_bound("cross_entropy", zb, targets=y)
    assert abs(loss.item() - at_zb.item()) <= vs_oracle(bound)
    # the float64 oracle: the logits' one bf16 rounding (2^-8 of each) on fp32-accumulated products, propagated
    z64 = rows.double() @ w64.detach().T
    _, bf16_bound = loss_bound("cross_entropy", z64, U_BF16 * z64.abs() + linear_bound(rows, head.weight), targets=y)
    assert abs(loss.item() - oracle.item()) <= vs_oracle(bound + bf16_bound)
    # the gradients: the exact cross-entropy gradient of those logits, cast to bf16 (one rounding of dz), the
    # products' fp32 accumulation, their outputs rounded to bf16 (once for dh; per chunk and once more for dW)
    dz, dz_bound = cross_entropy_grad_bound(zb, y)
    bh, bw, _ = head_grad_bound(rows, head.weight, dz, dz_bound + U_BF16 * dz.abs(), u_out=2 * U_BF16)
    w = head.weight.detach().double()
    assert ((hidden.grad[mask].double() - dz @ w).abs() <= bh).all() and (hidden.grad[~mask] == 0).all()
    assert ((model.lm_head.weight.grad.double() - dz.T @ rows.double()).abs() <= bw).all()
    naive = hidden.detach().requires_grad_(True)
    zn = naive @ head.weight.detach().T  # bf16 logits, (B, T, V)
    naive_loss, _ = causal_lm_token_loss_sum(zn, labels)
    # both paths evaluate bf16 logits in fp32: the chunked path is no worse than the logits path up to the
    # difference of their logits (evaluated exactly) and both fp32 evaluations
    at_zn, bound_n = loss_bound("cross_entropy", select_rows(zn.detach(), mask).double(), targets=y)
    slack = abs(at_zb - at_zn).item() + two_computations(bound, bound_n)
    assert abs(loss.item() - oracle.item()) <= abs(naive_loss.item() - oracle.item()) + slack


def test_backward_scales_by_the_exact_upstream_factor_and_runs_once():
    torch.manual_seed(0)
    h = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    y = torch.randint(0, V, (9,))
    loss = chunked_head_loss(h, OutputHead(w, None), cross_entropy_terms(y), chunk_size=4)
    (loss * (1 / 3)).backward(retain_graph=True)
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    (torch.nn.functional.cross_entropy(h64 @ w64.T, y, reduction="sum") / 3).backward()
    # fp32 logits, the softmax, the products; then two roundings: 1/3 in fp32 and the scaling by it
    dz, dz_bound = cross_entropy_grad_bound(h64.detach() @ w64.detach().T, y, linear_bound(h, w))
    bh, bw, _ = head_grad_bound(h, w, dz, dz_bound)
    for got, want, bound in ((h.grad, h64.grad, bh), (w.grad, w64.grad, bw)):
        assert ((got.double() - want).abs() <= vs_oracle(bound / 3 + 2 * U32 * want.abs())).all()
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_bias_gets_its_gradient():
    torch.manual_seed(1)
    h = torch.randn(7, 6, requires_grad=True)
    w, b = torch.randn(V, 6, requires_grad=True), torch.randn(V, requires_grad=True)
    y = torch.randint(0, V, (7,))
    chunked_head_loss(h, OutputHead(w, b), cross_entropy_terms(y), chunk_size=2).backward()
    ref = [t.detach().clone().requires_grad_(True) for t in (h, w, b)]
    torch.nn.functional.cross_entropy(torch.nn.functional.linear(*ref), y, reduction="sum").backward()
    # two fp32 evaluations of one gradient (chunked, and autograd's), each within its bound of the exact one
    z = torch.nn.functional.linear(*(t.detach().double() for t in (h, w, b)))
    dz, dz_bound = cross_entropy_grad_bound(z, y, linear_bound(h, w, b))
    for got, want, bound in zip((h, w, b), ref, head_grad_bound(h, w, dz, dz_bound)):
        assert ((got.grad - want.grad).abs() <= two_computations(bound)).all()


def test_last_hidden_states_are_the_decoders_output_and_no_logits_are_formed():
    ids, attn, *_ = _batch(seed=5)
    model = _model(rows=V)
    seen = []
    model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    hidden = last_hidden_states(model, ids, attn)
    assert torch.equal(hidden, model.model(input_ids=ids, attention_mask=attn).last_hidden_state)
    assert seen == [(ids.shape[0], 0, V)]  # the head ran on no position
    assert not model.model._forward_hooks  # the capture hook is gone


def test_heads_that_transform_logits_are_refused():
    model = _model(rows=V)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        OutputHead.of(model)
    with pytest.raises(ValueError, match="fewer than"):
        OutputHead.of(_model(rows=V), V + 1)


def test_bf16_teacher_scores_a_fp32_student():
    """The frozen teacher in bf16 (the CUDA default): its chunked logits feed the fp32 student's loss as the
    logits path's bf16 teacher logits do."""
    from ars_opd.lm.precision import frozen_model_dtype
    from ars_opd.training.opd.teachers import LocalTeacher

    assert frozen_model_dtype("auto", "cpu") == torch.float32 and frozen_model_dtype("auto", "cuda") == torch.bfloat16
    assert frozen_model_dtype("bf16", "cpu") == torch.bfloat16 and frozen_model_dtype("fp32", "cuda") == torch.float32
    ids, attn, _, mask, targets = _batch(seed=6)
    teacher = _model("qwen3", True, seed=8, hidden=48, dtype=torch.bfloat16)
    student = _model("llama", True, seed=9)
    t = {"input_ids": ids, "attention_mask": attn, "loss_mask": mask, "targets": targets}
    objective = get_objective("full_vocab")
    scores = LocalTeacher(teacher, V, chunk_size=4).score(t, objective, 1.0)
    hidden = select_rows(last_hidden_states(student, ids, attn), mask)
    value, _ = objective.loss(hidden, OutputHead.of(student, V), scores, targets[mask], 0.5, 1.0, 4)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=attn).logits[..., :V]  # bf16
        ref, _ = divergence_sum(student(input_ids=ids, attention_mask=attn).logits[..., :V], t_logits, mask, 0.5)
    # both paths: the same fp32 student rows (within linear_bound of exact logits) and bf16 teacher logits,
    # the chunked path's from chunks of 4 rows, the logits path's from one product; their difference is
    # evaluated exactly, then each path's fp32 evaluation is within its bound
    hs, s_head = select_rows(last_hidden_states(student, ids, attn), mask), OutputHead.of(student, V)
    zs = torch.nn.functional.linear(hs.double(), s_head.weight.double())
    ht, y = scores.logits.hidden, targets[mask]
    with torch.no_grad():
        zt = torch.cat([scores.logits.head.logits(ht[i : i + 4]) for i in range(0, len(ht), 4)])
    a, bound_a = loss_bound("divergence", zs, linear_bound(hs, s_head.weight), zt, None, y, 0.5)
    b, bound_b = loss_bound("divergence", zs, linear_bound(hs, s_head.weight), t_logits[mask], None, y, 0.5)
    assert abs(value.item() - ref.item()) <= abs(a - b).item() + two_computations(bound_a, bound_b)
    assert scores.logits.hidden.dtype == torch.bfloat16 and torch.isfinite(scores.target_logprobs()).all()
