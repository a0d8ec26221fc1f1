"""Cross-tokenizer OPD's losses against independent oracles.

- With identical tokenizers and canonical completions every span is one token on both sides, and the
  cross-tokenizer sampled-token loss is the same-tokenizer one: equal values, gradients equal to a bound derived
  from fp32 rounding of the student's log-probabilities (the only quantity the two paths compute differently).
- With two different tokenizers, each sequence's summed loss is log q(student's tokens) − log p(teacher's tokens
  of the same text), recomputed here in float64 from whole-sequence forwards of both models.
- The cross_vocab loss and its gradient against torch.distributions (KL over the shared tokens plus the rest
  bucket) and a sort-based ULD written here, by autograd in float64; and 0 for a student that is the teacher.
"""

from __future__ import annotations

import math

import pytest
import torch

from ars_opd.config import OPDConfig
from ars_opd.data import synthetic
from ars_opd.lm.batching import build_rollout_batch, pad_token_id
from ars_opd.lm.divergences import cross_vocab_terms
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import get_objective, objective_for
from ars_opd.lm.token_alignment import CrossTokenizer
from ars_opd.models.builtin import build_causal_lm
from ars_opd.models.tokenizer import build_char_word_tokenizer
from ars_opd.training.opd.cross_teacher import CrossTokenizerTeacher, TeacherSide, shared_vocabulary
from ars_opd.training.opd.teachers import LocalTeacher
from tiny_models import TINY

EPS32 = torch.finfo(torch.float32).eps
TEXTS = ["12+7=19", "The answer is 42.", "abc cba", "Reverse: dcba", "  spaced  out ", "", "uppercase ABC"]
MESSAGES = [[{"role": "user", "content": f"Question {i}: add 3 and 4"}] for i in range(len(TEXTS))]


def _tok(extra_words=()):
    return build_char_word_tokenizer(list(synthetic.instruction_words()) + list(extra_words))


def _models(student_tok, teacher_tok, seed=0):
    student = build_causal_lm(TINY, student_tok, seed=seed).float()
    teacher = build_causal_lm(TINY, teacher_tok, seed=seed + 1).float().eval()
    return student, teacher


def _prompts(tok):
    return [list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)["input_ids"]) for m in MESSAGES]


def _batch(student_tok, completions_text, ended=True):
    prompts = _prompts(student_tok)
    eos = student_tok.eos_token_id
    comps = [student_tok(t, add_special_tokens=False)["input_ids"] + ([eos] if ended else []) for t in completions_text]
    b = build_rollout_batch(prompts, comps, pad_token_id(student_tok), eos)
    b["row_index"] = torch.arange(len(prompts))
    return b, prompts, comps


def _cross_teacher(student_tok, teacher_tok, teacher):
    cross = CrossTokenizer(student_tok, teacher_tok, [student_tok.eos_token_id], teacher_tok.eos_token_id)
    side = TeacherSide(_prompts(teacher_tok), len(teacher_tok), pad_token_id(teacher_tok))
    return CrossTokenizerTeacher(cross, side, len(student_tok), model=teacher, chunk_size=5)


def _loss_and_grads(student, tok, batch, teacher_obj, loss="sampled_token", chunk=5, objective=None):
    objective = objective or get_objective(loss)
    student.zero_grad()
    mask = batch["loss_mask"]
    hidden = select_rows(last_hidden_states(student, batch["input_ids"], batch["attention_mask"]), mask)
    scores = teacher_obj.score(batch, objective, 1.0)
    head = OutputHead.of(student, len(tok))
    record = torch.empty(hidden.shape[0])
    total, _ = objective.loss(hidden, head, scores, batch["targets"][mask], 1.0, 1.0, chunk, record=record)
    total.backward()
    return total.detach(), record, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


