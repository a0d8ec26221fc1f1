"""The OPD options against the silent EOS collapse, each against an independent float64 oracle, and each shown to
change what trains (a test that passes without the option would prove nothing):

- ``truncated_rollouts: mask``: a cut rollout's tokens carry no loss and no gradient;
- ``truncated_rollouts: penalize``: a cut rollout's tokens gain the penalty c·log q(y), gradient c·(onehot − q);
- ``anchor: sft`` / ``forward_kl``: the teacher's completions of the step's prompts, trained beside the rollouts,
  weighted by anchor_weight over the rollouts' normaliser;
- ``loss: constant_advantage``: the policy gradient with a constant advantage (no teacher information).

The oracles are autograd over whole float64 logit tensors (``torch.distributions`` for the KLs); the pipeline's
values come from the chunked head loss in fp32, so each comparison's bound is the fp32 rounding of logits of this
size (``tolerances``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from ars_opd.config import ConfigError, OPDConfig, check_objective
from ars_opd.data import synthetic
from ars_opd.data.prompts import alpaca_messages, encode_prompts, encode_teacher_completions
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import TeacherScores, objective_for
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.opd.data import OPDData
from ars_opd.training.opd.task import ModelSizes, OPDTask, RolloutSetup
from ars_opd.training.opd.teachers import LocalTeacher
from ars_opd.training.worker import WorkerSetup
from tiny_models import tiny_llama

CPU = torch.device("cpu")
MAX_NEW = 6


def _model(vocab: int, seed: int, eos: int, pad: int):
    return tiny_llama(vocab, seed, eos, pad, head_scale=3.0)


def _task(tok, n: int = 8, **opd):
    rows = synthetic.generate(n, seed=3, tasks=("add", "reverse", "uppercase"))
    for r in rows:
        r["messages"] = alpaca_messages(r["instruction"], r["input"])
        r["reference"] = r["completion"] = r["output"]
        r["finish_reason"] = "stop"
    vocab = len(tok)
    student = _model(vocab, 1, tok.eos_token_id, tok.pad_token_id)
    teacher = _model(vocab, 11, tok.eos_token_id, tok.pad_token_id)
    prompts = encode_prompts(tok, [r["messages"] for r in rows])
    data = OPDData(prompts, encode_teacher_completions(tok, rows), [r["task"] for r in rows], {}, None)
    cfg = OPDConfig(
        global_batch_size=n, micro_batch_size=4, max_new_tokens=MAX_NEW, precision="fp32", **{"chunk_size": 5, **opd}
    )
    ctx = WorkerContext(rank=0, world_size=1, local_rank=0, device=CPU, backend="gloo")
    task = OPDTask(
        data,
        LocalTeacher(teacher, vocab),
        cfg,
        WorkerSetup(ctx, tok, BatchGeometry.check(n, 1, 4, "opd"), sampler_seed=3, stage_seed=4, fault=None),
        sizes=ModelSizes(1, 1),
        rollouts=RolloutSetup(eos_ids=(tok.eos_token_id,)),
    )
    return task, student, teacher


def _oracle_logits(model, t: dict, mask_key: str = "loss_mask", ids="input_ids", attn="attention_mask"):
    """float64 logits of ``model`` at the scored rows, from its fp32 hidden rows (the head product in float64)."""
    hidden = select_rows(last_hidden_states(model, t[ids], t[attn]), t[mask_key])
    head = OutputHead.of(model)
    return hidden.double() @ head.weight.double().T, hidden


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _loss_and_grad(task, student, batch):
    student.zero_grad(set_to_none=True)
    loss, metrics = task.loss_sum(student, batch)
    loss.backward()
    return float(loss.detach()), _grads(student).clone(), metrics


def _oracle_loss_and_grad(student, fn):
    """fn(student) -> a float64 scalar with autograd through the student's parameters (fp32 weights, the head
    product cast to float64); its value and its gradient."""
    student.zero_grad(set_to_none=True)
    value = fn(student)
    value.backward()
    return float(value.detach()), _grads(student).clone()


def _bound(*grads: torch.Tensor) -> float:
    """The fp32 rounding of gradients of this size: a relative 1e-4 of their largest entry (the chunked loss's
    fp32 products over hidden 32 and vocab ~140 against the oracle's float64 head; gamma of a few hundred terms is
    ~3e-5)."""
    return 1e-4 * max(float(g.abs().max()) for g in grads)


def _first_on_policy_batch(task, student, step: int = 0, mixed: bool = False):
    """The step's first micro-batch, its rollouts drawn after ``torch.manual_seed(seed)`` for the first seed from 0
    whose rollouts are some cut at MAX_NEW and some ended (``mixed``), else seed 0."""
    for seed in range(200):
        torch.manual_seed(seed)
        batch = task.micro_batches(step, student)[0]
        if not mixed:
            return batch
        flags = batch.tensors["overlong"]
        if bool(flags.any()) and not bool(flags.all()):
            return batch
    raise AssertionError("no seed below 200 gave both cut and ended rollouts")


@pytest.mark.parametrize("mode", ["mask", "penalize"])
def test_truncated_rollouts_against_autograd(char_tokenizer, mode):
    task, student, teacher = _task(char_tokenizer, truncated_rollouts=mode, overlong_penalty=0.3)
    batch = _first_on_policy_batch(task, student, mixed=True)
    t = batch.tensors
    cut = t["overlong"]
    assert bool(cut.any()) and not bool(cut.all())  # MAX_NEW = 6 cuts some rollouts and not others
    got_loss, got_grad, _ = _loss_and_grad(task, student, batch)
    row_of = t["loss_mask"].nonzero()[:, 0]
    with torch.no_grad():
        zt, _ = _oracle_logits(teacher, t)
    targets = t["targets"][t["loss_mask"]]

    def oracle(model):
        zs, _ = _oracle_logits(model, t)
        kl = kl_divergence(Categorical(logits=zs), Categorical(logits=zt))  # reverse KL per row
        flags = cut[row_of].double()
        if mode == "mask":
            return (kl * (1 - flags)).sum()
        logq = torch.log_softmax(zs, -1).gather(-1, targets[:, None]).squeeze(-1)
        return kl.sum() + (0.3 * flags * logq).sum()

    want_loss, want_grad = _oracle_loss_and_grad(student, oracle)
    assert got_loss == pytest.approx(want_loss, rel=1e-4)
    assert (got_grad - want_grad).abs().max() <= _bound(want_grad)
    # and without the option the same rollouts train something else
    task.cfg = dataclasses.replace(task.cfg, truncated_rollouts="keep")
    keep_batch = dataclasses.replace(batch, tensors={k: v for k, v in t.items() if k != "overlong"})
    _, keep_grad, _ = _loss_and_grad(task, student, keep_batch)
    assert (keep_grad - got_grad).abs().max() > 100 * _bound(want_grad)


@pytest.mark.parametrize("anchor", ["sft", "forward_kl"])
@pytest.mark.parametrize("normalisation", ["token", "sequence"])
def test_anchor_against_a_separate_forward(char_tokenizer, anchor, normalisation):
    """The rollouts' reverse KL plus anchor_weight × (CE, or KL(p ‖ q)) on the teacher's completions of the same
    prompts, each side from its own float64-headed forward, equals the joint forward's loss and gradient."""
    w = 0.7
    task, student, teacher = _task(char_tokenizer, anchor=anchor, anchor_weight=w, loss_normalisation=normalisation)
    batch = _first_on_policy_batch(task, student)
    t = batch.tensors
    assert "anchor_input_ids" in t
    got_loss, got_grad, metrics = _loss_and_grad(task, student, batch)
    with torch.no_grad():
        zt, _ = _oracle_logits(teacher, t)
        zt_anchor, _ = _oracle_logits(teacher, t, "anchor_mask", "anchor_input_ids", "anchor_attention_mask")
    a_targets = t["anchor_targets"]

    def per_row_weights(mask):
        length = mask.sum(1, keepdim=True).expand_as(mask)[mask].double()
        return 1.0 / length if normalisation == "sequence" else torch.ones_like(length)

    def oracle(model):
        zs, _ = _oracle_logits(model, t)
        rollouts = kl_divergence(Categorical(logits=zs), Categorical(logits=zt)) * per_row_weights(t["loss_mask"])
        za, _ = _oracle_logits(model, t, "anchor_mask", "anchor_input_ids", "anchor_attention_mask")
        if anchor == "sft":
            a = -torch.log_softmax(za, -1).gather(-1, a_targets[:, None]).squeeze(-1)
        else:
            a = kl_divergence(Categorical(logits=zt_anchor), Categorical(logits=za))
        return rollouts.sum() + w * (a * per_row_weights(t["anchor_mask"])).sum()

    want_loss, want_grad = _oracle_loss_and_grad(student, oracle)
    assert got_loss == pytest.approx(want_loss, rel=1e-4)
    assert (got_grad - want_grad).abs().max() <= _bound(want_grad)
    assert metrics["anchor_loss"][1] == int(t["anchor_mask"].sum())
    # the anchor rows are the teacher's cached completions (cut at max_new_tokens) of the batch's own prompts
    prompt_len = t["anchor_mask"].float().argmax(1) + 1
    for i in range(t["anchor_input_ids"].shape[0]):
        row = t["anchor_input_ids"][i, : prompt_len[i]].tolist()
        j = task.prompts.index(row)
        n = int(t["anchor_mask"][i].sum())
        assert t["anchor_targets"][t["anchor_mask"].nonzero()[:, 0] == i].tolist() == task.teacher_completions[j][:n]
    # the budget counts the anchor rows' forward and backward (and, for forward_kl, the teacher's forward): with
    # one parameter each, 6 (+ 2) FLOPs per anchor token over the same rollouts without an anchor
    plain, s2, _ = _task(char_tokenizer, loss_normalisation=normalisation)
    anchor_real = int(t["anchor_attention_mask"].sum())
    per_token = 6 + (2 if anchor == "forward_kl" else 0)
    assert batch.flops - _first_on_policy_batch(plain, s2).flops == per_token * anchor_real


