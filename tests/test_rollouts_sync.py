"""The trainer's side of engine rollouts without an engine: the weight files and the version probe.

- A published version, loaded into a fresh model of the same architecture, gives exactly the trainer's
  weights (a tied head left out and re-tied); a LoRA student publishes its merged weights (oracle: peft's own
  ``merge_and_unload``).
- The probe's bound holds between the trainer's fp32 forward and a float64 oracle of the same weights (the
  bound is for two fp32 forwards; one fp32 against an exact oracle must sit within half of it), and the check
  refuses an engine that still serves the previous version, saying so.
- The version check (``ars_opd.rollouts.version_check``): the tolerance calibrated at the first sync from the
  calibration sequences' largest difference (τ = min(bound, max(margin d0, floor))), later syncs held to it, an
  engine off the published start refused at calibration, and an update too small to tell a stale engine apart
  refused or logged as ``indistinguishable`` says, unless every tensor was verified exactly; the lag-0 check of
  the engine's log-probabilities of its own samples, and the training forwards it cannot hold (bf16, dropout).
- The schedule (``ars_opd.rollouts.schedule``) against an engine in this process that records which version
  it held when each step's rollouts were asked: over a grid of ``max_lag`` L and ``sync_every`` S, every step
  trains on rollouts at most L versions old (by the engine's own record, not the schedule's tag), with one
  sync every min(S, L + 1) steps, and steps on teacher text (GKD) change neither.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from ars_opd.models.builtin import build_causal_lm
from ars_opd.rollouts.schedule import EngineRollouts, RolloutPlan
from ars_opd.rollouts.verify import StaleEngineError, check_probe, probe_bound, probe_ids, trainer_logprobs
from ars_opd.rollouts.version_check import CheckSettings, VersionCheck, calibrated_tolerance, floor
from ars_opd.rollouts.weights import PREFIX, engine_state_dict, write_version
from in_process_engine import RecordingEngine
from tiny_models import SYNC_ARCH, perturbed, sync_student


@pytest.fixture
def student(char_tokenizer):
    return sync_student(char_tokenizer)


def test_a_published_version_loads_back_exactly_and_leaves_the_tied_head_out(student, char_tokenizer, tmp_path):
    from safetensors.torch import load_file

    assert student.config.tie_word_embeddings
    first = write_version(engine_state_dict(student), tmp_path, 0)
    newer = perturbed(student, 1)
    published = write_version(engine_state_dict(newer), tmp_path, 1)
    assert not first.path.exists(), "an older version stays after a newer one was written"
    assert [p.name for p in tmp_path.iterdir()] == [f"{PREFIX}0000001.safetensors"]  # no temporary left
    state = load_file(str(published.path))
    assert "lm_head.weight" not in state
    fresh = build_causal_lm(SYNC_ARCH, char_tokenizer, seed=99)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    for (name, a), b in zip(newer.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()


def test_a_lora_student_publishes_its_merged_weights(student):
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(copy.deepcopy(student), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    state = engine_state_dict(adapted)
    oracle = copy.deepcopy(adapted).merge_and_unload().state_dict()
    oracle.pop("lm_head.weight")
    assert state.keys() == oracle.keys()
    for name, t in oracle.items():
        # W + B·A·scale computed by peft and by our merge: the same fp32 ops
        torch.testing.assert_close(state[name], t, rtol=0, atol=0, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(state[q], student.state_dict()[q])


def test_a_lora_student_with_dropout_is_probed_as_the_engine_computes_it(student):
    """The engine serves the merged weights without dropout; the trainer's side of the probe runs the adapted
    model in eval mode (dropout off) and leaves every module's mode as it found it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj"])
    adapted = get_peft_model(copy.deepcopy(student), config)
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(7))
    adapted.train()
    served = copy.deepcopy(student)  # what the engine loads: the merged weights
    served.load_state_dict(engine_state_dict(adapted), strict=False)
    ids = probe_ids(student.config.vocab_size, 33, seed=5)
    engine, _ = trainer_logprobs(served, ids, torch.device("cpu"))
    trainer, max_logit = trainer_logprobs(adapted, ids, torch.device("cpu"))
    bound = probe_bound(student.config, len(ids) - 1, max_logit, student.config.vocab_size)
    assert check_probe(engine.tolist(), trainer, None, bound, "http://engine", 0).max_abs_diff <= bound
    assert all(m.training for m in adapted.modules())  # train mode restored, dropout included
    # the instrument has the power to see dropout: the adapted model's forward in train mode is far off
    from ars_opd.lm.head import OutputHead, last_hidden_states

    x = torch.tensor([ids])
    with torch.no_grad():
        z = OutputHead.of(adapted).logits(last_hidden_states(adapted, x, torch.ones_like(x))[0, :-1])
    dropped = torch.log_softmax(z.double(), -1).gather(-1, x[0, 1:, None])[:, 0]
    assert float((dropped - engine).abs().max()) > 10 * bound