def test_identical_tokenizers_cross_sampled_token_equals_the_same_tokenizer_loss():
    tok = _tok()
    student, teacher = _models(tok, tok)
    batch, _, _ = _batch(tok, TEXTS)
    cross = _cross_teacher(tok, tok, teacher)
    cross.attach([batch], get_objective("sampled_token"))
    assert int(batch["unaligned"]) == 0
    # every span is one token on each side: the alignment is the identity
    assert batch["student_span"].tolist() == list(range(int(batch["n_spans"])))
    assert batch["teacher_span"].tolist() == list(range(int(batch["n_spans"])))
    v_cross, rec_cross, g_cross = _loss_and_grads(student, tok, batch, cross)
    v_same, rec_same, g_same = _loss_and_grads(student, tok, batch, LocalTeacher(teacher, len(tok), chunk_size=5))
    assert torch.equal(rec_cross, rec_same)  # the same formula on the same logits
    assert v_cross == v_same
    # the gradients differ only through the credit log q(y) - log p(y): log q from a separate no-grad pass
    # (gather - logsumexp) against the loss's in-place log-softmax; each is within a few ulp of |z| + log V
    with torch.no_grad():
        mask = batch["loss_mask"]
        hidden = select_rows(last_hidden_states(student, batch["input_ids"], batch["attention_mask"]), mask)
        z = OutputHead.of(student, len(tok)).logits(hidden)
    delta = 8 * EPS32 * (float(z.abs().max()) + math.log(len(tok)))  # per-row credit difference bound
    # each row's gradient is credit_m * J_m with J_m = d log q(y_m) / d theta, the same on both paths: so the
    # gradients differ by at most delta * sum_m |J_m| (entrywise), plus fp32 rounding of the sums over rows
    logq = torch.log_softmax(z, -1).gather(-1, batch["targets"][mask][:, None]).squeeze(-1)
    names, params = zip(*[(n, p) for n, p in student.named_parameters() if n in g_same])
    jac = {n: torch.zeros_like(p) for n, p in zip(names, params)}
    hidden_g = select_rows(last_hidden_states(student, batch["input_ids"], batch["attention_mask"]), mask)
    logq_g = torch.log_softmax(OutputHead.of(student, len(tok)).logits(hidden_g), -1)
    logq_g = logq_g.gather(-1, batch["targets"][mask][:, None]).squeeze(-1)
    for m in range(logq_g.shape[0]):
        for n, gm in zip(names, torch.autograd.grad(logq_g[m], params, retain_graph=True)):
            jac[n] += gm.abs()
    for name, g in g_same.items():
        bound = delta * jac[name] + 8 * EPS32 * logq.shape[0] * float(g.abs().max())
        assert torch.all((g_cross[name] - g).abs() <= bound), name


