"""Losses from hidden states, chunk by chunk, against the logits path they replace (values and every gradient).

The reference is the pipeline's former path: ``model(...).logits`` then ``causal_lm_token_loss_sum`` /
``token_divergence`` / ``sampled_token_loss`` (themselves tested against torch.distributions and float64
formulas in test_divergences.py). fp32 on CPU: the loss to 1e-6 relative, every parameter's gradient (the tied
embedding included) to 1e-5 of its own max |value|.
"""

from __future__ import annotations

import random

import pytest
import torch

from ars_opd.lm.divergences import sampled_token_loss, token_divergence
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.losses import causal_lm_loss_from_hidden, causal_lm_token_loss_sum, cross_entropy_terms
from ars_opd.lm.objectives import TeacherLogits, TeacherScores, get_objective

V, ROWS = 53, 58  # scored vocabulary; output rows (5 padding rows beyond the tokenizer, as Qwen3 has)


def _model(family="llama", tied=True, seed=0, hidden=32, rows=ROWS, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = Qwen3Config if family == "qwen3" else LlamaConfig
    cfg = cls(vocab_size=rows, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, tie_word_embeddings=tied,
              max_position_embeddings=128)
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
        ids[i, :p + c] = torch.tensor([rng.randrange(V) for _ in range(p + c)])
        attn[i, :p + c] = 1
        labels[i, p:p + c] = ids[i, p:p + c]
        mask[i, p - 1:p + c - 1] = True
    targets = torch.roll(ids, -1, dims=1)
    return ids, attn, labels, mask, targets


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_close(loss, ref_loss, grads, ref_grads):
    assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        scale = ref.abs().max().item()
        assert scale > 0, name  # every parameter takes part
        err = (grads[name] - ref).abs().max().item()
        assert err <= 1e-5 * scale, (name, err, scale)


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
    _assert_close(loss.item(), ref.item(), _grads(model), _grads(ref_model))


def _opd_reference(student, teacher, ids, attn, mask, targets, loss, beta, tau):
    s_logits = student(input_ids=ids, attention_mask=attn).logits[..., :V]
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=attn).logits[..., :V]
    if loss == "full_vocab":
        value, _ = token_divergence(s_logits, t_logits, mask, beta, tau, chunk_size=7)
        return value
    logp = torch.log_softmax(t_logits.float() / tau, -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    surrogate, estimate, _ = sampled_token_loss(s_logits, logp, targets, mask, tau)
    return surrogate + (estimate - surrogate).detach()


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


@pytest.mark.parametrize("loss, beta", [("full_vocab", 0.0), ("full_vocab", 1.0), ("full_vocab", 0.3),
                                        ("full_vocab", 0.5), ("sampled_token", 1.0)])
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("tied", [True, False])
def test_opd_losses_from_hidden_equal_logits_path(loss, beta, tau, tied):
    ids, attn, _, mask, targets = _batch(seed=2)
    teacher = _model("qwen3", True, seed=7, hidden=48).eval()  # another width and family: only the vocabulary is shared
    ref_model, model = _model("llama", tied, seed=3), _model("llama", tied, seed=3)
    ref = _opd_reference(ref_model, teacher, ids, attn, mask, targets, loss, beta, tau)
    ref.backward()
    value, n, scores = _opd_chunked(model, teacher, ids, attn, mask, targets, loss, beta, tau, chunk=3)
    value.backward()
    assert n == int(mask.sum())
    grads, ref_grads = _grads(model), _grads(ref_model)
    out_rows = "lm_head.weight" if not tied else "model.embed_tokens.weight"
    assert grads[out_rows][V:].abs().max() == 0  # padding rows beyond the vocabulary take no part in the loss
    for g in (grads, ref_grads):  # ... and are compared over the vocabulary only (the reference slices the same way)
        g[out_rows] = g[out_rows][:V]
    _assert_close(value.item(), ref.item(), grads, ref_grads)
    with torch.no_grad():  # the logged teacher log-probability at tau = 1, for either kind of teacher signal
        t_logits = teacher(input_ids=ids, attention_mask=attn).logits[..., :V]
        logged = torch.log_softmax(t_logits.double(), -1).gather(-1, targets[..., None]).squeeze(-1)[mask]
    assert torch.allclose(scores.target_logprobs().double(), logged, atol=1e-5)


def test_bf16_weights_accumulate_in_fp32():
    """bf16 model: the chunked loss stays close to a float64 evaluation of the same bf16 hidden states and head,
    and no worse than the logits path (which rounds (tokens x vocabulary) logits to bf16)."""
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
    assert abs(loss.item() - oracle.item()) < 1e-3 * abs(oracle.item())
    for got, want in ((hidden.grad, h64.grad), (model.lm_head.weight.grad, w64.grad)):
        assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()
    naive = hidden.detach().requires_grad_(True)
    naive_loss, _ = causal_lm_token_loss_sum(naive @ head.weight.detach().T, labels)  # bf16 logits
    assert abs(loss.item() - oracle.item()) <= abs(naive_loss.item() - oracle.item()) + 1e-6 * abs(oracle.item())


def test_backward_scales_by_the_exact_upstream_factor_and_runs_once():
    torch.manual_seed(0)
    h = torch.randn(9, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    y = torch.randint(0, V, (9,))
    loss = chunked_head_loss(h, OutputHead(w, None), cross_entropy_terms(y), chunk_size=4)
    (loss * (1 / 3)).backward(retain_graph=True)
    h64, w64 = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    (torch.nn.functional.cross_entropy(h64 @ w64.T, y, reduction="sum") / 3).backward()
    assert torch.allclose(h.grad.double(), h64.grad, atol=1e-6) and torch.allclose(w.grad.double(), w64.grad, atol=1e-6)
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
    for got, want in zip((h, w, b), ref):
        assert torch.allclose(got.grad, want.grad, atol=1e-6)


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
    from ars_opd.training.opd import LocalTeacher

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
        ref, _ = token_divergence(student(input_ids=ids, attention_mask=attn).logits[..., :V], t_logits, mask, 0.5)
    assert abs(value.item() - ref.item()) < 1e-4 * abs(ref.item())
    assert scores.logits.hidden.dtype == torch.bfloat16 and torch.isfinite(scores.target_logprobs()).all()
