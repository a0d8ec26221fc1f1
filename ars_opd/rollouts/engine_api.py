"""The trainer's client of a rollout engine: an OpenAI-compatible server serving the student (the bundled
server with ``--weight-updates``, or vLLM started with ``VLLMOptions(weight_sync=True)``).

``EngineClient`` speaks four requests, the same bodies to both servers:

- ``generate(prompts, spec, seeds)``: one ``POST /v1/completions`` per prompt, ``{"model", "prompt": [ids],
  "max_tokens", "temperature", "top_p", "top_k": 0, "min_p": 0, "presence_penalty": 0, "frequency_penalty": 0,
  "repetition_penalty": 1, "logprobs": 0, "return_token_ids": true, "seed", "stop_token_ids",
  "skip_special_tokens": false}``; the penalties are sent at their neutral values so that no server default
  (a checkpoint's generation_config) can apply. Each answer gives ``choices[0].token_ids`` (the sampled ids,
  with the EOS id a rollout stopped on), ``choices[0].logprobs.token_logprobs`` (each sampled token's raw
  log-probability: the model's log-softmax at temperature 1, vLLM's ``--logprobs-mode raw_logprobs``) and
  ``finish_reason``. One request per prompt, each with its own seed, is the seeding scheme vLLM CPU survives
  (with ``--no-enable-chunked-prefill``: see ``ars_opd.rollouts.vllm_extension``), and what makes a rerun draw
  the same rollouts where the engine is deterministic. At most ``concurrency`` requests are in flight; the
  answers come back in the prompts' order, all of them or an error (never a partial list).
- ``load_weights(path)``: ``POST /collective_rpc {"method": "ars_opd_load_weights", "kwargs": {"path"}}`` ->
  the first worker's ``{"loaded", "seconds", ...}``; ``fingerprint()``: ``ars_opd_fingerprint`` the same way,
  the sha256 of each tensor the engine computes with (``ars_opd.rollouts.fingerprint``), or None from an engine
  without that method; ``reset_prefix_cache()``: vLLM's ``POST /reset_prefix_cache`` (dev mode), after every
  load, so that no rollout reuses KV blocks computed under the old weights.
- ``prompt_logprobs(ids)``: a scoring request (``prompt_logprobs: 0``, ``max_tokens: 1``, temperature 1):
  log p(ids[i] | ids[:i]) for i >= 1, under the served weights (the version probe).
- ``check_alive()``: ``GET /health``.

``post_route(path, body)`` posts to one of vLLM's weight-transfer routes (transport ``nccl``).

Errors (all ``EndpointError``s: one complete line, naming the URL): ``EngineDeadError`` when the engine
cannot serve any more (``/health`` 503, a 500 "EngineCore encountered an issue", or nothing listening), not
retried (a request that got no HTTP answer through its retries asks ``/health`` before it gives up: vLLM's API
server exits once its EngineCore died, so the requests after the first see a refused connection, which is a
dead engine, not a failed request); ``EngineResponseError`` for an answer that lacks what a rollout needs
(``token_ids`` when the server ignores ``return_token_ids``, ``token_logprobs``, a known ``finish_reason``);
``EngineRequestError`` for a refused request (4xx) or one that still fails after the retries of
``ClientSettings.limits`` (timeouts, 429, other 5xx, as every endpoint client retries:
``ars_opd.teacher.client.endpoint``); ``EngineSetupError`` for a weight load refused the ways vLLM is known to
refuse one (``load_refusal``: no worker extension, no ``/collective_rpc`` route, a model of other shapes), with
what the engine serves (``GET /v1/models``) and what to start instead.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from ars_opd.teacher.client.endpoint import ClientSettings, EndpointError, FinalError, RetryableError, with_retries
from ars_opd.teacher.client.score import parse_prompt_logprobs

DEAD_ENGINE_MARKER = "EngineCore encountered an issue"  # vLLM's 500 body once its engine core died
NO_ANSWER = ("connection_error", "timeout")  # the reasons of _post's failures that got no HTTP answer
LOAD_METHOD = "ars_opd_load_weights"
FINGERPRINT_METHOD = "ars_opd_fingerprint"
FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingSpec:
    """How rollouts are sampled: softmax(logits / temperature) within the top-p nucleus, up to
    ``max_new_tokens``, ending at any of ``eos_ids`` (sent as ``stop_token_ids``; the model's own EOS ids stop
    too)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class Rollout:
    """One completion: the sampled ids (ending with the EOS id when it stopped on one), each one's raw
    log-probability under the served weights, and ``finish_reason`` ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class EngineError(EndpointError):
    """A rollout engine failed; the message names its URL."""


class EngineDeadError(EngineError):
    """The engine cannot serve any more (its core died, or nothing listens): restart it."""


class EngineResponseError(EngineError):
    """The engine answered without what a rollout needs."""


class EngineRequestError(EngineError):
    """The engine refused a request, or it kept failing after the retries."""


class EngineSetupError(EngineError):
    """The engine serves, but not as a rollout engine of this run: started without the worker extension or the
    route that loads weights, or serving a model of other shapes than the student."""


EXTENSION_FIX = (
    "start vLLM with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls ars_opd_vllm_ext.ArsOpdWeightSync, with "
    "ars_opd/rollouts/vllm_extension.py copied as ars_opd_vllm_ext.py into a directory on its PYTHONPATH (README: "
    "Student rollouts on an engine), or let the stage start it (opd.engine.server: vllm); the bundled server needs "
    "--weight-updates"
)


def load_refusal(where: str, served: str, message: str) -> EngineSetupError | None:
    """What a refused weight load means, for the refusals vLLM is known to give (``message``: the failed
    request's error, with the engine's answer in it), as one complete line naming the engine (``where``), what it
    serves (``served``) and what to do; None for another refusal, whose own message stands.

    - no worker extension: vLLM's 500 "Worker failed with error ''CPUWorker' object has no attribute
      'ars_opd_load_weights''" (the method is looked up on its worker);
    - no ``/collective_rpc`` route: a 404 (vLLM without ``VLLM_SERVER_DEV_MODE=1``; the bundled server without
      ``--weight-updates``);
    - any other worker failure, e.g. "start (0) + length (128) exceeds dimension size (96)." or an empty cause
      (a failed shape assertion): the engine serves a model whose shapes are not the student's."""
    if LOAD_METHOD in message and ("has no attribute" in message or "is not implemented" in message):
        return EngineSetupError(
            f"the rollout engine at {where} (serving {served}) has no ars_opd worker extension, so it cannot load "
            f"the trainer's weights (its worker has no {LOAD_METHOD}). To fix: {EXTENSION_FIX}"
        )
    if "http_404" in message:
        return EngineSetupError(
            f"the rollout engine at {where} (serving {served}) has no POST /collective_rpc route (404), through "
            f"which the trainer has it load each version. To fix: {EXTENSION_FIX}"
        )
    failed = re.search(r"Worker failed with error '(.*?)'(?:, please check|$)", message) or re.search(
        r"Worker failed with error '(.*)", message
    )
    if failed is not None:
        cause = failed.group(1).strip() or "no cause given, as when a weight's shape does not match"
        return EngineSetupError(
            f"the rollout engine at {where} (serving {served}) failed to load the student's weights ({cause}): "
            "it must serve the models-stage student (the same architecture and shapes), since every version "
            "replaces its weights. Start it on the student's directory under paths.models_dir, or let the stage "
            "start it (opd.engine.server: bundled or vllm); restart it either way, a failed load can leave vLLM "
            "unable to serve"
        )
    return None