def _seq_logprobs64(model, prompt, completion):
    """log p of ``completion`` after ``prompt`` from one float64 forward: whole-sequence log-softmax, gathered."""
    m = model.double()
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = m(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    out = sum(float(lp[n - 1 + i, c]) for i, c in enumerate(completion))
    model.float()
    return out


def test_different_tokenizers_each_sequence_sums_to_the_whole_sequence_log_ratio():
    student_tok = _tok()
    teacher_tok = _tok(["answer", "Reverse", "spaced", "cba", "ABC"])  # other whole words: other tokenisations
    assert student_tok.get_vocab() != teacher_tok.get_vocab()
    student, teacher = _models(student_tok, teacher_tok, seed=3)
    batch, s_prompts, comps = _batch(student_tok, TEXTS)
    cross = _cross_teacher(student_tok, teacher_tok, teacher)
    cross.attach([batch], get_objective("sampled_token"))
    assert int(batch["unaligned"]) == 0
    assert int(batch["n_spans"]) < int(batch["loss_mask"].sum())  # some spans hold several tokens
    _, record, _ = _loss_and_grads(student, student_tok, batch, cross)
    t_prompts = _prompts(teacher_tok)
    rows = batch["loss_mask"].sum(1).tolist()
    start = 0
    for b, n in enumerate(rows):
        text_ids = teacher_tok(TEXTS[b], add_special_tokens=False)["input_ids"] + [teacher_tok.eos_token_id]
        want = _seq_logprobs64(student, s_prompts[b], comps[b]) - _seq_logprobs64(teacher, t_prompts[b], text_ids)
        got = float(record[start : start + n].double().sum())
        # fp32 per-token log-probs, each within ~n_layers * few ulp of its magnitude; summed over both sides
        tokens = n + len(text_ids)
        bound = 64 * EPS32 * tokens * (abs(want) + math.log(len(student_tok)) + 10)
        assert abs(got - want) <= bound, (b, got, want, bound)
        start += n


def test_the_cross_path_of_a_student_that_is_the_teacher_is_zero():
    tok = _tok()
    student, _ = _models(tok, tok)
    teacher = build_causal_lm(TINY, tok, seed=0).float().eval()
    teacher.load_state_dict(student.state_dict())
    batch, _, _ = _batch(tok, TEXTS)
    cross = _cross_teacher(tok, tok, teacher)
    for loss in ("sampled_token", "cross_vocab"):
        cross.attach([batch], get_objective(loss))
        total, record, _ = _loss_and_grads(student, tok, batch, cross, loss=loss)
        assert float(record.abs().max()) < 1e-4, loss


def _cross_vocab_oracle64(zs, zt, shared_s, shared_t, beta):
    """KL(q̄ ‖ p̄) (β = 1) or KL(p̄ ‖ q̄) (β = 0) over shared tokens + the rest bucket by torch.distributions,
    plus the L1 distance of the sorted unshared probabilities, in float64."""
    q, p = torch.softmax(zs.double(), -1), torch.softmax(zt.double(), -1)
    qs, ps = q[:, shared_s], p[:, shared_t]
    q_bar = torch.cat([qs, (1 - qs.sum(-1, keepdim=True)).clamp(min=0)], -1)
    p_bar = torch.cat([ps, (1 - ps.sum(-1, keepdim=True)).clamp(min=0)], -1)
    Q, P = torch.distributions.Categorical(probs=q_bar), torch.distributions.Categorical(probs=p_bar)
    kl = torch.distributions.kl_divergence(Q, P) if beta == 1.0 else torch.distributions.kl_divergence(P, Q)
    rest_s = [i for i in range(zs.shape[-1]) if i not in set(shared_s.tolist())]
    rest_t = [i for i in range(zt.shape[-1]) if i not in set(shared_t.tolist())]
    qr = torch.sort(q[:, rest_s], -1, descending=True).values
    pr = torch.sort(p[:, rest_t], -1, descending=True).values
    w = max(qr.shape[-1], pr.shape[-1])
    qr = torch.nn.functional.pad(qr, (0, w - qr.shape[-1]))
    pr = torch.nn.functional.pad(pr, (0, w - pr.shape[-1]))
    return kl + (qr - pr).abs().sum(-1)


@pytest.mark.parametrize("beta", [1.0, 0.0])
def test_cross_vocab_value_and_gradient_match_a_float64_oracle(beta):
    g = torch.Generator().manual_seed(0)
    M, H, VS, VT = 7, 12, 40, 25
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64)
    weight = torch.randn(VS, H, generator=g, dtype=torch.float64) * 0.7
    zt = torch.randn(M, VT, generator=g) * 2
    shared_s, shared_t = torch.tensor([0, 3, 5, 9, 17, 30]), torch.tensor([2, 0, 7, 11, 4, 20])
    rows = torch.tensor([0, -1, 1, 2, -1, 3, 4])  # rows 1 and 4 start no span: no loss there
    head = OutputHead(weight.float().clone().requires_grad_(True), None)
    h32 = hidden.float().clone().requires_grad_(True)
    terms = cross_vocab_terms(lambda idx: zt[torch.tensor([0, 2, 3, 5, 6])][idx], rows, shared_s, shared_t, beta)
    total = chunked_head_loss(h32, head, terms, chunk_size=3)
    total.backward()
    # oracle: the same rows in float64 through autograd of the formula written from the definitions
    h64 = hidden.clone().requires_grad_(True)
    w64 = weight.clone().requires_grad_(True)
    sel = torch.tensor([0, 2, 3, 5, 6])
    zs = h64[sel] @ w64.T
    want = _cross_vocab_oracle64(zs, zt[sel].double(), shared_s, shared_t, beta).sum()
    want.backward()
    # fp32 rounding bound: every row sums n_terms terms (both vocabularies, the shared set and its bucket), each
    # within a few ulp of the logits' scale (max |z| + log V); summed over the rows that carry a loss
    n_terms = VS + VT + len(shared_s) + 1
    scale = float(zs.detach().abs().max()) + float(zt.abs().max()) + math.log(VS)
    bound = 8 * EPS32 * n_terms * scale * len(sel)
    want = float(want.detach())
    assert abs(float(total.detach()) - want) <= bound, (float(total.detach()), want, bound)
    for got, ref in ((h32.grad, h64.grad), (head.weight.grad, w64.grad)):
        gscale = float(ref.abs().max()) + float(hidden.abs().max()) * float(weight.abs().max())
        assert float((got.double() - ref).abs().max()) <= 8 * EPS32 * n_terms * scale * gscale
    assert torch.all(h32.grad[[1, 4]] == 0)