def test_the_probe_bound_covers_the_trainer_against_a_float64_oracle(student):
    ids = probe_ids(student.config.vocab_size, 33, seed=5)
    got, max_logit = trainer_logprobs(student, ids, torch.device("cpu"))
    oracle = copy.deepcopy(student).double()
    with torch.no_grad():
        logits = oracle(torch.tensor([ids])).logits[0, :-1]
        exact = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    bound = probe_bound(student.config, len(ids) - 1, max_logit, student.config.vocab_size)
    assert float((got - exact).abs().max()) <= bound / 2
    assert bound < 1e-2  # small enough to see any real change of weights (a perturbation moves nats, below)


def test_the_probe_refuses_an_engine_that_kept_the_previous_version(student):
    ids = probe_ids(student.config.vocab_size, 33, seed=5)
    old, _ = trainer_logprobs(student, ids, torch.device("cpu"))
    new, max_logit = trainer_logprobs(perturbed(student, 2), ids, torch.device("cpu"))
    bound = probe_bound(student.config, len(ids) - 1, max_logit, student.config.vocab_size)
    ok = check_probe((new + 0.25 * bound).tolist(), new, old, bound, "http://engine", 4)
    assert ok.max_abs_diff <= bound and ok.distinguishable
    with pytest.raises(StaleEngineError, match=r"does not serve policy version 4.*matches the previous version"):
        check_probe(old.tolist(), new, old, bound, "http://engine", 4)
    with pytest.raises(StaleEngineError, match="scored 3 probe positions"):
        check_probe([0.0, 0.0, 0.0], new, old, bound, "http://engine", 4)


def _versions(student, n: int = 3) -> list[torch.Tensor]:
    """The trainer's probe (sequence 0, seed 5) of ``n`` versions, each moved from the last by a small step."""
    ids = probe_ids(student.config.vocab_size, 33, seed=5)
    out, model = [], copy.deepcopy(student)
    for _ in range(n):
        out.append(trainer_logprobs(model, ids, torch.device("cpu"))[0])
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
    return out


def test_the_tolerance_is_calibrated_at_the_first_sync_and_holds_every_later_one(student):
    """d0 (the largest difference over the calibration's sequences) sets τ = min(bound, max(margin d0, floor));
    a later engine within τ passes, one past it is refused, one that kept the previous version is named so."""
    check = VersionCheck(CheckSettings(tokens=33, calibration=4, margin=8.0), seed=5, vocab=student.config.vocab_size)
    sequences = check.sequences()
    assert len(sequences) == 4 and len({tuple(x) for x in sequences}) == 4
    assert sequences[0] == probe_ids(student.config.vocab_size, 33, seed=5)  # the probe of every later sync
    trainer = [trainer_logprobs(student, ids, torch.device("cpu"))[0] for ids in sequences]
    bound, top = 1e-2, 5.0
    offsets = [1e-6, 3e-6, 2e-6, 4e-4]  # the engine's rounding: d0 = 4e-4, on the fourth sequence
    engine = [(t + d).tolist() for t, d in zip(trainer, offsets)]
    row = check.verify(0, engine, trainer, (bound, top), "http://engine")
    tau = calibrated_tolerance(4e-4, bound, 8.0, top)
    assert row["probe_d0"] == pytest.approx(4e-4, rel=1e-6) and tau == pytest.approx(3.2e-3, rel=1e-6)
    assert check.tolerance == row["probe_tolerance"] == pytest.approx(tau, rel=1e-6)
    assert check.sequences() == sequences[:1]
    assert row["probe_separation"] is None and row["indistinguishable"] is None
    versions = _versions(student)
    check.previous = versions[0]
    ok = check.verify(1, [(versions[1] + 0.9 * tau).tolist()], [versions[1]], (bound, top), "http://engine")
    assert ok["probe_max_abs_diff"] <= tau and ok["probe_d0"] is None and ok["probe_separation"] > 2 * tau
    with pytest.raises(StaleEngineError, match=r"version 2: .*up to 0.00\d+ \(the tolerance 0.0032\)"):
        check.verify(2, [(versions[2] + 1.5 * tau).tolist()], [versions[2]], (bound, top), "http://engine")
    with pytest.raises(StaleEngineError, match="matches the previous version"):
        check.verify(2, [versions[1].tolist()], [versions[2]], (bound, top), "http://engine")
    # the floor: a d0 of exactly 0 (the same kernels) leaves a few dozen roundings of the largest logit
    assert calibrated_tolerance(0.0, bound, 8.0, top) == floor(top) == 64 * 2.0**-24 * 5.0
    assert calibrated_tolerance(1.0, bound, 8.0, top) == bound  # never past the derived bound