def server_root(url: str) -> str:
    """The server root: ``url`` without a trailing ``/`` and ``/v1``."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


class EngineClient:
    """A rollout engine at ``url`` (its root, or root + ``/v1``) serving ``model``; see the module docstring."""

    def __init__(self, url: str, model: str, settings: ClientSettings | None = None, concurrency: int = 16):
        self.root = server_root(url)
        self.url = f"{self.root}/v1"
        self.model = model
        self.settings = settings if settings is not None else ClientSettings(base_url=self.url)
        self.concurrency = max(1, concurrency)

    # -- the four requests -----------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[Rollout]:
        """One rollout per prompt, in order, each sampled with its own seed; all of them or an error."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds: one seed per prompt")
        return asyncio.run(self._generate(prompts, spec, seeds))

    def load_weights(self, path: str) -> dict:
        """Have the engine load the safetensors file ``path`` (a path the engine reads); its first worker's
        answer, ``{"loaded": n_tensors, "seconds": s, ...}``."""
        body = {"method": LOAD_METHOD, "kwargs": {"path": str(path)}}
        try:
            answer = asyncio.run(self._one("/collective_rpc", body, retry=False))
        except EngineRequestError as e:
            refusal = load_refusal(self.root, self.served(), str(e))
            if refusal is None:
                raise
            raise refusal from None
        results = answer.get("results")
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise EngineResponseError(
                f"the rollout engine {self.root} answered /collective_rpc {LOAD_METHOD} with {str(answer)[:200]}, "
                "not {'results': [{'loaded', 'seconds'}]}: is it vLLM with the ars_opd worker extension "
                "(VLLMOptions.weight_sync) or the bundled server with --weight-updates?"
            )
        return results[0]

    def fingerprint(self) -> dict | None:
        """The first worker's ``{"tensors": {name: {"sha256", "dtype", "shape", "via"}}, ...}``; None when the
        engine has no such method (an older copy of the worker extension: its tensors are left to the probe)."""
        body = {"method": FINGERPRINT_METHOD, "kwargs": {}}
        try:
            answer = asyncio.run(self._one("/collective_rpc", body, retry=False))
        except EngineRequestError as e:
            known = ("has no attribute", "unknown method", "no method", "is not implemented")
            if FINGERPRINT_METHOD in str(e) and any(k in str(e) for k in known):
                return None
            raise
        results = answer.get("results")
        if not isinstance(results, list) or not results or not isinstance(results[0], dict):
            raise EngineResponseError(
                f"the rollout engine {self.root} answered /collective_rpc {FINGERPRINT_METHOD} with "
                f"{str(answer)[:200]}, not {{'results': [{{'tensors': ...}}]}}"
            )
        return results[0]

    def reset_prefix_cache(self, attempts: int = 20, wait_s: float = 0.25) -> None:
        """Have vLLM forget every cached prefix (``POST /reset_prefix_cache``, dev mode). A rollout request reads
        the prefix cache, so after a load it would reuse KV blocks computed under the old weights for a shared
        prefix (a chat template's), while the probe (``prompt_logprobs`` requests skip reading it) passes.
        vLLM refuses (``{"success": false}``) while blocks are still held; the trainer drained its requests
        before the load, so a refusal is retried briefly, then ``EngineSetupError``: never sample on a stale
        cache silently."""
        for attempt in range(attempts):
            try:
                answer = asyncio.run(self._one("/reset_prefix_cache", {}, retry=False))
            except EngineRequestError as e:
                raise EngineSetupError(
                    f"the rollout engine at {self.root} did not reset its prefix cache after loading new weights "
                    f"({e}); its rollouts could reuse KV blocks of the old weights. vLLM serves POST "
                    f"/reset_prefix_cache with VLLM_SERVER_DEV_MODE=1 (or start it with --no-enable-prefix-caching "
                    "and that route still answers)"
                ) from None
            if answer.get("success") is True:
                return
            time.sleep(wait_s)
        raise EngineSetupError(
            f"the rollout engine at {self.root} refused to reset its prefix cache {attempts} times after loading "
            f"new weights ({answer}): blocks are still held by requests the trainer did not send; its rollouts "
            "could reuse KV blocks of the old weights. Give the stage an engine of its own"
        )

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i = 1..len(ids)-1 under the served weights (temperature 1)."""
        body = {"model": self.model, "prompt": list(ids), "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        answer = asyncio.run(self._one("/v1/completions", body))
        try:
            return parse_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], list(ids)).logprobs
        except (KeyError, IndexError, TypeError, RetryableError) as e:
            raise EngineResponseError(
                f"the rollout engine {self.root} answered a prompt_logprobs request without usable prompt "
                f"log-probabilities ({e})"
            ) from None

    def post_route(self, path: str, body: dict) -> dict:
        """One ``POST <root><path>`` with a JSON body, not retried (a weight-transfer route of vLLM:
        ``ars_opd.rollouts.nccl_sync``); the JSON answer."""
        return asyncio.run(self._one(path, body, retry=False))

    def served(self) -> str:
        """What the engine serves, for messages: each model ``GET /v1/models`` lists, with the directory it was
        started on where it says (vLLM's ``root``); the name this client asks for when it does not answer."""
        try:
            answer = asyncio.run(self._get("/v1/models"))
            models = [f"{m['id']} from {m['root']}" if m.get("root") else str(m["id"]) for m in answer["data"]]
        except (EngineError, KeyError, TypeError):
            models = []
        return ", ".join(models) if models else f"{self.model!r}, as far as this run knows"

    def check_alive(self) -> None:
        """``GET /health``: returns when the engine serves; ``EngineDeadError`` naming the URL otherwise."""
        asyncio.run(self._health())

    # -- HTTP ------------------------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        limits = self.settings.limits
        headers = {} if self.settings.api_key in ("", "EMPTY") else {"Authorization": f"Bearer {self.settings.api_key}"}
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            timeout=aiohttp.ClientTimeout(total=limits.request_timeout_s, connect=min(10.0, limits.request_timeout_s)),
            headers=headers,
        )

    def _dead(self, why: str) -> EngineDeadError:
        return EngineDeadError(
            f"the rollout engine at {self.root} is dead: {why}. Its log holds the cause (for vLLM, the EngineCore "
            f"traceback). Restart it (serving {self.model!r}) and rerun the stage, which resumes from its last "
            "checkpoint and syncs the engine before its first rollout (an engine the stage started, it starts "
            "again; for one on a new port, set opd.engine.server to its URL)"
        )

    async def _health(self, session: aiohttp.ClientSession | None = None) -> None:
        own = session is None
        session = session or self._session()
        try:
            async with session.get(f"{self.root}/health") as r:
                if r.status == 503:
                    raise self._dead("GET /health answers 503")
                if r.status >= 400:
                    raise EngineRequestError(f"the rollout engine at {self.root} answers GET /health with {r.status}")
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise self._dead(f"GET /health failed ({type(e).__name__}: {e})") from None
        finally:
            if own:
                await session.close()

    async def _get(self, path: str) -> Any:
        """One ``GET <root><path>``, its JSON answer; ``EngineRequestError`` otherwise."""
        async with self._session() as session:
            try:
                async with session.get(f"{self.root}{path}") as r:
                    if r.status >= 400:
                        raise EngineRequestError(f"the rollout engine at {self.root}: GET {path} {r.status}")
                    return await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                raise EngineRequestError(f"the rollout engine at {self.root} failed GET {path}: {e}") from None

    async def _post(self, session: aiohttp.ClientSession, path: str, body: dict) -> dict:
        """One POST; ``RetryableError`` / ``FinalError`` as the shared retry loop expects, ``EngineDeadError``
        at once for a dead engine."""
        try:
            async with session.post(f"{self.root}{path}", json=body) as r:
                text = await r.text()
                status = r.status
        except asyncio.TimeoutError:
            raise RetryableError("timeout") from None
        except aiohttp.ClientConnectionError as e:
            raise RetryableError(f"connection_error: {e}") from None
        if status >= 500 and DEAD_ENGINE_MARKER in text:
            raise self._dead(f"POST {path} answered {status} '{DEAD_ENGINE_MARKER}'")
        if status == 503:
            await self._health(session)  # raises EngineDeadError when /health says so too
        if status >= 400:
            detail = " ".join(text.split())[:300]
            if status in (400, 401, 403, 404, 413, 422):
                raise FinalError(f"http_{status}: {detail}", status)
            raise RetryableError(f"http_{status}: {detail}")
        try:
            answer = json.loads(text)
        except ValueError:
            raise RetryableError(f"malformed_response: not JSON: {text[:120]!r}") from None
        if not isinstance(answer, dict):
            raise RetryableError(f"malformed_response: body is {type(answer).__name__}, not a JSON object")
        return answer

    async def _with_retries(self, session: aiohttp.ClientSession, path: str, body: dict, retry: bool = True) -> dict:
        async def call() -> dict:
            return await self._post(session, path, body)

        try:
            if not retry:
                try:
                    return await call()
                except RetryableError as e:
                    raise FinalError(e.reason) from None
            answer, _ = await with_retries(call, self.settings)
            return answer
        except (RetryableError, FinalError) as e:
            if e.reason.startswith(NO_ANSWER):  # no HTTP answer (refused, reset, timeout): is anything still serving?
                await self._health(session)  # EngineDeadError when nothing listens or /health says 503
            tries = f" after {e.attempts} attempt(s)" if e.attempts else ""
            raise EngineRequestError(
                f"the rollout engine at {self.root} failed POST {path}{tries}: {e.reason}"
            ) from None

    async def _one(self, path: str, body: dict, retry: bool = True) -> dict:
        async with self._session() as session:
            return await self._with_retries(session, path, body, retry)

    async def _generate(self, prompts: list[list[int]], spec: SamplingSpec, seeds: list[int]) -> list[Rollout]:
        gate = asyncio.Semaphore(self.concurrency)
        async with self._session() as session:

            async def one(prompt: list[int], seed: int) -> Rollout:
                async with gate:
                    answer = await self._with_retries(
                        session, "/v1/completions", self._generate_body(prompt, spec, seed)
                    )
                return self._rollout(answer, spec)

            # the first error cancels the other requests: all rollouts or an error, never a partial list
            tasks = [asyncio.ensure_future(one(p, s)) for p, s in zip(prompts, seeds)]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    def _generate_body(self, prompt: list[int], spec: SamplingSpec, seed: int) -> dict:
        return {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": spec.max_new_tokens,
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": 0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": int(seed),
            "stop_token_ids": list(spec.eos_ids),
            "skip_special_tokens": False,
        }

    def _rollout(self, answer: dict[str, Any], spec: SamplingSpec) -> Rollout:
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EngineResponseError(
                f"the rollout engine at {self.root} answered without choices: {str(answer)[:200]}"
            )
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise EngineResponseError(
                f"the rollout engine at {self.root} returned no choices[0].token_ids: it does not support "
                "return_token_ids (vLLM >= 0.10.2 and the bundled server do); rollouts are never re-tokenised from text"
            )
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        ok = isinstance(lps, list) and len(lps) == len(ids)
        if not ok or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in lps):
            raise EngineResponseError(
                f"the rollout engine at {self.root} returned no finite logprobs.token_logprobs for each of the "
                f"{len(ids)} sampled tokens (got {str(lps)[:120]}); it must honour logprobs: 0"
            )
        finish = choice.get("finish_reason")
        if finish not in FINISH_REASONS or not ids or len(ids) > spec.max_new_tokens:
            raise EngineResponseError(
                f"the rollout engine at {self.root} returned {len(ids)} tokens with finish_reason {finish!r} "
                f"for max_tokens {spec.max_new_tokens}"
            )
        return Rollout([int(t) for t in ids], [float(v) for v in lps], finish)
