"""Student rollouts on an engine: the bundled server's generation and weight-load routes, the vLLM
worker extension, and the client ``ars_opd.rollouts.engine_api.EngineClient`` that talks to both.

Oracles, all independent of the engine's own numbers:

- an HF forward of the same weights in this process, in fp32, on the same tokens: the sampled tokens' reported
  log-probabilities must equal its log-softmax (temperature 1) within the rounding of two fp32 forwards
  (``tolerances.forward_bound``), and differ from the tempered distribution's by far more;
- the next-token law softmax(z / T) within the top-p nucleus, computed in float64 here from the HF logits: a
  Pearson χ² test of 2,000 single-token samples (distinct seeds) against it, with two controls that the test
  has the power to reject a sampler at the wrong temperature and one under the checkpoint's repetition
  penalty (which the student directory's generation_config sets, so a server that let it leak fails);
- for weight loads: the HF forward of the NEW weights (the tied head fresh), of the OLD ones (a stale engine,
  the fault option), and of "new embedding, old head" (what vLLM CPU's stock ``reload_weights`` serves).

The vLLM tests (marked ``vllm``) share one vLLM server started with ``VLLMOptions(weight_sync=True)`` for a
built-in student with heads of 32 (``vllm_student`` in conftest.py).
"""

from __future__ import annotations

import ast
import json
import math
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from ars_opd.config import ArchConfig, EndpointConfig
from ars_opd.models.builtin import build_causal_lm
from ars_opd.rollouts.engine_api import (
    EngineClient,
    EngineDeadError,
    EngineRequestError,
    EngineResponseError,
    SamplingSpec,
)
from ars_opd.rollouts.fingerprint import TrainerHashes, compare
from ars_opd.rollouts.verify import StaleEngineError, check_probe, probe_bound, probe_ids, trainer_logprobs
from ars_opd.serving.server import app as server_app
from ars_opd.serving.server.options import ServerOptions
from ars_opd.teacher.client.endpoint import ClientSettings
from server_thread import ServerThread
from tolerances import forward_bound, two_computations

MODEL = "tiny-student"
SERVER_DIR = Path(__file__).resolve().parents[1] / "ars_opd" / "teacher" / "server"
# the checkpoint's sampling defaults that must not leak into rollouts (each server resets or ignores them)
LEAKY_GENERATION_CONFIG = {"repetition_penalty": 1.3, "top_k": 5, "temperature": 0.3}
P_MIN = 1e-3  # χ² acceptance: a sampler that follows the law fails with probability 1e-3 (fixed seeds: never flaky)
P_CONTROL = 1e-6  # the controls must be rejected at least this strongly


