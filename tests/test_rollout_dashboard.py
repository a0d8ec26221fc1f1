"""The rollout dashboard (issue: why OPD falls below its start): each column against an oracle of its own.

- ``correct_rate``: the task's share against a brute-force check of the completions the step trained on, read
  back from its micro-batches (the targets under the loss mask), decoded and compared with the answer
  recomputed from the instruction and input alone (``synthetic.expected_answer``), not the rows' reference;
- ``truncation_rate``: the completions without an EOS that reached ``max_new_tokens``, counted from the same;
- ``divergence_first_half`` / ``_second_half``: per-token reverse KL from a float64 oracle of both models'
  logits (torch.distributions), split by a loop over each completion's positions, within the derived fp32
  bound of the loss's rows (``tests.tolerances.loss_bound``);
- the report's table: each span's mean against pandas on the rows of that span;
- ``opd.loss_normalisation`` (an arm of the same study): the step's loss as the global token mean or the mean
  of each completion's token mean, against the same float64 oracle.
"""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from ars_opd.config import OPDConfig
from ars_opd.data import synthetic
from ars_opd.data.answers import is_checkable
from ars_opd.data.prompts import alpaca_messages, encode_prompts, encode_teacher_completions
from ars_opd.evaluation.rollout_dashboard import MAX_ROWS, dashboard_section, shown_rows
from ars_opd.lm.batching import in_first_half, sequence_weights
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.opd.data import OPDData
from ars_opd.training.opd.task import ModelSizes, OPDTask, RolloutSetup
from ars_opd.training.opd.teachers import LocalTeacher
from ars_opd.training.worker import WorkerSetup
from tests.tolerances import gamma, linear_bound, loss_bound
from tiny_models import tiny_llama

MAX_NEW = 6


def _model(vocab: int, seed: int, eos: int, pad: int):
    return tiny_llama(vocab, seed, eos, pad, head_scale=4.0)


def _rows(n: int) -> list[dict]:
    """Synthetic rows whose teacher completion is right on even rows and wrong on odd ones; every third wrong
    one too long for ``MAX_NEW`` (cut there, so no EOS: truncated)."""
    rows = synthetic.generate(n, seed=3, tasks=("add", "reverse", "uppercase"))
    for i, r in enumerate(rows):
        r["messages"] = alpaca_messages(r["instruction"], r["input"])
        r["reference"] = right = r["output"]
        r["completion"] = right if i % 2 == 0 else (right + "x" * MAX_NEW if i % 3 == 1 else right + "9")
        r["finish_reason"] = "stop"
    return rows


def _task(tok, rows, on_policy_fraction: float, seed: int = 1, normalisation: str = "token"):
    vocab = len(tok)
    student = _model(vocab, seed, tok.eos_token_id, tok.pad_token_id)
    teacher = _model(vocab, seed + 10, tok.eos_token_id, tok.pad_token_id)
    prompts = encode_prompts(tok, [r["messages"] for r in rows])
    data = OPDData(
        prompts,
        encode_teacher_completions(tok, rows),
        [r["task"] for r in rows],
        {},
        [r if is_checkable(r) else None for r in rows],  # as the stage encodes them (training.opd._encode)
    )
    cfg = OPDConfig(
        global_batch_size=len(rows),
        micro_batch_size=4,
        max_new_tokens=MAX_NEW,
        on_policy_fraction=on_policy_fraction,
        precision="fp32",
        loss_normalisation=normalisation,
    )
    ctx = WorkerContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    task = OPDTask(
        data,
        LocalTeacher(teacher, vocab),
        cfg,
        WorkerSetup(ctx, tok, BatchGeometry.check(len(rows), 1, 4, "opd"), sampler_seed=3, stage_seed=4, fault=None),
        sizes=ModelSizes(1, 1),
        rollouts=RolloutSetup(eos_ids=(tok.eos_token_id,)),
    )
    return task, student, teacher, prompts