def test_constant_advantage_is_a_policy_gradient_with_that_advantage(char_tokenizer):
    """The update carries no teacher information: its gradient is c·(q − onehot(y)) summed over the sampled rows,
    whatever the teacher says; the logged value is the sampled reverse-KL estimate log q(y) − log p_T(y)."""
    c = -0.8
    cfg = OPDConfig(loss="constant_advantage", constant_advantage=c, precision="fp32")
    objective = objective_for(cfg)
    torch.manual_seed(0)
    V, H, M = len(char_tokenizer), 8, 9
    hidden = torch.randn(M, H, requires_grad=True)
    head = OutputHead(torch.randn(V, H, requires_grad=True), None)
    targets = torch.randint(0, V, (M,))
    for teacher_lp in (torch.randn(M), torch.randn(M) - 5):  # two teachers: the same gradient
        hidden.grad = None
        record = torch.empty(M)
        loss, _ = objective.loss(
            hidden, head, TeacherScores(token_logprobs=teacher_lp), targets, 1.0, 1.0, 4, record=record
        )
        loss.backward()
        z = hidden.detach().double() @ head.weight.detach().double().T
        z.requires_grad_(True)
        logq = torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1)
        (-c * logq).sum().backward()
        want = z.grad @ head.weight.detach().double()
        assert (hidden.grad.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert torch.allclose(record.double(), logq.detach() - teacher_lp.double(), atol=1e-5)


def test_the_option_refusals():
    with pytest.raises(ConfigError, match="opd.anchor"):
        check_objective(OPDConfig(anchor="forward_kl", teacher="endpoint", loss="sampled_token"))
    with pytest.raises(ConfigError, match="opd.anchor"):
        check_objective(OPDConfig(anchor="sft", cross_tokenizer=True, loss="sampled_token"))
    with pytest.raises(ConfigError, match="opd.loss"):
        check_objective(OPDConfig(loss="constant_advantage", cross_tokenizer=True))
    with pytest.raises(ConfigError, match="overlong_penalty"):
        OPDConfig(overlong_penalty=-1.0)
    check_objective(OPDConfig(anchor="sft", teacher="endpoint", loss="sampled_token"))  # an endpoint's sft anchor


@pytest.mark.slow
def test_the_stage_trains_with_the_options(tmp_path):
    """The opd stage end to end (two workers) with penalize and the sft anchor: the columns are logged."""
    from micro import distill_workspace, run_opd_in

    REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
    distill_workspace(
        REPO, tmp_path, {"steps": 3, "truncated_rollouts": "penalize", "anchor": "sft", "anchor_weight": 0.5}
    )
    steps, summary, _ = run_opd_in(tmp_path)
    assert len(steps) == 3 and all(r["task/anchor_loss"] > 0 for r in steps)
    assert all(abs(r["loss"]) < 1e6 for r in steps)


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
def test_teacher_temperature_against_autograd(beta):
    """``opd.teacher_temperature``: the divergence against p = softmax(z_T / τ_T) (here sharpened, τ_T = 0.5), value
    and gradient in the student's logits, against float64 autograd of the textbook formula; with τ_T = τ it is the
    plain divergence, and the sharpened one differs from it."""
    from ars_opd.lm.divergences import divergence_terms
    from oracles import divergence

    torch.manual_seed(1)
    zs, zt = torch.randn(7, 30) * 3, torch.randn(7, 30) * 3
    tau_t = 0.5
    value, grad = divergence_terms(lambda a, b: zt.clone(), beta, 1.0, tau_t)(zs.clone(), 0, 7, True)
    z = zs.double().requires_grad_(True)
    # the oracle's teacher logits scaled to τ_T: softmax(zt / τ_T) is softmax((zt / τ_T) / 1)
    want = divergence(z, zt.double() / tau_t, beta, 1.0)
    want.sum().backward()
    assert torch.allclose(value.double(), want.detach(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(grad.double(), z.grad, rtol=1e-4, atol=1e-5)
    plain, _ = divergence_terms(lambda a, b: zt.clone(), beta, 1.0)(zs.clone(), 0, 7, False)
    same, _ = divergence_terms(lambda a, b: zt.clone(), beta, 1.0, 1.0)(zs.clone(), 0, 7, False)
    assert torch.equal(plain, same) and not torch.allclose(plain, value)


def test_teacher_temperature_reaches_the_stage_objective_and_is_refused_elsewhere(char_tokenizer):
    task, student, _ = _task(char_tokenizer, teacher_temperature=0.5)
    plain, s2, _ = _task(char_tokenizer)
    a, b = _first_on_policy_batch(task, student), _first_on_policy_batch(plain, s2)
    assert torch.equal(a.tensors["input_ids"], b.tensors["input_ids"])  # the same rollouts
    assert _loss_and_grad(task, student, a)[0] != pytest.approx(_loss_and_grad(plain, s2, b)[0], rel=1e-3)
    with pytest.raises(ConfigError, match="teacher_temperature"):
        check_objective(OPDConfig(teacher_temperature=0.5, loss="sampled_token"))
    with pytest.raises(ConfigError, match="teacher_temperature"):
        check_objective(OPDConfig(teacher_temperature=0.5, teacher="endpoint", loss="topk"))