def save_student(directory: Path, tokenizer, arch: ArchConfig, scale: float = 12.0, seed: int = 3) -> Path:
    """A built-in student (tied embeddings) with its matrices scaled by ``scale`` (sharper next-token laws than
    the default init's near-uniform ones), a generation_config that would change sampling if it leaked, and
    ``tokenizer``."""
    model = build_causal_lm(arch, tokenizer, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    for k, v in LEAKY_GENERATION_CONFIG.items():
        setattr(model.generation_config, k, v)
    model.generation_config.do_sample = True
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_hf(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


# ---- oracles -------------------------------------------------------------------------------------------------


def token_logprobs(model, ids: list[int], start: int, vocab: int) -> tuple[torch.Tensor, float]:
    """log p(ids[i] | ids[:i]) for i >= start from one fp32 forward (temperature 1, the tokenizer's vocabulary),
    and the forward's max |logit| (the bound's scale)."""
    with torch.no_grad():
        z = model(input_ids=torch.tensor([ids])).logits[0, :, :vocab].float()
    lp = torch.log_softmax(z, -1)[start - 1 : len(ids) - 1].gather(-1, torch.tensor(ids[start:])[:, None])[:, 0]
    return lp, float(z.abs().max())


def next_token_law(model, prefix: list[int], temperature: float, top_p: float, vocab: int, penalty: float = 1.0):
    """softmax(z / T) within the smallest set of most likely tokens holding >= top_p of the mass, renormalised,
    in float64 from the fp32 logits; ``penalty`` != 1 applies HF's repetition penalty to the prefix's tokens
    first (the control). Also returns the distance of the nucleus edge from top_p (fp32 rounding could move a
    token across an edge closer than about 1e-6)."""
    with torch.no_grad():
        z = model(input_ids=torch.tensor([prefix])).logits[0, -1, :vocab].double()
    if penalty != 1.0:
        seen = torch.tensor(sorted(set(prefix)))
        z[seen] = torch.where(z[seen] > 0, z[seen] / penalty, z[seen] * penalty)
    p = torch.softmax(z / temperature, -1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order] = before < top_p
    edge = float((before - top_p).abs().min())
    p = torch.where(keep, p, 0.0)
    return p / p.sum(), edge


def chi_squared_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's χ² of ``counts`` against ``probs``, cells with an expected count below 5 pooled into one (the
    approximation's usual validity condition); a draw outside the law's support gives p = 0."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    big = ~small & (probs > 0)
    obs = torch.cat([counts[big], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[small].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))


def chi_squared_prefix(model, tokenizer) -> list[int]:
    """A prefix that holds the most likely next tokens of a short prompt, where a leaked repetition penalty would
    move the most mass (as ``test_rollout_policy``'s)."""
    base = tokenizer("Reverse the word: cat", add_special_tokens=False)["input_ids"]
    law, _ = next_token_law(model, base, 1.0, 1.0, len(tokenizer))
    return base + [int(t) for t in law.argsort(descending=True)[:6]]


def check_sampling_law(client: EngineClient, model, tokenizer, n: int = 2000) -> dict:
    """The χ² test and its two controls on ``client``'s engine; returns the p-values."""
    vocab = len(tokenizer)
    prefix = chi_squared_prefix(model, tokenizer)
    T, top_p = 0.7, 0.9
    law, edge = next_token_law(model, prefix, T, top_p, vocab)
    assert edge > 1e-4, f"the nucleus edge is {edge:.2g} from top_p: rounding could move a token across it"
    spec = SamplingSpec(temperature=T, top_p=top_p, max_new_tokens=1, eos_ids=())
    rollouts = client.generate([prefix] * n, spec, seeds=list(range(1000, 1000 + n)))
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in rollouts]), minlength=vocab).double()
    wrong_t, _ = next_token_law(model, prefix, 1.0, top_p, vocab)
    leaked, _ = next_token_law(model, prefix, T, top_p, vocab, penalty=LEAKY_GENERATION_CONFIG["repetition_penalty"])
    out = {
        "p": chi_squared_p(counts, law),
        "p_wrong_temperature": chi_squared_p(counts, wrong_t),
        "p_leaked_penalty": chi_squared_p(counts, leaked),
        "nucleus": int((law > 0).sum()),
    }
    print(f"χ² on {n} draws: {out}")
    # under the law, p < P_MIN happens with probability P_MIN (χ² approximation with cells >= 5)
    assert out["p"] > P_MIN, out
    assert out["p_wrong_temperature"] < P_CONTROL and out["p_leaked_penalty"] < P_CONTROL, out
    return out


def check_rollout_logprobs(client: EngineClient, model, tokenizer, prompts: list[list[int]]) -> float:
    """Sampled tokens' reported log-probs (at T 0.7, top-p 0.9) against this process's fp32 forward at
    temperature 1, within two forwards' rounding; and far from the tempered law's values (so they are raw)."""
    vocab = len(tokenizer)
    spec = SamplingSpec(temperature=0.7, top_p=0.9, max_new_tokens=12, eos_ids=(tokenizer.eos_token_id,))
    rollouts = client.generate(prompts, spec, seeds=list(range(len(prompts))))
    worst, tempered_gap, tol = 0.0, math.inf, 0.0
    for prompt, r in zip(prompts, rollouts):
        assert len(r.token_ids) == len(r.logprobs) >= 1
        ids = prompt + r.token_ids
        mine, top = token_logprobs(model, ids, len(prompt), vocab)
        tol = max(tol, two_computations(forward_bound(model.config, len(ids), top, vocab)))
        worst = max(worst, float((mine - torch.tensor(r.logprobs)).abs().max()))
        with torch.no_grad():
            z = model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1 : -1, :vocab].double()
        tempered = torch.log_softmax(z / 0.7, -1).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
        tempered_gap = min(tempered_gap, float((tempered - torch.tensor(r.logprobs).double()).abs().max()))
    print(
        f"max |engine - HF| log p of {sum(len(r.token_ids) for r in rollouts)} sampled tokens: {worst:.2e} "
        f"(bound {tol:.2e}); closest rollout to the tempered law's values: {tempered_gap:.2e}"
    )
    assert worst <= tol
    assert tempered_gap > 100 * tol  # reporting log softmax(z/T) instead would fail by far
    return worst


