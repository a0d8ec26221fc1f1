"""OPD with several teachers: every rollout is scored by its own teacher, loss for loss.

Oracles, none of them the routing code: each teacher alone (``LocalTeacher``) on a micro-batch of only its rows,
built as a one-teacher run builds it; a float64 recomputation of every row's loss from the models' own logits
(``tolerances.loss_bound``), which bounds how far two fp32 computations of the same row may differ; the one-teacher
OPD stage itself (a route that sends every prompt to the models stage's teacher must train the same run, bit for
bit); and for a served teacher, the bundled server's requests (only its rows reach it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from ars_opd.config import load_params
from ars_opd.data.prompts import encode_completions, encode_prompts
from ars_opd.lm.batching import build_rollout_batch
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import get_objective
from ars_opd.models.loading import load_model, load_tokenizer
from ars_opd.models.teachers import teacher_path
from ars_opd.training.opd.teacher_route import ROW_KEY, RoutedTeacher
from ars_opd.training.opd.teachers import LocalTeacher
from micro import run_opd_in, teacher_rows
from several_teachers import ROUTE, SPECIALISTS, exact_row_losses, several_teachers_workspace
from tolerances import U64, forward_bound, gamma, two_computations, vs_oracle

NAMES = ("arith", "words")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    several_teachers_workspace(root, {"named": SPECIALISTS, "route": ROUTE})
    return root


@pytest.fixture(scope="module")
def models(workspace):
    """(tokenizer, student, {name: teacher}), every model fp32 in eval mode."""
    models_dir = str(workspace / load_params(workspace / "params.yaml").paths.models_dir)
    tokenizer = load_tokenizer(models_dir)
    student = load_model(models_dir, "student").eval()
    teachers = {}
    for name in NAMES:
        from transformers import AutoModelForCausalLM

        teachers[name] = AutoModelForCausalLM.from_pretrained(teacher_path(models_dir, name)).eval()
    return tokenizer, student, teachers


def _rollouts(tokenizer, n: int = 12):
    """Prompts of every task and completions of several lengths, and each row's teacher (by the route)."""
    rows = teacher_rows(n, seed=9)
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    completions = encode_completions(tokenizer, [r["completion"] for r in rows])
    owners = [NAMES.index(ROUTE[r["task"]]) for r in rows]
    assert set(owners) == {0, 1}  # both teachers have rows
    return prompts, completions, owners


def _row_losses(student, teacher, batch: dict, objective, beta: float, vocab: int) -> list[float]:
    """Each row's summed loss (the objective's recorded per-token values) of one micro-batch, scored by ``teacher``
    (a ``LocalTeacher`` or the ``RoutedTeacher``), the student's hidden states from one forward of the batch."""
    mask = batch["loss_mask"]
    with torch.no_grad():
        hidden = select_rows(last_hidden_states(student, batch["input_ids"], batch["attention_mask"]), mask)
        scores = teacher.score(batch, objective, 1.0)
        per_token = torch.empty(hidden.shape[0], dtype=torch.float32)
        objective.loss(
            hidden,
            OutputHead.of(student, vocab),
            scores,
            batch["targets"][mask],
            beta,
            1.0,
            chunk_size=7,
            record=per_token,
        )
    sums = torch.zeros(mask.shape[0], dtype=torch.float64).index_add_(0, mask.nonzero()[:, 0], per_token.double())
    return sums.tolist()