def test_shared_vocabulary_matches_tokens_by_their_text():
    a, b = _tok(), _tok(["answer"])
    ids_a, ids_b = shared_vocabulary(a, b, len(a), len(b))
    for i, j in zip(ids_a.tolist(), ids_b.tolist()):
        assert a.decode([i]) == b.decode([j])
    assert "answer" not in {a.decode([i]) for i in ids_a.tolist()}  # a word only one side has
    specials = set(a.all_special_ids)
    assert not specials & set(ids_a.tolist())


def test_special_tokens_never_enter_the_shared_vocabulary():
    """Every added special token (not only the tokenizer's named bos/eos/pad/unk) is kept out: two tokenizers that
    both spell "<file_sep>" as one special token must not have it compared as text."""
    from tokenizers import AddedToken

    a, b = _tok(), _tok(["answer"])
    for t in (a, b):
        t.add_tokens([AddedToken("<file_sep>", special=True)])  # special, but not among the named ones
    ids_a, _ = shared_vocabulary(a, b, len(a), len(b))
    assert a.convert_tokens_to_ids("<file_sep>") not in set(ids_a.tolist())


def test_span_credit_gradient_matches_autograd_of_the_span_surrogate():
    """Different tokenizers, so spans of several tokens: the gradient is that of sum_s sg(d_s) * sum_{t in s} log q(y_t)
    (autograd in float64 on a copy of the student), not the per-token log-ratio's (which gives the same values)."""
    student_tok = _tok()
    teacher_tok = _tok(["answer", "Reverse", "spaced", "cba", "ABC"])
    student, teacher = _models(student_tok, teacher_tok, seed=5)
    batch, _, _ = _batch(student_tok, TEXTS)
    cross = _cross_teacher(student_tok, teacher_tok, teacher)
    cross.attach([batch], get_objective("sampled_token"))
    spans = batch["student_span"]
    assert int(torch.bincount(spans[spans >= 0]).max()) > 1  # some span holds several student tokens
    _, _, grads = _loss_and_grads(student, student_tok, batch, cross)
    # the oracle: the teacher's span log-probabilities from its own forward (float64), the student's log q in float64
    s64 = build_causal_lm(TINY, student_tok, seed=0).double()
    s64.load_state_dict(student.state_dict())
    mask = batch["loss_mask"]
    logits = s64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logq = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    logq = torch.cat([logq, logq.new_zeros(logq.shape[0], 1)], 1)[mask]  # position t predicts token t + 1
    scores = cross.score(batch, get_objective("sampled_token"), 1.0)
    n_spans = int(batch["n_spans"])
    q_span = torch.zeros(n_spans, dtype=torch.float64).index_add(0, spans, logq.detach())
    d = q_span - scores.span_logprobs.double()
    surrogate = (d[spans].detach() * logq).sum()
    surrogate.backward()
    for name, p in s64.named_parameters():
        ref = p.grad
        got = grads[name].double()
        # fp32 against float64: each row's gradient within a few ulp of fp32 of its own size, over M rows
        bound = 64 * EPS32 * logq.shape[0] * (float(ref.abs().max()) + float(d.abs().max()))
        assert float((got - ref).abs().max()) <= bound, name