def perturbed_state(model, seed: int = 11) -> dict[str, torch.Tensor]:
    """The model's weights with the (tied) embedding and one norm moved, under HF names, without the tied
    ``lm_head.weight`` (as a trainer publishes them)."""
    g = torch.Generator().manual_seed(seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    emb = state["model.embed_tokens.weight"]
    state["model.embed_tokens.weight"] = emb + 0.5 * emb.std() * torch.randn(emb.shape, generator=g)
    state["model.norm.weight"] = state["model.norm.weight"] * 1.1
    return state


def model_with(directory: Path, state: dict[str, torch.Tensor], head_from=None):
    """The HF model of ``directory`` with ``state`` loaded (tied head follows the embedding); with ``head_from``
    the head is untied and keeps that model's embedding ("new embedding, old head")."""
    model = load_hf(directory)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    if head_from is not None:
        model.lm_head.weight = torch.nn.Parameter(head_from.model.embed_tokens.weight.detach().clone())
    return model


def served_gap(client: EngineClient, model, probe: list[int], vocab: int) -> tuple[float, float]:
    """max |engine prompt log-probs - ``model``'s| over ``probe``, and the two-forward bound."""
    mine, top = token_logprobs(model, probe, 1, vocab)
    served = torch.tensor(client.prompt_logprobs(probe))
    return float((served - mine).abs().max()), two_computations(forward_bound(model.config, len(probe), top, vocab))


# ---- the bundled server ----------------------------------------------------------------------------------------

BUNDLED_ARCH = ArchConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory, char_tokenizer) -> Path:
    return save_student(tmp_path_factory.mktemp("engine_student"), char_tokenizer, BUNDLED_ARCH)


def serve(directory: Path, **options) -> ServerThread:
    opts = ServerOptions(model_name=MODEL, max_batch_size=256, max_wait_ms=5, **options)
    return ServerThread(server_app.create_app(str(directory), opts))


@pytest.fixture(scope="module")
def engine(student_dir):
    srv = serve(student_dir, weight_updates=True)
    yield srv
    srv.close()


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["Reverse the word: cat", "Add 12 and 30", "Sort: b a c", "Uppercase: hello world", "Count: a b"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_bundled_rollout_logprobs_are_the_models_raw_log_softmax(engine, student_dir, char_tokenizer):
    client = EngineClient(engine.url, MODEL)
    check_rollout_logprobs(client, load_hf(student_dir), char_tokenizer, _prompts(char_tokenizer) * 2)


def test_bundled_seeds_repeat_and_each_stop_id_ends_a_rollout(engine, char_tokenizer):
    """Same seeds, same rollouts; other seeds, others. With a second stop id, each rollout is the first run's
    cut after the first stop id it holds (the seeded draws before it are the same), finish_reason "stop";
    the rest end at max_new_tokens with "length"."""
    client = EngineClient(f"{engine.url}/v1/", MODEL)  # root + /v1 (and a trailing slash) work as the root
    prompts, eos = _prompts(char_tokenizer) * 4, char_tokenizer.eos_token_id
    seeds = list(range(len(prompts)))
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=24, eos_ids=())
    first = client.generate(prompts, spec, seeds)
    assert [r.token_ids for r in client.generate(prompts, spec, seeds)] == [r.token_ids for r in first]
    assert [r.token_ids for r in client.generate(prompts, spec, [s + 100 for s in seeds])] != [
        r.token_ids for r in first
    ]
    counts = torch.bincount(torch.tensor([t for r in first for t in r.token_ids if t != eos]))
    extra = int(counts.argmax())  # a token that occurs: a stop id that will be hit
    stops = (eos, extra)
    second = client.generate(prompts, SamplingSpec(1.0, 1.0, 24, stops), seeds)
    hit = {eos: 0, extra: 0}
    for a, b in zip(first, second):
        cut = next((i for i, t in enumerate(a.token_ids) if t in stops), None)
        if cut is None:
            assert (b.token_ids, b.finish_reason) == (a.token_ids, "length") and len(b.token_ids) == 24
        else:
            assert (b.token_ids, b.finish_reason) == (a.token_ids[: cut + 1], "stop")
            hit[a.token_ids[cut]] += 1
    print(f"rollouts ended by each stop id: {hit}")
    assert hit[extra] > 0
    # the model's own EOS stops without being asked (it is also in every rollout run's eos_ids)
    assert all(r.finish_reason == "stop" for r in first if eos in r.token_ids)
    assert all(eos not in r.token_ids[:-1] for r in first)


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_p": 0.1}, "min_p"),
        ({"n": 2}, "'n'"),
        ({"top_k": 5}, "top_k"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 3}, "logprobs"),
        ({"prompt": [[1, 2], [3, 4]]}, "one prompt"),
        ({"prompt": "text"}, "token ids"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bundled_generation_refuses_what_it_does_not_implement(engine, override, needle):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, **override}
    status, answer = _post_json(f"{engine.url}/v1/completions", body)
    assert status == 400 and needle in answer["error"]["message"], answer


