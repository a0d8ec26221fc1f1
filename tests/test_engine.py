"""The training engine: loss normalisation invariance (gloo DDP), masking, packing, clipping, batching."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from ars_opd.config import SFTConfig, TrainLoopConfig, parse_section
from ars_opd.lm.batching import IGNORE_INDEX, pack_sequences, pad_right_with_labels
from ars_opd.lm.cross_entropy import causal_lm_token_loss_sum
from ars_opd.training.batch_plan import BatchConfigError, BatchGeometry, epoch_shard, step_indices
from ars_opd.training.checkpoint import TrainerState
from ars_opd.training.distributed import launch
from ars_opd.training.loop import NonFiniteError, Trainer
from ars_opd.training.sft import encode_sft_rows
from ddp_probe import grad_probe, tiny_model
from tolerances import chain_bound, decoder_lengths, forward_bound, gamma, softmax_length, two_computations


def _ragged_batch(tokenizer, n=8, seed=0):
    rng = random.Random(seed)
    prompts, completions = [], []
    for i in range(n):
        prompts.append([rng.randrange(4, len(tokenizer)) for _ in range(rng.randint(3, 14))])
        completions.append([rng.randrange(4, len(tokenizer)) for _ in range(rng.randint(1, 9))])
    return prompts, completions


def _oracle(tokenizer, prompts, completions):
    """Loss and gradients of the global token mean, computed one sequence at a time (no padding, no DDP), and
    the largest |logit|."""
    model = tiny_model(tokenizer)
    total, n_tok, top = 0.0, 0, 0.0
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]  # positions predicting the completion
        total = total + torch.nn.functional.cross_entropy(logits.float(), torch.tensor(c), reduction="sum")
        n_tok += len(c)
        top = max(top, logits.abs().max().item())
    loss = total / n_tok
    loss.backward()
    return loss.item(), n_tok, {n: p.grad.clone() for n, p in model.named_parameters()}, top


@pytest.mark.ddp
@pytest.mark.slow
def test_loss_and_gradients_invariant_to_worker_and_accumulation_split(char_tokenizer):
    prompts, completions = _ragged_batch(char_tokenizer)
    ref_loss, ref_tokens, ref_grads, top_logit = _oracle(char_tokenizer, prompts, completions)
    job = {"prompts": prompts, "completions": completions}
    runs = {
        "1x8": launch(grad_probe, {**job, "micro": 8}, workers=1),
        "2x4": launch(grad_probe, {**job, "micro": 4}, workers=2),
        "2x2xaccum2": launch(grad_probe, {**job, "micro": 2}, workers=2),
        "2x1xaccum4 no bucket view": launch(grad_probe, {**job, "micro": 1, "bucket_view": False}, workers=2),
        "2x4 packed": launch(grad_probe, {**job, "micro": 4, "packing": True, "pack_length": 32}, workers=2),
        "2x4 fsdp": launch(grad_probe, {**job, "micro": 4, "strategy": "fsdp"}, workers=2),
        "2x2xaccum2 fsdp": launch(grad_probe, {**job, "micro": 2, "strategy": "fsdp"}, workers=2),
        "2x2xaccum2 fsdp, gathered layers kept": launch(
            grad_probe, {**job, "micro": 2, "strategy": "fsdp", "reshard_after_forward": False}, workers=2
        ),
    }
    kept, freed = runs["2x2xaccum2 fsdp, gathered layers kept"], runs["2x2xaccum2 fsdp"]
    # keeping the gathered weights from forward to backward changes when they are gathered, not their values
    assert kept["loss"] == freed["loss"] and all(torch.equal(kept["grads"][n], g) for n, g in freed["grads"].items())
    assert runs["2x2xaccum2"]["n_micro"] == 2 and runs["2x1xaccum4 no bucket view"]["n_micro"] == 4
    assert runs["2x2xaccum2 fsdp"]["n_micro"] == 2
    # two fp32 computations of one loss and gradient (other batch shapes, padding, packing, sums over workers
    # and micro-batches): the chain of the decoder's forward (rows up to the 32-token pack), the head, the
    # log-softmax, the sum over the tokens, and for the gradients the backward, the sum over every position
    # and the 8 micro-batch gradients; each relative to the value's own size
    cfg, V = tiny_model(char_tokenizer).config, len(char_tokenizer)
    forward = decoder_lengths(cfg, 32) + [cfg.hidden_size, softmax_length(V, top_logit), ref_tokens]
    backward = forward + decoder_lengths(cfg, 32) + [sum(map(len, prompts + completions)), 8]
    for name, r in runs.items():
        assert r["tokens"] == ref_tokens, name
        loss_tol = two_computations(chain_bound(forward, ref_loss))
        assert abs(r["loss"] - ref_loss) <= loss_tol, (name, r["loss"], ref_loss, loss_tol)
        for pname, g in ref_grads.items():
            err = (r["grads"][pname] - g).abs().max().item()
            assert err <= two_computations(chain_bound(backward, g.abs().max().item())), (name, pname, err)


@pytest.mark.ddp
def test_per_sequence_normalisation_is_the_mean_of_sequence_means_whatever_the_split(char_tokenizer):
    """``MicroBatch.units`` (OPD's ``loss_normalisation: sequence``): the engine divides by the global count of
    sequences, so the reduced gradient is that of the mean over sequences of each one's token mean, whatever the
    split into workers and micro-batches; against an oracle computed one sequence at a time."""
    prompts, completions = _ragged_batch(char_tokenizer)
    model = tiny_model(char_tokenizer)
    means, top = [], 0.0
    for p, c in zip(prompts, completions):
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1]
        means.append(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(c)))
        top = max(top, logits.abs().max().item())
    ref = torch.stack(means).mean()
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    token_mean = _oracle(char_tokenizer, prompts, completions)[0]
    job = {"prompts": prompts, "completions": completions, "per_sequence": True}
    runs = {
        "1x8": launch(grad_probe, {**job, "micro": 8}, workers=1),
        "2x4": launch(grad_probe, {**job, "micro": 4}, workers=2),
        "2x2xaccum2": launch(grad_probe, {**job, "micro": 2}, workers=2),
    }
    # the same chain as the token-mean test's (the per-sequence sums are over fewer terms than the whole batch's)
    cfg, V, n_tok = model.config, len(char_tokenizer), sum(map(len, completions))
    forward = decoder_lengths(cfg, 32) + [cfg.hidden_size, softmax_length(V, top), n_tok]
    backward = forward + decoder_lengths(cfg, 32) + [sum(map(len, prompts + completions)), 8]
    loss_tol = two_computations(chain_bound(forward, ref.item()))
    # the instrument sees the normalisation: the ragged lengths (1 to 9 tokens) part the two means
    assert abs(token_mean - ref.item()) > 2 * loss_tol, (token_mean, ref.item(), loss_tol)
    for name, r in runs.items():
        assert r["units"] == len(prompts) and r["tokens"] == n_tok, name
        assert abs(r["loss"] - ref.item()) <= loss_tol, (name, r["loss"], ref.item(), loss_tol)
        for pname, g in ref_grads.items():
            err = (r["grads"][pname] - g).abs().max().item()
            assert err <= two_computations(chain_bound(backward, g.abs().max().item())), (name, pname, err)


def test_prompt_positions_never_change_the_loss_completion_positions_do(char_tokenizer):
    prompts, completions = _ragged_batch(char_tokenizer, n=4, seed=1)
    batch = pad_right_with_labels(prompts, completions, char_tokenizer.pad_token_id)
    labels = batch["labels"]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        assert (labels[i, : len(p)] == IGNORE_INDEX).all() and labels[i, len(p) : len(p) + len(c)].tolist() == c
        assert (labels[i, len(p) + len(c) :] == IGNORE_INDEX).all()
    torch.manual_seed(0)
    logits = torch.randn(*labels.shape, len(char_tokenizer))
    base, n = causal_lm_token_loss_sum(logits, labels)
    assert n == sum(len(c) for c in completions)
    prompt_pred = logits.clone()
    for i, p in enumerate(prompts):  # positions whose next token is a prompt token (or padding)
        prompt_pred[i, : len(p) - 1] = torch.randn(len(p) - 1, logits.shape[-1]) * 10
        prompt_pred[i, len(p) + len(completions[i]) - 1 :] = 7.0
    assert torch.equal(causal_lm_token_loss_sum(prompt_pred, labels)[0], base)
    completion_pred = logits.clone()
    completion_pred[0, len(prompts[0]) - 1] += torch.randn(logits.shape[-1]) * 3
    assert causal_lm_token_loss_sum(completion_pred, labels)[0] != base
    changed = labels.clone()
    changed[0, len(prompts[0])] = (changed[0, len(prompts[0])] + 1) % len(char_tokenizer)
    assert causal_lm_token_loss_sum(logits, changed)[0] != base


def _packed_vs_alone(tokenizer, implementation: str, seed: int = 2):
    """Max |packed − per-sequence| logits over every token, and the packed batch."""
    from ars_opd.lm.attention import packed_model_inputs, use_packed_attention

    prompts, completions = _ragged_batch(tokenizer, n=5, seed=seed)
    model = tiny_model(tokenizer).eval()
    packed = pack_sequences(prompts, completions, pack_length=40, pad_id=tokenizer.pad_token_id)
    assert packed["input_ids"].shape[0] < 5 and "attention_mask" not in packed  # several sequences share a row
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([p + c])).logits[0] for p, c in zip(prompts, completions)]
        if implementation == "flex":  # FlexAttention runs forward-only on CPU: set directly, as on CUDA
            model.set_attn_implementation("flex_attention")
        else:
            assert use_packed_attention(model, implementation)
        out = model(**packed_model_inputs(packed), use_cache=False).logits
    err, r, t = 0.0, 0, 0
    for (p, c), ref in zip(zip(prompts, completions), alone):
        n = len(p) + len(c)
        if t + n > 40:
            r, t = r + 1, 0
        err = max(err, (out[r, t : t + n] - ref).abs().max().item())
        t += n
    return err, packed, out, model


def test_packed_logits_equal_per_sequence_logits_with_per_sequence_sdpa(char_tokenizer):
    err, packed, out, model = _packed_vs_alone(char_tokenizer, "sdpa")
    # two fp32 forwards of one decoder (other shapes, other attention kernels)
    assert err <= two_computations(forward_bound(model.config, 40, out.abs().max().item()))
    # the loss over packed rows, from hidden states, equals the loss over padded rows from logits
    from ars_opd.lm.attention import packed_model_inputs
    from ars_opd.lm.cross_entropy import causal_lm_loss_from_hidden
    from ars_opd.lm.head import OutputHead, last_hidden_states

    prompts, completions = _ragged_batch(char_tokenizer, n=5, seed=2)
    padded = pad_right_with_labels(prompts, completions, char_tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = last_hidden_states(model, **packed_model_inputs(packed))
        lp = causal_lm_loss_from_hidden(hidden, OutputHead.of(model), packed["labels"], chunk_size=8)
        model.set_attn_implementation("eager")
        lq = causal_lm_token_loss_sum(
            model(**{k: padded[k] for k in ("input_ids", "attention_mask")}).logits, padded["labels"]
        )
    # the same chain, then the log-softmax and the sum over the tokens, on the summed loss's size
    V, A = len(char_tokenizer), out.abs().max().item()
    lengths = decoder_lengths(model.config, 40) + [model.config.hidden_size, softmax_length(V, A), int(lq[1])]
    assert lp[1] == lq[1] and abs(lp[0].item() - lq[0].item()) <= two_computations(chain_bound(lengths, lq[0].item()))


def test_packed_attention_builds_no_mask(char_tokenizer, monkeypatch):
    """transformers hands the per-sequence SDPA no mask at all (it builds an (R, 1, L, L) one for plain sdpa)."""
    import transformers

    from ars_opd.lm import attention

    seen = []

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append((attention_mask, len(attention.packed_segments(kw.get("cu_seq_lens_q"), None, 0, 0))))
        return attention.varlen_sdpa_attention(module, query, key, value, attention_mask, **kw)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, attention.VARLEN_SDPA, spy)
    monkeypatch.setattr(attention, "register_varlen_sdpa", lambda: None)
    _packed_vs_alone(char_tokenizer, "sdpa")
    assert seen and all(mask is None and n >= 5 for mask, n in seen)


@pytest.mark.slow
def test_packed_logits_equal_per_sequence_logits_with_flex_attention(char_tokenizer):
    err, _, out, model = _packed_vs_alone(char_tokenizer, "flex")  # FlexAttention compiles on CPU: tens of seconds
    assert err <= two_computations(forward_bound(model.config, 40, out.abs().max().item()))


def test_packed_attention_choice():
    from ars_opd.lm.attention import VARLEN_SDPA, packed_attention_implementation

    assert packed_attention_implementation("auto", "cpu") == VARLEN_SDPA
    with pytest.raises(ValueError, match="flex trains on CUDA only"):
        packed_attention_implementation("flex", "cpu")
    with pytest.raises(ValueError, match="flash needs CUDA"):
        packed_attention_implementation("flash", "cpu")


def test_sft_refuses_packed_attention_it_cannot_train_with_before_starting_workers():
    from ars_opd.config import ParallelConfig, PathsConfig
    from ars_opd.training.sft import run_sft
    from ars_opd.training.worker import TrainingJob

    cfg = SFTConfig(packing=True, packed_attention="flex")
    with pytest.raises(ValueError, match="sft.packed_attention: flex trains on CUDA only"):
        run_sft(TrainingJob("sft", cfg, ParallelConfig(device="cpu"), PathsConfig()))


def test_pack_sequences_boundaries(char_tokenizer):
    packed = pack_sequences([[5, 6], [7], [8, 9, 10]], [[11], [12, 13], [14]], pack_length=6, pad_id=0)
    assert packed["input_ids"].tolist() == [[5, 6, 11, 7, 12, 13], [8, 9, 10, 14, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 1]]
    assert packed["cu_seq_lens"].tolist() == [0, 3, 6, 10, 12]  # the padding of row 2 is a segment of its own
    assert packed["labels"].tolist() == [[-100, -100, 11, -100, 12, 13], [-100, -100, -100, 14, -100, -100]]
    full = pack_sequences([[5, 6], [7]], [[11], [12, 13]], pack_length=8, pad_id=0, full_rows=True)
    assert full["input_ids"].tolist() == [[5, 6, 11, 7, 12, 13, 0, 0]] and full["cu_seq_lens"].tolist() == [0, 3, 6, 8]


def test_budgets_drop_and_truncate_with_counts(char_tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "x" * n}], "completion": "y" * m}
        for n, m in [(5, 3), (80, 3), (5, 40), (20, 3)]
    ]
    cfg = parse_section(SFTConfig, {"max_prompt_tokens": 30, "max_completion_tokens": 10, "max_seq_len": 28}, "sft")
    data = encode_sft_rows(char_tokenizer, rows, cfg)
    assert data.counts == {
        "rows": 4,
        "kept": 2,
        "dropped_prompt_over_budget": 1,
        "dropped_teacher_truncated": 0,
        "dropped_no_room_for_completion": 1,
        "completion_truncated": 1,
        "teacher_truncated": 0,
    }
    assert [len(c) for c in data.completions] == [4, 10]


def test_batch_geometry_errors_name_the_keys():
    with pytest.raises(BatchConfigError, match="sft.global_batch_size = 10 does not divide by ddp.workers = 3"):
        BatchGeometry.check(10, 3, 1, "sft")
    with pytest.raises(BatchConfigError, match="sft.micro_batch_size = 3"):
        BatchGeometry.check(8, 2, 3, "sft")
    g = BatchGeometry.check(16, 2, 4, "sft")
    assert (g.per_worker, g.accumulation) == (8, 2)
    with pytest.raises(BatchConfigError, match="cannot fill one step"):
        step_indices(0, 10, g, 0, 0)


def test_shards_are_disjoint_cover_the_data_and_follow_the_step():
    shards = [epoch_shard(101, 3, sampler_seed=7, rank=r, world_size=4) for r in range(4)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 100
    g = BatchGeometry(8, 2, 2)
    seen = [i for step in range(6) for r in range(2) for i in step_indices(step, 48, g, 5, r)]
    assert sorted(seen) == list(range(48))  # 6 steps x 8 = one full epoch
    assert step_indices(6, 48, g, 5, 0) != step_indices(0, 48, g, 5, 0)  # next epoch reshuffles


def _one_param_model(grad_value: float):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), grad_value)
    model = torch.nn.Module()
    model.p = p
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def optimizer_step(model, opt, sched, cfg, loss, state):
    """The engine's optimiser step alone: a ``Trainer`` of just what that step reads."""
    return Trainer(ctx=None, model=model, task=None, cfg=cfg, opt=opt, sched=sched, state=state).optimizer_step(loss)


def test_clipping_is_explicit_and_logged_pre_clip():
    cfg = TrainLoopConfig(max_grad_norm=1.0)
    model, opt, sched = _one_param_model(3.0)  # norm 6
    state = TrainerState()
    norm, coef, clipped, skipped = optimizer_step(model, opt, sched, cfg, 1.0, state)
    # exact: 4·3² = 36 and √36 = 6 are exact in fp32 (small integers, a correctly rounded sqrt), and the
    # coefficient is then the same float64 expression as the clipper's
    assert norm == 6.0 and coef == 1.0 / (6.0 + 1e-6) and clipped and not skipped
    # clipped grad = 3/(6 + 1e-6) ≈ 0.5 each; the fp32 step rounds 6 + 1e-6, the division, ×3, lr and ×lr, the
    # update: six roundings on values <= 1
    assert ((model.p.double() - (1 - 0.1 * 3.0 / (6.0 + 1e-6))).abs() <= gamma(6)).all()
    assert state.clipped_steps == 1
    model, opt, sched = _one_param_model(3.0)
    norm, coef, clipped, _ = optimizer_step(model, opt, sched, TrainLoopConfig(max_grad_norm=None), 1.0, TrainerState())
    assert norm == 6.0 and coef == 1.0 and not clipped  # noclip: raw gradient applied
    assert ((model.p.double() - (1 - 0.1 * 3.0)).abs() <= gamma(3)).all()  # lr, ×lr, the update


def test_nonfinite_skip_counts_and_stop_raises():
    model, opt, sched = _one_param_model(float("nan"))
    state = TrainerState()
    _, _, _, skipped = optimizer_step(model, opt, sched, TrainLoopConfig(nonfinite="skip"), 1.0, state)
    assert skipped and state.skipped_steps == 1 and torch.equal(model.p.detach(), torch.ones(4))
    model, opt, sched = _one_param_model(1.0)
    with pytest.raises(NonFiniteError, match="non-finite loss"):
        optimizer_step(model, opt, sched, TrainLoopConfig(nonfinite="stop"), math.inf, TrainerState(step=3))
    model, opt, sched = _one_param_model(float("inf"))
    with pytest.raises(NonFiniteError, match="max_skipped_steps"):
        optimizer_step(model, opt, sched, TrainLoopConfig(nonfinite="skip", max_skipped_steps=0), 1.0, TrainerState())


class _ScaledTask:
    """Wraps a task: multiplies the loss by ``scale[step]`` (default 1) to provoke explosions on purpose."""

    def __init__(self, inner, scale: dict[int, float]):
        self.inner, self.scale, self.step = inner, scale, 0

    def metric_names(self):
        return []

    def micro_batches(self, step, model):
        self.step = step
        return self.inner.micro_batches(step, model)

    def teacher_tokens(self, step):
        return self.inner.teacher_tokens(step)

    def loss_sum(self, model, batch):
        loss, m = self.inner.loss_sum(model, batch)
        return loss * self.scale.get(self.step, 1.0), m


def _fit_in_process(tmp_path, char_tokenizer, scale, **cfg_kw):
    import json

    from ars_opd.config import ParallelConfig, TrainingPaths
    from ars_opd.training.distributed import init_worker, shutdown_worker
    from ars_opd.training.task import RunHooks, RunIdentity
    from ddp_probe import FixedTask

    ctx = init_worker("cpu", "gloo", threads=1)
    try:
        model = tiny_model(char_tokenizer)
        prompts, completions = _ragged_batch(char_tokenizer, n=4, seed=3)
        task = _ScaledTask(FixedTask([[(prompts, completions)]], ctx, char_tokenizer.pad_token_id, True), scale)
        cfg = TrainLoopConfig(steps=6, global_batch_size=4, micro_batch_size=4, warmup_steps=1, lr=1e-3, **cfg_kw)
        out = TrainingPaths(
            model=str(tmp_path / "model"),
            log=str(tmp_path / "out"),
            live=str(tmp_path / "live"),
            checkpoints=str(tmp_path / "ckpt"),
        )
        trainer = Trainer.build(ctx, model, task, cfg, ParallelConfig(workers=1), RunHooks(progress=False))
        trainer.fit(out, RunIdentity("fp"))
        return [json.loads(line) for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    finally:
        shutdown_worker()


def test_an_exploding_step_is_visible_in_the_log(tmp_path, char_tokenizer):
    rows = _fit_in_process(tmp_path, char_tokenizer, {3: 1e6}, max_grad_norm=1.0)
    norms = [r["grad_norm"] for r in rows]
    assert norms[3] > 1e4 * max(norms[:3] + norms[4:])  # the pre-clip norm shows the explosion
    assert rows[3]["clipped"] and rows[3]["clip_coef"] < 1e-4 and rows[3]["clipped_total"] >= 1


def test_a_nonfinite_step_is_skipped_and_counted_or_stops_the_run(tmp_path, char_tokenizer):
    rows = _fit_in_process(tmp_path / "skip", char_tokenizer, {2: float("inf")}, nonfinite="skip")
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, False]
    assert rows[-1]["skipped_total"] == 1 and len(rows) == 6
    with pytest.raises(NonFiniteError, match="at step 2"):
        _fit_in_process(tmp_path / "stop", char_tokenizer, {2: float("inf")}, nonfinite="stop")


@pytest.mark.ddp
def test_an_in_process_world_of_one_leaves_later_launches_with_their_workers():
    """Regression: a world of one in this process once set RANK/WORLD_SIZE in os.environ, so a later
    launch(workers=2) took itself for a worker of an outside launcher and ran on one process."""
    import os

    from ars_opd.training.distributed import init_worker, launch, shutdown_worker
    from ddp_probe import gkd_probe

    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    ctx = init_worker("cpu", "gloo", threads=1)
    assert ctx.world_size == 1 and ctx.rank == 0
    shutdown_worker()
    assert {k: os.environ.get(k) for k in before} == before
    parts = launch(gkd_probe, {"seed": 1, "steps": 8, "lam": 0.5}, workers=2)
    assert len(parts) == 2


def test_the_logged_lr_is_the_rate_each_step_used(tmp_path, char_tokenizer):
    """Regression: the log once read the scheduler after it had stepped, one step ahead of the truth."""
    from ars_opd.lm.optim import warmup_cosine

    rows = _fit_in_process(tmp_path, char_tokenizer, {}, min_lr_ratio=0.1)
    expected = [1e-3 * warmup_cosine(s, 6, 1, 0.1) for s in range(6)]
    # exact: LambdaLR's base_lr * lambda(step) is this float64 expression, and JSON keeps floats exactly
    assert [r["lr"] for r in rows] == expected
    assert rows[-1]["lr"] > 1e-4  # the floor (min_lr_ratio) is reached only after the last step


def test_step_logger_without_studio_writes_what_next_step_writes(tmp_path, monkeypatch):
    """Without DVC Studio the logger skips Live.next_step() (it re-reads every plot file each step): the plot
    files and the summary must be the ones next_step() writes."""
    import csv

    from ars_opd.training.step_log import StepLogger

    for var in ("DVC_STUDIO_TOKEN", "STUDIO_TOKEN", "DVC_STUDIO_URL", "STUDIO_ENDPOINT", "DVC_STUDIO_REPO_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    rows = [
        {
            "step": s,
            "loss": 3.0 / (s + 1),
            "lr": 1e-3,
            "grad_norm": 1.0 + s % 3,
            "tokens": 10 + s,
            "consistency/loss_dispersion": 0.01 * s,
            "worker_loss": [1.0, 2.0],
            "fault": None,
        }
        for s in range(30)
    ]
    out = {}
    for name, studio in (("fast", False), ("reference", True)):
        logger = StepLogger(tmp_path / name / "steps.jsonl", tmp_path / name / "live", enabled=True)
        assert logger.studio is False  # Studio is not configured here
        logger.studio = studio
        logger.replay(rows[:12])  # a resume replays the checkpoint's log first
        for r in rows[12:]:
            logger.log(r)
        logger.summary({"final_loss": rows[-1]["loss"], "steps": 30})
        logger.close()
        plots = tmp_path / name / "live" / "plots" / "metrics" / "train"
        out[name] = (
            {
                p.relative_to(plots).as_posix(): [
                    (r["step"], r[p.stem]) for r in csv.DictReader(p.open(), delimiter="\t")
                ]
                for p in sorted(plots.rglob("*.tsv"))
            },
            json.loads((tmp_path / name / "live" / "metrics.json").read_text()),
        )
    fast_plots, fast_summary = out["fast"]
    assert fast_plots == out["reference"][0]
    assert [int(s) for s, _ in fast_plots["loss.tsv"]] == list(range(30))
    assert fast_summary == out["reference"][1]
    assert fast_summary["step"] == 30 and fast_summary["final_loss"] == rows[-1]["loss"]
    assert fast_summary["train"]["loss"] == rows[-1]["loss"]
