"""A rollout engine served from this process over real HTTP, for the opd stage's tests that need no real one.

``FakeEngine(model_dir)`` answers the requests of ``ars_opd.rollouts.engine_api.EngineClient`` from a Hugging
Face model it loads from ``model_dir`` (the models-stage student, as a started engine serves it):

- ``POST /v1/completions``: a rollout (the sampled ids and each one's log-softmax at temperature 1, drawn at the
  request's temperature from a generator seeded with its seed, up to ``max_tokens``, stopping at its stop ids)
  or, with ``prompt_logprobs``, the prompt's log-probabilities (the version probe);
- ``POST /collective_rpc`` ``ars_opd_load_weights``: loads the published file into the model and records its
  path (``stale``: answers and keeps its weights, as an engine that did not take them); ``ars_opd_fingerprint``:
  the hashes of its model's tensors, as the bundled server gives them;
- ``POST /reset_prefix_cache``: counted, answered as vLLM answers it;
- ``GET /health`` and ``GET /v1/models`` (its name and model directory, as vLLM lists them).

``die_after=n``: from the (n+1)-th rollout request on it is dead, as vLLM once its engine core crashed (a 500
"EngineCore encountered an issue", ``/health`` 503). ``load_error=(status, body)``: every load is answered so
(a vLLM error body, say). ``stale_sampling``: it samples with the weights it started with whatever it loaded,
while the probe and the fingerprint see the loaded ones (as an engine restarted between a sync and its
rollouts, or stale only in its decode path).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from aiohttp import web

from server_thread import ServerThread


class FakeEngine:
    def __init__(
        self,
        model_dir: str | Path,
        name: str = "student",
        stale: bool = False,
        die_after: int | None = None,
        load_error: tuple[int, dict] | None = None,
        stale_sampling: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.model_dir, self.name = str(model_dir), name
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.stale, self.die_after, self.load_error = stale, die_after, load_error
        # what it samples with: the loaded model, or (stale_sampling) the weights it started with
        self.sampler = copy.deepcopy(self.model) if stale_sampling else self.model
        self.loaded: list[str] = []  # the paths it was asked to load
        self.rollouts = 0  # rollout requests answered
        self.resets = 0  # prefix-cache resets asked (it has no cache: each answered as vLLM answers)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.server = ServerThread(app)
        self.url = f"{self.server.url}/v1"

    @property
    def dead(self) -> bool:
        return self.die_after is not None and self.rollouts >= self.die_after

    async def health(self, request):
        return web.json_response({}, status=503 if self.dead else 200)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": self.name, "root": self.model_dir}]})

    async def collective_rpc(self, request):
        body = await request.json()
        if body.get("method") == "ars_opd_fingerprint":
            from ars_opd.serving.server.weights import state_fingerprint

            return web.json_response({"results": [{"tensors": state_fingerprint(self.model)}]})
        if body.get("method") != "ars_opd_load_weights":
            return web.json_response({"error": {"message": f"no method {body.get('method')}"}}, status=400)
        if self.load_error is not None:
            status, answer = self.load_error
            return web.json_response(answer, status=status)
        from safetensors.torch import load_file

        path = body["kwargs"]["path"]
        self.loaded.append(path)
        state = load_file(path)
        if not self.stale:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        return web.json_response({"results": [{"loaded": len(state), "seconds": 0.0}]})

    async def reset_prefix_cache(self, request):
        self.resets += 1
        return web.json_response({"success": True})

    async def completions(self, request):
        body = await request.json()
        if self.dead:
            message = "EngineCore encountered an issue. See stack trace (above) for the root cause."
            return web.json_response({"error": {"message": message, "code": 500}}, status=500)
        ids = list(body["prompt"])
        if body.get("prompt_logprobs") is not None:
            logp = self._logprobs(ids)
            rows = [None] + [{str(ids[i]): {"logprob": float(logp[i - 1, ids[i]])}} for i in range(1, len(ids))]
            return web.json_response({"choices": [{"prompt_logprobs": rows}]})
        self.rollouts += 1
        return web.json_response({"choices": [self._rollout(ids, body)]})

    @torch.no_grad()
    def _logprobs(self, ids: list[int], model=None) -> torch.Tensor:
        return torch.log_softmax((model or self.model)(torch.tensor([ids])).logits[0].double(), -1)

    def _rollout(self, prompt: list[int], body: dict) -> dict:
        generator = torch.Generator().manual_seed(int(body["seed"]))
        stops, temperature = set(body.get("stop_token_ids") or ()), float(body["temperature"])
        out: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        for _ in range(int(body["max_tokens"])):
            logp = self._logprobs(prompt + out, self.sampler)[-1]
            if temperature == 0:
                token = int(logp.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logp / temperature, -1), 1, generator=generator))
            out.append(token)
            logprobs.append(float(logp[token]))
            if token in stops:
                finish = "stop"
                break
        return {"token_ids": out, "logprobs": {"token_logprobs": logprobs}, "finish_reason": finish}

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