def test_an_engine_that_does_not_serve_the_published_start_is_refused_at_calibration(student):
    check = VersionCheck(CheckSettings(tokens=33, calibration=2), seed=5, vocab=student.config.vocab_size)
    trainer = [trainer_logprobs(student, ids, torch.device("cpu"))[0] for ids in check.sequences()]
    with pytest.raises(StaleEngineError, match=r"does not serve the published start of this run, policy version 0"):
        check.verify(0, [(t + 0.02).tolist() for t in trainer], trainer, (1e-2, 5.0), "http://engine")
    explicit = VersionCheck(CheckSettings(tokens=33, calibration=2, tolerance=0.05), 5, student.config.vocab_size)
    row = explicit.verify(0, [(t + 0.02).tolist() for t in trainer], trainer, (1e-2, 5.0), "http://engine")
    assert row["probe_tolerance"] == 0.05  # an explicit tolerance is τ, and d0 is held to it


@pytest.mark.parametrize("verdict", ["warn", "refuse"])
def test_an_update_too_small_to_tell_apart_is_refused_or_logged_unless_every_tensor_was_exact(student, verdict):
    """s_v <= 2 τ: an engine still on v - 1 would pass the probe. With every tensor verified exactly by the
    fingerprint the version is proven all the same; with one tensor left to the probe it is not."""
    from ars_opd.rollouts.fingerprint import FingerprintResult

    def check_at(v1_offset: float, exact):
        check = VersionCheck(CheckSettings(tokens=33, calibration=1, indistinguishable=verdict), 5, 10**4)
        v0 = _versions(student, 1)[0]
        check.verify(0, [v0.tolist()], [v0], (1e-2, 5.0), "http://engine", exact)  # τ = the floor
        v1 = v0 + v1_offset * check.tolerance
        return check, check.verify(1, [v1.tolist()], [v1], (1e-2, 5.0), "http://engine", exact)

    everything, one_unread = FingerprintResult(12), FingerprintResult(11, ["lm_head.weight"])
    check, row = check_at(1.5, everything)  # moved by 1.5 τ, every tensor exact: proven
    assert row["probe_separation"] == pytest.approx(1.5 * check.tolerance) and row["indistinguishable"] == 0.0
    assert (row["tensors_verified"], row["tensors_probe_only"]) == (12, 0)
    assert check_at(3.0, one_unread)[1]["indistinguishable"] == 0.0  # moved by 3 τ: the probe tells them apart
    if verdict == "refuse":
        with pytest.raises(StaleEngineError, match=r"still serving version 0 would have passed.*indistinguishable"):
            check_at(1.5, one_unread)
        with pytest.raises(StaleEngineError, match=r"still serving version 0 would have passed"):
            check_at(1.5, None)  # no fingerprint asked
    else:
        row = check_at(1.5, one_unread)[1]
        assert row["indistinguishable"] == 1.0 and (row["tensors_verified"], row["tensors_probe_only"]) == (11, 1)


def test_a_tensor_that_differs_is_refused_by_name_even_within_the_probe_tolerance(student):
    from ars_opd.rollouts.fingerprint import FingerprintResult

    check = VersionCheck(CheckSettings(tokens=33, calibration=1), 5, 10**4)
    v0 = _versions(student, 1)[0]
    stale_head = FingerprintResult(11, [], ["lm_head.weight"])
    with pytest.raises(
        StaleEngineError,
        match=r"1 of its 12 tensors are not the published ones \(lm_head.weight\); "
        r"although its probe is within",
    ):
        check.verify(0, [v0.tolist()], [v0], (1e-2, 5.0), "http://engine", stale_head)