def _trained_completions(batches) -> list[tuple[int, list[int]]]:
    """(prompt length, completion ids) of every sequence the step trains on, read back from the micro-batches."""
    out = []
    for b in batches:
        mask, targets = b.tensors["loss_mask"], b.tensors["targets"]
        for i in range(mask.shape[0]):
            pos = mask[i].nonzero().flatten().tolist()
            out.append((pos[0] + 1, targets[i, pos].tolist()))
    return out


def _rate(batches, name: str) -> float:
    s = sum(b.meta[name][0] for b in batches)
    c = sum(b.meta[name][1] for b in batches)
    return s / c


@pytest.mark.parametrize("on_policy_fraction", [0.0, 1.0])
def test_correct_and_truncation_rates_against_a_brute_force_check(char_tokenizer, on_policy_fraction):
    tok = char_tokenizer
    rows = _rows(16)
    task, student, _, prompts = _task(tok, rows, on_policy_fraction)
    by_prompt = {tuple(p): r for p, r in zip(prompts, rows)}
    torch.manual_seed(0)
    batches = task.micro_batches(0, student)
    assert "correct_rate" in task.metric_names() and "truncation_rate" in task.metric_names()
    correct = truncated = 0
    seen = _trained_completions(batches)
    for b_i, (plen, completion) in enumerate(seen):
        # the batch's row: find it by its prompt ids (the step's order is the sampler's, unknown here)
        b = batches[b_i // 4]
        ids = b.tensors["input_ids"][b_i % 4, :plen].tolist()
        row = by_prompt[tuple(ids)]
        ended = completion[-1] == tok.eos_token_id
        text = tok.decode(completion[:-1] if ended else completion, skip_special_tokens=True)
        instruction, inp = row["instruction"], row["input"]
        correct += text.strip() == synthetic.expected_answer(row["task"], instruction, inp).strip()
        truncated += (not ended) and len(completion) >= MAX_NEW
    assert len(seen) == 16
    assert _rate(batches, "correct_rate") == correct / 16
    assert _rate(batches, "truncation_rate") == truncated / 16
    if on_policy_fraction == 0.0:  # the teacher's completions, made half right, a third of the wrong ones too long
        assert correct == 8 and 0 < truncated < 8


def test_correct_rate_checks_natural_prompts_as_the_evaluation_does(char_tokenizer):
    """Natural prompts (a chat model's sentence answers) count in correct_rate through the natural checker; an
    open-ended row (no reference) is left out of the count rather than counted wrong."""
    from ars_opd.data.answers import is_correct

    question = "What is the capital of France?"
    answers = ["Paris.", "Lyon. Paris.", "paris!", "A poem."]  # within MAX_NEW characters: trained whole
    rows = []
    for i, answer in enumerate(answers):
        open_ended = i == 3
        rows.append(
            {
                "messages": [{"role": "user", "content": question}],
                "task": "nl_poem" if open_ended else "nl_capital",
                "reference": None if open_ended else "Paris",
                "completion": answer,
                "finish_reason": "stop",
            }
        )
    task, student, _, _ = _task(char_tokenizer, rows, 0.0)  # the teacher's completions: the answers above
    assert "correct_rate" in task.metric_names()
    batches = task.micro_batches(0, student)
    right, counted = (sum(b.meta["correct_rate"][i] for b in batches) for i in (0, 1))
    expected = [is_correct(r, r["completion"]) for r in rows[:3]]
    assert expected == [True, False, True]  # the checker's own verdicts: right, wrong (Lyon first), right
    assert (right, counted) == (sum(expected), 3)


def test_no_correct_rate_without_references(char_tokenizer):
    rows = _rows(8)
    task, *_ = _task(char_tokenizer, rows, 1.0)
    task.check_rows = None  # what OPDTask keeps when no row can be checked (an HF dataset)
    assert "correct_rate" not in task.metric_names()
    assert not OPDData([[1]] * 2, [[2]] * 2, [None, None], {}, [None, None]).checkable()
    assert OPDData([[1]] * 2, [[2]] * 2, ["add", None], {}, [{"task": "add"}, None]).checkable()


def _ragged_mask(rows: int, width: int, max_start: int, max_len: int, seed: int) -> torch.Tensor:
    """A loss mask (rows, width): each row one run of 1..max_len positions from a start in 0..max_start."""
    rng = random.Random(seed)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for i in range(rows):
        start, n = rng.randint(0, max_start), rng.randint(1, max_len)
        mask[i, start : start + n] = True
    return mask


def test_sequence_weights_against_a_loop():
    mask = _ragged_mask(5, 12, max_start=4, max_len=8, seed=1)
    expected = [1.0 / int(mask[i].sum()) for i in range(5) for _ in range(int(mask[i].sum()))]
    # 1 / n in fp32 is the correctly rounded quotient (IEEE division): exactly the float64 value rounded once
    assert torch.equal(sequence_weights(mask), torch.tensor(expected, dtype=torch.float64).float())


def test_in_first_half_against_a_loop():
    mask = _ragged_mask(6, 20, max_start=8, max_len=11, seed=0)
    expected = []
    for i in range(6):
        n = int(mask[i].sum())
        expected += [j < (n + 1) // 2 for j in range(n)]  # the first ceil(n/2) positions
    assert in_first_half(mask).tolist() == expected


def _oracle_rows(student, teacher, vocab: int, b):
    """Per loss row of micro-batch ``b``: reverse KL(q_student ‖ p_teacher) from float64 logits
    (torch.distributions) and the derived fp32 bound of the loss's own value of that row."""
    t = b.tensors
    mask = t["loss_mask"]
    with torch.no_grad():
        hs = select_rows(last_hidden_states(student, t["input_ids"], t["attention_mask"]), mask)
        ht = select_rows(last_hidden_states(teacher, t["input_ids"], t["attention_mask"]), mask)
        ws, wt = OutputHead.of(student, vocab).weight, OutputHead.of(teacher, vocab).weight
        zs, zt = (
            torch.nn.functional.linear(hs.double(), ws.double()),
            torch.nn.functional.linear(ht.double(), wt.double()),
        )
    per_row = kl_divergence(Categorical(logits=zs), Categorical(logits=zt))
    _, bounds = loss_bound(
        "divergence", zs, linear_bound(hs, ws), zt, linear_bound(ht, wt), t["targets"][mask], 1.0, 1.0, rows=True
    )
    return per_row, bounds


@pytest.mark.parametrize("normalisation", ["token", "sequence"])
def test_loss_normalisation_against_a_float64_oracle(char_tokenizer, normalisation):
    """``opd.loss_normalisation``: the step's loss (Σ loss_sum / Σ units, as the engine divides) is the global
    token mean of reverse KL, or the mean over completions of each completion's token mean."""
    tok = char_tokenizer
    rows = _rows(8)
    task, student, teacher, _ = _task(tok, rows, 1.0, seed=2, normalisation=normalisation)
    torch.manual_seed(1)
    batches = task.micro_batches(0, student)
    got, units = 0.0, 0
    token_sum = token_bound = seq_sum = seq_bound = 0.0
    n_tok = n_seq = 0
    for b in batches:
        loss_sum, _ = task.loss_sum(student, b)
        got += float(loss_sum.detach())
        units += b.loss_units
        per_row, bounds = _oracle_rows(student, teacher, len(tok), b)
        # the loss sums its rows in fp32 (one chunk here): γ_M of the sum of |terms| on top of each row's bound
        summed = gamma(len(per_row) + 1)
        token_sum, token_bound, n_tok = (
            token_sum + float(per_row.sum()),
            token_bound + float(bounds.sum()) + summed * float(per_row.abs().sum()),
            n_tok + len(per_row),
        )
        lengths = b.tensors["loss_mask"].sum(1).tolist()
        for r, chunk, bound in zip(lengths, per_row.split(lengths), bounds.split(lengths)):
            seq_sum += float(chunk.sum()) / r
            seq_bound += (float(bound.sum()) + summed * float(chunk.abs().sum())) / r
            n_seq += 1
    token_mean, seq_mean = token_sum / n_tok, seq_sum / n_seq
    # the rollouts' lengths differ, so the two means differ by more than their bounds: the test can tell them apart
    assert len({int(x) for b in batches for x in b.tensors["loss_mask"].sum(1)}) > 1
    assert abs(token_mean - seq_mean) > token_bound / n_tok + seq_bound / n_seq
    if normalisation == "token":
        assert units == n_tok
        assert abs(got / units - token_mean) <= token_bound / n_tok, (got / units, token_mean)
    else:
        assert units == n_seq == len(rows)
        # each row's value is scaled by its fp32 weight 1 / r (one rounding of relative size u)
        u = torch.finfo(torch.float32).eps / 2
        assert abs(got / units - seq_mean) <= seq_bound / n_seq + 2 * u * seq_mean, (got / units, seq_mean)


def test_divergence_halves_against_a_float64_oracle(char_tokenizer):
    tok = char_tokenizer
    rows = _rows(8)
    task, student, teacher, _ = _task(tok, rows, 1.0, seed=2)
    torch.manual_seed(1)
    batches = task.micro_batches(0, student)
    sums = {"divergence_first_half": [0.0, 0.0], "divergence_second_half": [0.0, 0.0]}
    oracle = {"divergence_first_half": [0.0, 0.0, 0.0], "divergence_second_half": [0.0, 0.0, 0.0]}
    vocab = len(tok)
    for b in batches:
        _, metrics = task.loss_sum(student, b)
        for k in sums:
            sums[k][0] += metrics[k][0]
            sums[k][1] += metrics[k][1]
        mask = b.tensors["loss_mask"]
        per_row, bounds = _oracle_rows(student, teacher, vocab, b)  # KL(q_student ‖ p_teacher)
        m = 0
        for i in range(mask.shape[0]):  # each completion's positions in order: the first ceil(n/2) are its first half
            n = int(mask[i].sum())
            for j in range(n):
                k = "divergence_first_half" if j < (n + 1) // 2 else "divergence_second_half"
                oracle[k][0] += float(per_row[m])
                oracle[k][1] += 1
                oracle[k][2] += float(bounds[m])
                m += 1
    for k in sums:
        assert sums[k][1] == oracle[k][1] > 0
        assert abs(sums[k][0] - oracle[k][0]) <= oracle[k][2], (k, sums[k][0], oracle[k][0], oracle[k][2])
    # the two halves differ by more than their bounds: the split is visible, not a copy of one mean
    first, second = (oracle[k][0] / oracle[k][1] for k in oracle)
    assert abs(first - second) > (oracle["divergence_first_half"][2] + oracle["divergence_second_half"][2])


def test_dashboard_rows_are_steps_and_flat_figures():
    """One table row per step (a three-step collapse is not averaged away); _start is the first step's value, _end
    the mean over the last fifth of the steps; a long run shows its first half of MAX_ROWS steps and then every
    k-th, the last always."""
    rng = random.Random(0)
    n = 23
    df = pd.DataFrame(
        {
            "step": list(range(n)),
            "lr": [1e-3 * (i + 1) / n for i in range(n)],
            "task/correct_rate": [rng.random() for _ in range(n)],
            "task/response_length": [rng.uniform(1, 12) for _ in range(n)],
            "task/eos_rate": [rng.random() for _ in range(n)],
            "task/truncation_rate": [rng.random() for _ in range(n)],
            "task/entropy": [rng.random() for _ in range(n)],
            "task/teacher_logprob": [-rng.random() for _ in range(n)],
            "task/divergence_first_half": [rng.random() for _ in range(n)],
            "task/divergence_second_half": [rng.random() for _ in range(n)],
            "task/on_policy": [1.0] * n,
        }
    )
    md, flat = dashboard_section("opd", df)
    table = [line for line in md if line.startswith("| ") and line[2].isdigit()]
    assert [int(line.split("|")[1]) for line in table] == list(range(n))
    tail = n // 5
    assert flat["opd/rollouts/correct_rate_end"] == pytest.approx(
        sum(df["task/correct_rate"][n - tail :]) / tail, rel=1e-12
    )
    assert flat["opd/rollouts/lr_start"] == df["lr"][0]
    assert any(line.startswith("| step |") and "student entropy" in line for line in md)
    rows = shown_rows(500)
    assert rows[: MAX_ROWS // 2] == list(range(MAX_ROWS // 2)) and rows[-1] == 499 and len(rows) <= MAX_ROWS + 1
    assert shown_rows(MAX_ROWS) == list(range(MAX_ROWS))


def test_the_report_has_the_dashboard_for_a_rollout_stage_only():
    from ars_opd.config import ReportConfig
    from ars_opd.evaluation.report import build_report

    n = 40
    base = {
        "step": list(range(n)),
        "loss": [1.0] * n,
        "lr": [1e-3] * n,
        "grad_norm": [1.0] * n,
        "worker_loss": [[1.0, 1.0]] * n,
        "worker_tokens": [[10, 10]] * n,
    }
    opd = pd.DataFrame({**base, "task/divergence_first_half": [0.5] * n, "task/divergence_second_half": [0.2] * n})
    md, flat, _ = build_report({"sft": pd.DataFrame(base), "opd": opd}, None, ReportConfig())
    assert "### opd: the rollouts" in md and "### sft: the rollouts" not in md
    assert flat["opd/rollouts/divergence_first_half_end"] == 0.5
    assert not any(k.startswith("sft/rollouts/") for k in flat)


def _engine_log(n: int = 6) -> list[dict]:
    """An engine run's step log: a sync every step (τ 1e-4), step 3's update not told apart, step 4's lag-0
    rollouts past the tolerance (as dlogp_check: warn trains on)."""
    nan = float("nan")
    rows = []
    for s in range(n):
        rows.append(
            {
                "step": s,
                "loss": 1.0,
                "grad_norm": 1.0,
                "worker_loss": [1.0],
                "worker_tokens": [10],
                "task/divergence_first_half": 0.5,
                "task/divergence_second_half": 0.2,
                "task/probe_max_abs_diff": 2e-5,
                "task/probe_tolerance": 1e-4,
                "task/probe_bound": 0.4,
                "task/probe_separation": nan if s == 0 else (1.5e-4 if s == 3 else 0.03),
                "task/indistinguishable": nan if s == 0 else float(s == 3),
                "task/tensors_verified": 137.0,
                "task/tensors_probe_only": 1.0,
                "task/engine_abs_dlogp": 0.02 if s == 4 else 3e-6,
                "task/engine_dlogp_tolerance": 1e-4,
            }
        )
    return rows


def test_the_report_and_the_check_read_the_engine_versions(tmp_path, monkeypatch):
    import json

    from ars_opd.checks import Problems, check_training
    from ars_opd.config import PathsConfig
    from ars_opd.evaluation.rollout_dashboard import engine_section
    from ars_opd.rollouts.version_log import engine_problems, engine_summary

    rows = _engine_log()
    summary = engine_summary(rows)
    assert (summary["syncs"], summary["indistinguishable"], summary["lag0_over_tolerance"]) == (6, 1, 1)
    assert summary["separation_min"] == 1.5e-4 and summary["lag0_dlogp_max"] == 0.02
    problems = engine_problems(rows)
    assert [w for w, _ in problems] == ["step 4", "engine"] and "1 of 6 syncs" in problems[1][1]
    md, flat = engine_section("opd", pd.DataFrame(rows))
    assert md[0] == "### opd: the rollout engine's versions" and "**2 problem(s)**" in "\n".join(md)
    assert flat["opd/engine/indistinguishable"] == 1 and flat["opd/engine/lag0_over_tolerance"] == 1
    # ars-opd check reads the same columns from the stage's steps.jsonl
    monkeypatch.chdir(tmp_path)  # the stage's paths are relative to the workspace
    paths = PathsConfig()
    steps = Path(paths.training("opd").steps)
    steps.parent.mkdir(parents=True, exist_ok=True)
    steps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = Problems()
    check_training("opd", paths, found)
    assert any("step 4" in p and "lag 0" in p for p in found) and any("1 of 6 syncs" in p for p in found)
    healthy = [{**r, "task/indistinguishable": 0.0, "task/engine_abs_dlogp": 3e-6} for r in rows]
    assert engine_problems(healthy) == [] and engine_section("sft", pd.DataFrame(healthy[:0])) == ([], {})