def test_bundled_sampling_follows_the_students_softmax_at_t_and_top_p(engine, student_dir, char_tokenizer):
    check_sampling_law(EngineClient(engine.url, MODEL, concurrency=64), load_hf(student_dir), char_tokenizer)


@pytest.mark.parametrize("fault", [False, True])
def test_bundled_weight_load_refreshes_the_tied_head_and_the_fault_keeps_old_weights(
    student_dir, char_tokenizer, tmp_path, fault
):
    """After load_weights of a perturbed state dict (tied embedding moved), the engine's prompt log-probs equal
    the new model's forward, far from the old one's; under ``ignore_weight_updates`` (fault injection) the load
    answers the same and the engine still equals the OLD model."""
    vocab, probe = len(char_tokenizer), _prompts(char_tokenizer)[3]
    old = load_hf(student_dir)
    state = perturbed_state(old)
    path = tmp_path / "policy-v1.safetensors"
    save_file(state, str(path))
    new = model_with(student_dir, state)
    srv = serve(student_dir, weight_updates=True, ignore_weight_updates=fault)
    try:
        client = EngineClient(srv.url, MODEL)
        result = client.load_weights(str(path))
        assert result["loaded"] == len(state) and result["seconds"] >= 0
        gap_new, tol = served_gap(client, new, probe, vocab)
        gap_old, tol_old = served_gap(client, old, probe, vocab)
    finally:
        srv.close()
    print(
        f"fault={fault}: load {result['seconds'] * 1e3:.1f} ms; |served - new| {gap_new:.2e}, "
        f"|served - old| {gap_old:.2e} (bounds {tol:.2e}, {tol_old:.2e})"
    )
    fresh, stale = (gap_old, gap_new) if fault else (gap_new, gap_old)
    assert fresh <= max(tol, tol_old) and stale > 1000 * max(tol, tol_old)