def test_the_lag_0_check_refuses_or_warns_past_the_tolerance_and_knows_when_it_cannot_hold(student, caplog):
    from ars_opd.rollouts.version_check import check_lag0, lag0_unchecked

    check_lag0(3, 1e-5, 1e-4, "http://engine", "refuse")  # rounding: passes
    check_lag0(3, float("nan"), 1e-4, "http://engine", "refuse")  # no rollout token this step
    with pytest.raises(StaleEngineError, match=r"at step 3 the rollout engine at http://engine .* by 0.012 .*refuse"):
        check_lag0(3, 0.012, 1e-4, "http://engine", "refuse")
    with caplog.at_level("WARNING"):
        check_lag0(3, 0.012, 1e-4, "http://engine", "warn")
    assert "dlogp_check: warn" in caplog.text
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert lag0_unchecked(student, "auto", cpu) is None and lag0_unchecked(student, "fp32", cuda) is None
    assert "bf16" in lag0_unchecked(student, "bf16", cpu) and "bf16" in lag0_unchecked(student, "auto", cuda)
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(copy.deepcopy(student), LoraConfig(r=2, lora_dropout=0.1, target_modules=["q_proj"]))
    assert "dropout" in lag0_unchecked(adapted, "fp32", cpu)
    dropping = copy.deepcopy(student)
    dropping.config.attention_dropout = 0.1
    assert "dropout" in lag0_unchecked(dropping, "fp32", cpu)


def _schedule(student, steps: int, lag: int, every: int, teacher_steps=frozenset()):
    """Run the schedule for ``steps`` steps (the student moved after each, as an optimizer step would); the
    engine, and each step's reported lag (None on teacher-text steps)."""
    engine = RecordingEngine(student)
    plan = RolloutPlan(steps, lag, every, Path("unused"), seed=1, rollout_seed=1, check=CheckSettings(tokens=8))
    rollouts = EngineRollouts(engine, plan, spec=None, rank=0, world=1, transport=engine)
    model, lags = copy.deepcopy(student), []
    wanted = lambda t: None if t in teacher_steps else [[10 + t, 3], [10 + t, 4]]  # noqa: E731
    try:
        for s in range(steps):
            rollouts.prepare(s, model, torch.device("cpu"), wanted)
            lags.append(None if s in teacher_steps else rollouts.take(s, wanted(s)).lag)
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # version s + 1 differs from version s
    finally:
        rollouts.close()
    return engine, lags


def _expected(steps: int, lag: int, every: int) -> tuple[list[int], list[int]]:
    """The oracle: a version lasts p = min(S, L + 1) steps; the engine syncs at 0, p, 2p, … while a step is
    left to ask (the previous sync asked up to its step + L), and step t's rollouts are asked at the first
    sync within L of it, p·⌈(t − L) / p⌉."""
    p = min(every, lag + 1)
    syncs = [k * p for k in range(steps) if k * p <= steps - 1 and (k == 0 or (k - 1) * p + lag < steps - 1)]
    lags = [t - p * max(0, -(-(t - lag) // p)) for t in range(steps)]
    return syncs, lags


@pytest.mark.parametrize("lag", [0, 1, 2])
@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_every_rollout_is_within_max_lag_whatever_sync_every(student, lag, every):
    steps = 9
    engine, lags = _schedule(student, steps, lag, every)
    syncs, want = _expected(steps, lag, every)
    # by the engine's own record: the version it held when each step's rollouts were asked
    assert [t - engine.sampled_by[t] for t in range(steps)] == lags == want
    assert max(lags) <= lag
    assert engine.published == syncs
    if every <= lag:  # every step after the first has its rollouts asked ahead, while an earlier step trains
        assert all(engine.sampled_by[t] < t for t in range(1, steps))


def test_teacher_text_steps_leave_the_lag_bound_alone(student):
    for lag, every in [(0, 2), (1, 2), (2, 2), (2, 3), (1, 1)]:
        engine, lags = _schedule(student, 10, lag, every, teacher_steps={1, 4, 5, 9})
        assert all(x <= lag for x in lags if x is not None), (lag, every, lags)
        assert set(engine.sampled_by) == {0, 2, 3, 6, 7, 8}