def test_the_span_baseline_reaches_the_objective_through_the_cross_teacher():
    """``opd.span_baseline: leave_one_out`` through the teacher and the stage's objective (``objective_for``): the
    teacher gives each scored token's rollout, and the gradient is autograd's of Σ_t sg(d_s − b_i)·log q(y_t) in
    float64, b_i the mean credit of the other rollouts' aligned tokens (tests/test_span_baseline.py checks the terms
    against derived bounds; here the plumbing, at the neighbouring test's bound)."""
    student_tok = _tok()
    teacher_tok = _tok(["answer", "Reverse", "spaced", "cba", "ABC"])
    student, teacher = _models(student_tok, teacher_tok, seed=5)
    batch, _, _ = _batch(student_tok, TEXTS)
    cross = _cross_teacher(student_tok, teacher_tok, teacher)
    cfg = OPDConfig(cross_tokenizer=True, loss="sampled_token", span_baseline="leave_one_out", micro_batch_size=4)
    objective = objective_for(cfg)
    cross.attach([batch], objective)
    mask = batch["loss_mask"]
    scores = cross.score(batch, objective, 1.0)
    assert torch.equal(scores.sequence_index, mask.nonzero()[:, 0])
    _, _, grads = _loss_and_grads(student, student_tok, batch, cross, objective=objective)
    _, _, plain = _loss_and_grads(student, student_tok, batch, cross)
    s64 = build_causal_lm(TINY, student_tok, seed=0).double()
    s64.load_state_dict(student.state_dict())
    logits = s64(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logq = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    logq = torch.cat([logq, logq.new_zeros(logq.shape[0], 1)], 1)[mask]
    spans, seq = scores.span_index, scores.sequence_index
    aligned = spans >= 0
    d = torch.zeros(int(batch["n_spans"]), dtype=torch.float64).index_add(0, spans[aligned], logq.detach()[aligned])
    d = d - scores.span_logprobs.double()
    credit = torch.where(aligned, d[spans.clamp(min=0)], 0.0)
    b = torch.stack([credit[(seq != i) & aligned].mean() for i in seq.tolist()])
    c = torch.where(aligned, credit - b, 0.0)
    (c.detach() * logq).sum().backward()
    moved = 0.0
    for name, p in s64.named_parameters():
        got = grads[name].double()
        bound = 64 * EPS32 * logq.shape[0] * (float(p.grad.abs().max()) + float(c.abs().max()))
        assert float((got - p.grad).abs().max()) <= bound, name
        moved = max(moved, float((got - plain[name].double()).abs().max()) / bound)
    assert moved > 10  # the baseline-free gradient is another one


def test_a_micro_batch_with_no_span_trains_nothing_and_does_not_fail():
    """Every row's completion is special tokens alone (they decode to no text), cut before any end: no span at all.
    The loss and its gradient are 0, not an index error."""
    student_tok = _tok()
    teacher_tok = _tok()
    student, teacher = _models(student_tok, teacher_tok, seed=2)
    unk = student_tok.convert_tokens_to_ids("<|unk|>")
    prompts = _prompts(student_tok)[:2]
    comps = [[unk, unk], [unk]]
    b = build_rollout_batch(prompts, comps, pad_token_id(student_tok), student_tok.eos_token_id)
    b["row_index"] = torch.arange(2)
    cross = _cross_teacher(student_tok, teacher_tok, teacher)
    for loss in ("sampled_token", "cross_vocab"):
        cross.attach([b], get_objective(loss))
        assert int(b["n_spans"]) == 0 and int(b["unaligned"]) == 3
        total, record, grads = _loss_and_grads(student, student_tok, b, cross, loss=loss)
        assert float(total) == 0.0 and float(record.abs().max()) == 0.0
        assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_the_teachers_end_token_is_what_its_template_writes_after_an_answer():
    """Gemma ends a turn with <end_of_turn> and Phi-3 with <|end|>, neither its eos_token: the end span pairs the
    student's EOS with the token the teacher's own template writes after the assistant's content."""
    from ars_opd.lm.token_alignment import teacher_end_id

    tok = _tok()
    assert teacher_end_id(tok) == tok.eos_token_id  # ChatML: <|im_end|> is both
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    assert teacher_end_id(tok) == tok.convert_tokens_to_ids("<|endoftext|>") != tok.eos_token_id