def test_bundled_weight_route_is_off_by_default_and_checks_its_input(engine, student_dir, tmp_path):
    srv = serve(student_dir)
    try:
        status, answer = _post_json(f"{srv.url}/collective_rpc", {"method": "ars_opd_load_weights", "kwargs": {}})
        assert status == 404 and "--weight-updates" in answer["error"]["message"]
    finally:
        srv.close()
    client = EngineClient(engine.url, MODEL)
    status, answer = _post_json(f"{engine.url}/collective_rpc", {"method": "reload_weights"})
    assert status == 400 and "ars_opd_load_weights" in answer["error"]["message"]
    save_file({"model.no_such.weight": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(EngineRequestError, match="does not"):
        client.load_weights(str(tmp_path / "bad.safetensors"))
    with pytest.raises(EngineRequestError, match="no weights file"):
        client.load_weights(str(tmp_path / "missing.safetensors"))


def test_bundled_server_functions_take_at_most_six_parameters():
    too_many = []
    for path in sorted(SERVER_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + [
                    x.arg for x in (a.vararg, a.kwarg) if x is not None
                ]
                n = len([x for x in names if x not in ("self", "cls")])
                if n > 6:
                    too_many.append(f"{path.name}:{node.lineno} {node.name} ({n})")
    assert not too_many, too_many


# ---- the client's errors, against a fake server ------------------------------------------------------------------


def _post_json(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _fake(completion: dict | None, status: int = 200, health: int = 200) -> ServerThread:
    async def completions(request):
        if completion is None:
            return web.json_response(
                {"error": {"message": "EngineCore encountered an issue. See stack trace"}}, status=500
            )
        return web.json_response(completion, status=status)

    async def health_route(request):
        return web.json_response({}, status=health)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health_route)
    return ServerThread(app)


def test_client_names_a_dead_engine_and_a_server_without_token_ids():
    spec = SamplingSpec(1.0, 1.0, 4, (2,))
    dead = _fake(None, health=503)
    try:
        client = EngineClient(dead.url, MODEL)
        with pytest.raises(EngineDeadError, match=f"{dead.url} is dead.*EngineCore"):
            client.generate([[1, 2]] * 3, spec, [0, 1, 2])
        with pytest.raises(EngineDeadError, match="503"):
            client.check_alive()
    finally:
        dead.close()
    text_only = {"choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}]}
    old = _fake(text_only)
    try:
        with pytest.raises(EngineResponseError, match="return_token_ids"):
            EngineClient(old.url, MODEL).generate([[1, 2]], spec, [0])
        EngineClient(old.url, MODEL).check_alive()  # 200: alive
    finally:
        old.close()
    with pytest.raises(EngineDeadError, match="127.0.0.1:9"):
        EngineClient("http://127.0.0.1:9", MODEL).check_alive()
    # nothing listening: a generate's retries get no HTTP answer, then /health gets none either: dead, not a
    # failed request (what vLLM's API server leaves once its EngineCore died: it exits)
    quick = ClientSettings(
        base_url="http://127.0.0.1:9/v1", limits=EndpointConfig(max_attempts=2, backoff_base_s=0.01, backoff_max_s=0.01)
    )
    with pytest.raises(EngineDeadError, match="127.0.0.1:9 is dead"):
        EngineClient("http://127.0.0.1:9", MODEL, quick).generate([[1]], spec, [0])
    with pytest.raises(ValueError, match="one seed per prompt"):
        EngineClient("http://127.0.0.1:9", MODEL).generate([[1]], spec, [])


# ---- real vLLM ------------------------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_rollout_logprobs_are_the_models_raw_log_softmax(vllm_student, char_tokenizer):
    client = EngineClient(vllm_student.url, vllm_student.model)
    check_rollout_logprobs(client, load_hf(vllm_student.model_dir), char_tokenizer, _prompts(char_tokenizer) * 2)


@pytest.mark.vllm
def test_vllm_stop_ids_end_rollouts_with_the_id_and_seeds_repeat(vllm_student, char_tokenizer):
    client = EngineClient(vllm_student.url, vllm_student.model)
    prompts, eos = _prompts(char_tokenizer) * 4, char_tokenizer.eos_token_id
    seeds = list(range(len(prompts)))
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=24, eos_ids=())
    first = client.generate(prompts, spec, seeds)
    assert [r.token_ids for r in client.generate(prompts, spec, seeds)] == [r.token_ids for r in first]
    counts = torch.bincount(torch.tensor([t for r in first for t in r.token_ids if t != eos]))
    extra = int(counts.argmax())
    stops = (eos, extra)
    second = client.generate(prompts, SamplingSpec(1.0, 1.0, 24, stops), seeds)
    hit = 0
    for a, b in zip(first, second):
        cut = next((i for i, t in enumerate(a.token_ids) if t in stops), None)
        if cut is None:
            assert (b.token_ids, b.finish_reason) == (a.token_ids, "length")
        else:
            # the stop id is in token_ids, as the EOS is
            assert (b.token_ids, b.finish_reason) == (a.token_ids[: cut + 1], "stop"), (a, b)
            hit += a.token_ids[cut] == extra
    assert hit > 0


@pytest.mark.vllm
def test_vllm_sampling_follows_the_students_softmax_at_t_and_top_p(vllm_student, char_tokenizer):
    client = EngineClient(vllm_student.url, vllm_student.model, concurrency=32)
    check_sampling_law(client, load_hf(vllm_student.model_dir), char_tokenizer)


@pytest.mark.vllm
def test_vllm_extension_refreshes_the_tied_head_where_reload_weights_leaves_it_stale(
    vllm_student, char_tokenizer, tmp_path
):
    """Stock ``reload_weights`` (the extension's control method) serves "new embedding, old head"; the
    extension's ``ars_opd_load_weights`` serves the new model; then the original weights are loaded back."""
    client = EngineClient(vllm_student.url, vllm_student.model)
    vocab, probe = len(char_tokenizer), _prompts(char_tokenizer)[3]
    old = load_hf(vllm_student.model_dir)
    state = perturbed_state(old)
    path, original = tmp_path / "policy-v1.safetensors", tmp_path / "policy-v0.safetensors"
    save_file(state, str(path))
    save_file({k: v.contiguous() for k, v in old.state_dict().items() if k != "lm_head.weight"}, str(original))
    new, hybrid = model_with(vllm_student.model_dir, state), model_with(vllm_student.model_dir, state, head_from=old)
    try:
        status, answer = _post_json(
            f"{vllm_student.root}/collective_rpc",
            {"method": "ars_opd_reload_weights_only", "kwargs": {"path": str(path)}},
        )
        assert status == 200, answer
        stock = {name: served_gap(client, m, probe, vocab) for name, m in (("new", new), ("hybrid", hybrid))}
        # the fingerprint reads the head back through its kernel: the stale tied head is named, nothing else
        aliases = {"lm_head.weight": "model.embed_tokens.weight"}
        stock_print = compare(client.fingerprint(), TrainerHashes(state, aliases))
        # the trainer's version probe refuses the stale head (ars_opd.rollouts.verify)
        ids = probe_ids(vocab, 33, seed=0)
        new_lp, max_logit = trainer_logprobs(new, ids, torch.device("cpu"))
        old_lp, _ = trainer_logprobs(old, ids, torch.device("cpu"))
        bound = probe_bound(new.config, len(ids) - 1, max_logit, new.config.vocab_size)
        with pytest.raises(StaleEngineError, match="does not serve policy version 1"):
            check_probe(client.prompt_logprobs(ids), new_lp, old_lp, bound, client.url, 1)
        result = client.load_weights(str(path))
        ours = {name: served_gap(client, m, probe, vocab) for name, m in (("new", new), ("hybrid", hybrid))}
        ours_print = compare(client.fingerprint(), TrainerHashes(state, aliases))
        fresh = check_probe(client.prompt_logprobs(ids), new_lp, old_lp, bound, client.url, 1)
        assert fresh.max_abs_diff <= bound and fresh.distinguishable
    finally:
        restored = client.load_weights(str(original))
    back = served_gap(client, old, probe, vocab)
    print(f"stock reload_weights: {stock}; ars_opd_load_weights ({result}): {ours}; restored ({restored}): {back}")
    assert result["loaded"] == len(state) and result["refreshed"] >= 1 and result["vocab"] == vocab
    # every tensor read exactly (the linear layers and the head through their kernels, vocabulary padding off)
    assert ours_print.verified == len(state) + 1 and not ours_print.unread and not ours_print.mismatched
    assert stock_print.mismatched == ["lm_head.weight"] and stock_print.verified == len(state)
    assert ours["new"][0] <= ours["new"][1] and ours["hybrid"][0] > 1000 * ours["hybrid"][1]
    assert back[0] <= back[1]
    # the control: the stock path alone leaves the tied head stale (documented on vLLM CPU 0.32)
    assert stock["hybrid"][0] <= stock["hybrid"][1] and stock["new"][0] > 1000 * stock["new"][1]


@pytest.mark.vllm
def test_vllm_dead_engine_is_named_dead_not_retried_into_a_request_error(vllm_student):
    """A real dead engine: the EngineCore process of the module's vLLM killed. The request in flight gets vLLM's
    500 "EngineCore encountered an issue"; the API server then exits, so later requests are refused. Both must
    raise EngineDeadError naming the URL (the trainer stops and says to restart and re-sync), never an
    EngineRequestError after retries nor a hang. Kills this module's vLLM: keep it the module's last test."""
    import psutil

    client = EngineClient(vllm_student.url, vllm_student.model)
    spec = SamplingSpec(1.0, 1.0, 4, (2,))
    assert len(client.generate([[5, 6, 7]], spec, [0])) == 1  # alive
    port = vllm_student.root.rsplit(":", 1)[1]
    servers = [  # this module's API server (the session's vLLM teachers run beside it, on other ports)
        p
        for p in psutil.process_iter(["cmdline"])
        if "api_server" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])
    ]
    assert len(servers) == 1, servers
    cores = [c for c in servers[0].children(recursive=True) if "EngineCore" in " ".join(c.cmdline())]
    assert cores, [c.cmdline() for c in servers[0].children(recursive=True)]
    for c in cores:
        c.kill()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"{vllm_student.root} is dead"):
        client.generate([[5, 6, 7]] * 4, spec, [1, 2, 3, 4])
    with pytest.raises(EngineDeadError, match=f"{vllm_student.root} is dead"):
        client.generate([[5, 6, 7]], spec, [5])  # the API server is gone by now, or answers 500 again
    with pytest.raises(EngineDeadError):
        client.check_alive()
    assert time.monotonic() - t0 < 120  # named at once or after the retries' backoff, never a hang