@pytest.mark.parametrize(
    "loss,beta,kind",
    [
        ("full_vocab", 1.0, "divergence"),
        ("full_vocab", 0.0, "divergence"),
        ("full_vocab", 0.5, "divergence"),
        ("sampled_token", 1.0, "sampled_token"),
    ],
)
def test_routed_per_row_losses_equal_each_teacher_alone_on_its_rows(models, loss, beta, kind):
    tokenizer, student, teachers = models
    vocab = len(tokenizer)
    prompts, completions, owners = _rollouts(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    objective = get_objective(loss)
    locals_ = [LocalTeacher(teachers[n], vocab, chunk_size=7, topk=5) for n in NAMES]
    routed = RoutedTeacher(NAMES, locals_, [1, 1], vocab)
    batch = build_rollout_batch(prompts, completions, pad, eos)
    batch[ROW_KEY] = torch.tensor(owners)
    got = _row_losses(student, routed, batch, objective, beta, vocab)
    # the one-teacher runs on the split data: each teacher on a micro-batch of its own rows alone
    alone = [0.0] * len(prompts)
    for k, teacher in enumerate(locals_):
        rows = [i for i, o in enumerate(owners) if o == k]
        own = build_rollout_batch([prompts[i] for i in rows], [completions[i] for i in rows], pad, eos)
        for i, v in zip(rows, _row_losses(student, teacher, own, objective, beta, vocab)):
            alone[i] = v
    width = batch["input_ids"].shape[1]
    for i, k in enumerate(owners):
        mine = teachers[NAMES[k]]
        other = teachers[NAMES[1 - k]]
        (exact,), (bound,) = exact_row_losses(
            student, mine, [prompts[i]], [completions[i]], kind, beta, tokenizer, width
        )
        (wrong,), _ = exact_row_losses(student, other, [prompts[i]], [completions[i]], kind, beta, tokenizer, width)
        tol = two_computations(bound)
        assert abs(got[i] - alone[i]) <= tol, (i, got[i], alone[i], tol)
        assert abs(got[i] - exact) <= vs_oracle(bound), (i, got[i], exact, bound)
        # the test can tell the teachers apart: the other teacher's loss of the row is far outside the bound
        assert abs(got[i] - wrong) > 10 * tol, (i, got[i], wrong, tol)


def test_routed_topk_supports_are_each_teachers_own(models):
    tokenizer, _, teachers = models
    vocab = len(tokenizer)
    prompts, completions, owners = _rollouts(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    objective = get_objective("topk")
    locals_ = [LocalTeacher(teachers[n], vocab, chunk_size=7, topk=5) for n in NAMES]
    batch = build_rollout_batch(prompts, completions, pad, eos)
    batch[ROW_KEY] = torch.tensor(owners)
    with torch.no_grad():
        routed = RoutedTeacher(NAMES, locals_, [1, 1], vocab).score(batch, objective, 1.0)
    owner = batch[ROW_KEY][batch["loss_mask"].nonzero()[:, 0]]
    for k, teacher in enumerate(locals_):
        rows = [i for i, o in enumerate(owners) if o == k]
        own = build_rollout_batch([prompts[i] for i in rows], [completions[i] for i in rows], pad, eos)
        with torch.no_grad():
            alone = teacher.score(own, objective, 1.0)
            top = teacher.model(input_ids=own["input_ids"]).logits.abs().max().item()
        tol = two_computations(forward_bound(teacher.model.config, batch["input_ids"].shape[1], top, vocab))
        mine = (owner == k).nonzero().squeeze(-1)
        assert mine.numel() == alone.support_ids.shape[0]
        for r, a in zip(mine.tolist(), range(alone.support_ids.shape[0])):
            ids_r = {int(i): float(v) for i, v in zip(routed.support_ids[r], routed.support_logprobs[r]) if v > -1e30}
            ids_a = {int(i): float(v) for i, v in zip(alone.support_ids[a], alone.support_logprobs[a]) if v > -1e30}
            assert set(ids_r) == set(ids_a)
            assert max(abs(ids_r[i] - ids_a[i]) for i in ids_r) <= tol


@pytest.mark.slow
@pytest.mark.ddp
def test_a_route_to_the_models_stage_teacher_trains_the_one_teacher_run_bit_for_bit(tmp_path):
    """Every prompt to one named teacher that is the models stage's own (``source: teacher``): the routing path
    end to end (rows, sub-batches, assembled scores, the budget) must train exactly the one-teacher run."""
    opd = {"steps": 3, "warmup_steps": 1, "checkpoint_every": 0, "snapshot_every": 0}
    several_teachers_workspace(tmp_path / "one", {"named": []}, opd)
    several_teachers_workspace(
        tmp_path / "routed", {"named": [{"name": "main", "source": "teacher"}], "default": "main"}, opd
    )
    one, _, _ = run_opd_in(tmp_path / "one")
    routed, _, manifest = run_opd_in(tmp_path / "routed")
    assert manifest["teacher"] == "routed" and "task/main/rollouts" in routed[0]
    for a, b in zip(one, routed):
        for key in ("loss", "grad_norm", "task/teacher_logprob", "task/entropy", "budget/flops", "worker_loss"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        assert b["task/main/rollouts"] == b["task/rollouts"] and b["task/main/eos_rate"] == b["task/eos_rate"]


@pytest.mark.slow
@pytest.mark.ddp
def test_the_step_log_splits_every_column_per_teacher_and_the_consistency_report_ignores_them(tmp_path):
    from ars_opd.config import ReportConfig
    from ars_opd.evaluation.report import build_report

    opd = {"steps": 3, "warmup_steps": 1, "checkpoint_every": 0, "snapshot_every": 0}
    several_teachers_workspace(tmp_path, {"named": SPECIALISTS, "route": ROUTE}, opd)
    steps, _, _ = run_opd_in(tmp_path)
    for r in steps:
        assert r["task/arith/rollouts"] + r["task/words/rollouts"] == r["task/rollouts"] == 8
        for col in ("eos_rate", "response_length", "truncation_rate", "correct_rate"):
            both = r[f"task/arith/{col}"] * r["task/arith/rollouts"] + r[f"task/words/{col}"] * r["task/words/rollouts"]
            # the rates are float64 count / n: each side recovers the counts within a few float64 roundings
            assert both == pytest.approx(r[f"task/{col}"] * r["task/rollouts"], rel=gamma(4, U64), abs=0.0)
        assert len(r["worker_task/arith/eos_rate"]) == len(r["worker_loss"]) == 2
    df = pd.DataFrame(steps)
    plain = df.drop(
        columns=[
            c for c in df if c.startswith(("task/arith/", "task/words/", "worker_task/arith/", "worker_task/words/"))
        ]
    )
    cfg = ReportConfig(window=4)
    md, flat, alarms = build_report({"opd": df}, None, cfg)
    md0, flat0, alarms0 = build_report({"opd": plain}, None, cfg)
    consistency = md[md.index("## Worker consistency") :]
    assert consistency == md0[md0.index("## Worker consistency") :]
    assert {k: v for k, v in flat.items() if "/rollouts/" not in k} == {
        k: v for k, v in flat0.items() if "/rollouts/" not in k
    }
    assert alarms == alarms0
    assert "### opd/arith: the rollouts" in md and "### opd/words: the rollouts" in md


def _logit_bound(model) -> float:
    """A bound on every logit the model can produce, whatever its input: the final RMSNorm's output has 2-norm at
    most sqrt(H)·max|g| (x / rms(x) has norm sqrt(H)), so |z_v| <= sqrt(H)·max|g|·||W_v||."""
    g = model.model.norm.weight.detach().abs().max().item()
    w = model.get_output_embeddings().weight.detach().norm(dim=1).max().item()
    return model.config.hidden_size**0.5 * g * w


class RecordingProxy:
    """Forwards to the bundled server and records the token ids of every scoring request (the prompt of
    ``/v1/completions``), so a test can see which rows a served teacher was asked."""

    def __init__(self, upstream: str):
        from fake_endpoint import FaultyProxy

        recorded: list[list[int]] = []

        class Proxy(FaultyProxy):
            async def _forward(self, request):
                if request.method == "POST" and request.path.endswith("/completions"):
                    body = json.loads(await request.read())
                    recorded.append(list(body["prompt"]))
                return await super()._forward(request)

        self.recorded = recorded
        self.proxy = Proxy(upstream=upstream)

    def __enter__(self):
        self.proxy.__enter__()
        return self

    def __exit__(self, *exc):
        self.proxy.__exit__(*exc)


@pytest.mark.slow
@pytest.mark.ddp
def test_local_and_endpoint_teachers_in_one_run(workspace, tmp_path):
    """arith in the workers, words behind the bundled server: only words' rows reach the server, every one of
    them, and step 0's loss (the same student and rollouts) is the all-local run's within the scores' rounding."""
    from ars_opd.config import TeacherServerConfig
    from ars_opd.serving.local_server import LOCAL_MODEL_NAME, local_server

    p = load_params(workspace / "params.yaml")
    models_dir = workspace / p.paths.models_dir
    opd = {"steps": 2, "warmup_steps": 1, "checkpoint_every": 0, "snapshot_every": 0, "loss": "sampled_token"}
    server = TeacherServerConfig(max_batch_size=64, max_wait_ms=5.0, threads=1, startup_timeout_s=120.0)
    tokenizer = load_tokenizer(str(models_dir))
    with local_server(teacher_path(models_dir, "words"), server, max_logprobs=5) as url:
        with RecordingProxy(url.removesuffix("/v1")) as rec:
            served = {
                "name": "words",
                "source": "endpoint",
                "endpoint": {"endpoint": rec.proxy.base_url, "model": LOCAL_MODEL_NAME, "request_timeout_s": 30.0},
            }
            local = tmp_path / "local"
            mixed = tmp_path / "mixed"
            several_teachers_workspace(local, {"named": SPECIALISTS, "route": ROUTE}, opd)
            several_teachers_workspace(mixed, {"named": [SPECIALISTS[0], served], "route": ROUTE}, opd)
            local_steps, _, _ = run_opd_in(local)
            probes = len(rec.recorded)
            mixed_steps, _, manifest = run_opd_in(mixed)
    assert probes == 0  # the all-local run never asked the server
    texts = [tokenizer.decode(a) for a in rec.recorded]
    scored = [t for t in texts if "### Instruction" in t]  # the rows (the endpoint check's probe is other text)
    assert all("Reverse" in t or "Uppercase" in t for t in scored), "an arith row reached the words endpoint"
    assert len(scored) == sum(int(r["task/words/rollouts"]) for r in mixed_steps) > 0  # each words row, once
    assert manifest["teachers"]["words"]["source"] == "endpoint"
    # step 0: the same student and rollouts; the scores differ by two fp32 forwards of words' weights, each within
    # forward_bound of the exact log-probabilities at any batch shape, and the loss averages (log q - log p)
    from transformers import AutoModelForCausalLM

    words_model = AutoModelForCausalLM.from_pretrained(teacher_path(models_dir, "words"))
    width = max(len(x) for x in encode_prompts(tokenizer, [r["messages"] for r in teacher_rows(64, seed=5)]))
    width += opd_max_new_tokens(mixed)
    tol = two_computations(forward_bound(words_model.config, width, _logit_bound(words_model), len(tokenizer)))
    assert abs(local_steps[0]["loss"] - mixed_steps[0]["loss"]) <= tol
    assert abs(local_steps[0]["task/words/teacher_logprob"] - mixed_steps[0]["task/words/teacher_logprob"]) <= tol
    assert local_steps[0]["task/arith/teacher_logprob"] == mixed_steps[0]["task/arith/teacher_logprob"]


def opd_max_new_tokens(root: Path) -> int:
    return load_params(root / "params.yaml", sections=("opd",)).opd.max_new_tokens
