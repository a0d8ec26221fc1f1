"""The bundled server's engine: the loaded model, the queue of waiting requests and the batcher that serves them.

A batcher task takes the first waiting request, waits ``max_wait_ms`` for others (again while a burst is
still arriving), and runs them in arrival order, up to ``max_batch_size`` rows and ``max_batch_tokens``
(rows × longest ``max_tokens``: the queue and its batches are ``ars_opd.serving.server.admission``) in a
single worker thread, so the event loop keeps accepting requests while the next batch gathers. What a batch
computes there is the engine's other half, ``ars_opd.serving.server.runner``: its scoring rows
(``/v1/completions`` with ``prompt_logprobs``, ``ars_opd.serving.server.scoring``) as one forward, then its
chat rows and token-id generation rows (``/v1/completions`` without ``prompt_logprobs``,
``ars_opd.serving.server.generation``: chat rows without a template) through one ``model.generate`` call,
with per-row sampling and stopping, streaming tokens while they are generated. The rows and the events that
answer them are ``ars_opd.serving.server.jobs``; the counters at ``GET /stats`` are
``ars_opd.serving.server.stats``.

Weight loads (``load_weights``, the ``/collective_rpc`` route) take the lock each batch holds while it runs
and load on the generation thread, so they fall between batches and no row sees a half-loaded model; so does
the fingerprint of the loaded weights (``fingerprint``) that the trainer's version check asks for.

The model's ``generation_config.json`` sampling defaults are ignored: the request's parameters (OpenAI
defaults: temperature 1, top_p 1) decide the decoding alone. On stop, the running batch ends at its next
decoding step and requests still in flight are answered with 503.

Requests reach the queue prepared: decoded, validated and tokenized off the event loop by the engine's
``requests`` (``ars_opd.serving.server.preparation``), which the engine starts and stops with its batcher.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ars_opd.serving.server.admission import Limits, RowQueue, Throughput, plan
from ars_opd.serving.server.generation import GenerateRequest
from ars_opd.serving.server.jobs import Job, ScoreJob
from ars_opd.serving.server.options import ServerOptions
from ars_opd.serving.server.preparation import RequestPreparer
from ars_opd.serving.server.runner import BatchRunner
from ars_opd.serving.server.scoring import ScoreRequest
from ars_opd.serving.server.stats import ServerStats  # also where tests ask it
from ars_opd.serving.server.validation import ChatRequest, RequestError
from ars_opd.serving.server.weights import load_state_file, state_fingerprint

log = logging.getLogger(__name__)

GATHER_WAITS = 20  # a batch waits for company at most this many times max_wait_ms (100 ms at the default 5 ms)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


class TeacherEngine(BatchRunner):
    """The loaded model and tokenizer, the queue of waiting requests, and the batcher that serves them; what a
    batch computes on the worker thread is ``BatchRunner``'s."""

    def __init__(self, model_dir: str, options: ServerOptions = ServerOptions()):
        self.model_name = options.model_name or Path(os.path.normpath(model_dir)).name
        self.max_batch_size, self.max_wait_s = options.max_batch_size, options.max_wait_ms / 1000.0
        self.options = options
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer in {model_dir} has no chat template; a chat server needs one")
        self.device = torch.device(options.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[options.dtype]).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"neither the tokenizer nor the generation config in {model_dir} names an EOS token")
        self.eos_ids = frozenset(eos)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
        # a fresh config drops the checkpoint's sampling defaults (temperature, top_k, repetition penalty...):
        # the request's parameters, applied by RowSampler, are the only decoding policy
        self.model.generation_config = GenerationConfig(eos_token_id=sorted(self.eos_ids), pad_token_id=self.pad_id)
        self.context_length = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.vocab = len(self.tokenizer)  # scored ids; embedding rows beyond the tokenizer are padding
        self.requests = RequestPreparer(
            self.tokenizer, self.model_name, self.context_length, self.vocab, options.max_logprobs
        )
        self._warm_up()
        self._token_text: dict[int, str] = {}
        self.stats = ServerStats()
        self.throughput = Throughput()
        self.stopping = False
        self._pending: RowQueue | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._batcher: asyncio.Task | None = None
        self._model_lock: asyncio.Lock | None = None  # held by a batch while it runs, and by a weight load

    def _warm_up(self) -> None:
        """One two-token generate before serving: a fresh process's first calls set up threads, kernels and
        memory, and the first batch, timed with them, would make the wait estimate take the server for slow
        just when the first requests arrive (and push them back)."""
        ids = self.tokenizer("warm up", add_special_tokens=False)["input_ids"] or [self.pad_id]
        with torch.inference_mode():
            self.model.generate(
                input_ids=torch.tensor([ids], device=self.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                do_sample=False,
                max_new_tokens=2,
            )

    # -- event loop side --------------------------------------------------------------------------------

    async def start(self) -> None:
        self._pending = RowQueue()
        self._model_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.requests.start()
        self._batcher = asyncio.create_task(self._batch_loop(), name="teacher-batcher")

    async def stop(self) -> None:
        """Refuse new requests, end the running batch at its next step with 503, and join the worker threads."""
        self.stopping = True
        for job in self._pending.drain() if self._pending is not None else ():
            job.fail(503, "the server is shutting down")
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        if self._executor is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        await self.requests.stop()

    def submit_scores(self, request: ScoreRequest) -> list[ScoreJob]:
        """One queued row per prompt; they join the same batches as chat requests' rows."""
        if self.stopping or self._pending is None:
            raise RequestError(503, "the server is shutting down", "unavailable")
        loop = asyncio.get_running_loop()
        jobs = [ScoreJob(ids, request.top_k or 0, loop, asyncio.Queue()) for ids in request.prompts]
        self.stats.scores += len(jobs)
        for job in jobs:
            self._pending.put(job)
        return jobs

    def submit(self, chat: ChatRequest, prompt_ids: list[int], max_tokens: int) -> Job:
        if self.stopping or self._pending is None:
            raise RequestError(503, "the server is shutting down", "unavailable")
        job = Job(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            temperature=chat.temperature,
            top_p=chat.top_p,
            # any integer is a valid seed; torch generators take 64 bits
            seed=chat.seed % (1 << 64) if chat.seed is not None else secrets.randbits(63),
            stop=chat.stop,
            stream=chat.stream,
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
        )
        self._admit(job)
        self.stats.completions += 1
        self._pending.put(job)
        return job

    def submit_generation(self, request: GenerateRequest) -> Job:
        """One queued row for a token-id generation request (``ars_opd.serving.server.generation``)."""
        if self.stopping or self._pending is None:
            raise RequestError(503, "the server is shutting down", "unavailable")
        job = Job(
            prompt_ids=request.prompt_ids,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed % (1 << 64) if request.seed is not None else secrets.randbits(63),
            stop=(),
            stream=False,
            loop=asyncio.get_running_loop(),
            events=asyncio.Queue(),
            stop_ids=request.stop_ids,
            logprobs=[] if request.logprobs else None,
        )
        self._admit(job)
        self.stats.generations += 1
        self._pending.put(job)
        return job

    def _admit(self, job: Job) -> None:
        """Refuse ``job`` with 429 and Retry-After when its estimated wait for an answer exceeds ``max_queue_s``:
        pushed back, its client waits and asks again instead of timing out in the queue, which costs a retry
        and, had the server not noticed the client leave, computing for nobody."""
        limit, pending = self.options.max_queue_s, self._pending
        if limit is None or (self.throughput.running is None and all(r.cancelled for r in pending)):
            return  # alone on an idle server it runs at once: refusing it could only delay it
        estimate = self.throughput.estimate_s(pending, job, self._limits())
        if estimate is None or estimate <= limit:
            return
        # the queue moves when the running batch ends: asking again sooner cannot find room
        left = self.throughput.running_left_s(self.throughput.step_model())
        retry = math.ceil(max(estimate - limit, left, 1.0))
        self.stats.pushed_back += 1
        raise RequestError(
            429,
            f"the server is busy: this request would be answered in about {estimate:.0f} s, over its limit of "
            f"{limit:.0f} s (max_queue_s); retry after {retry} s",
            "server_busy",
            headers={"Retry-After": str(retry)},
        )

    def _limits(self) -> Limits:
        """A batch's limits: ``max_batch_size``, ``max_batch_tokens`` and, under pushback once steps are timed,
        half of ``max_queue_s`` (a request that waits for one batch and runs in the next is then answered
        within it)."""
        limit = self.options.max_queue_s
        return self.throughput.limits(self.max_batch_size, self.options.max_batch_tokens, limit and limit / 2)

    async def load_weights(self, path: str) -> dict:
        """Load a safetensors file into the served model between batches: {"loaded", "seconds"}.

        Takes the lock a batch holds while it runs, then loads on the generation thread, so no batch ever
        runs on a half-loaded model; a file that does not fit the model is refused before any tensor is
        copied (``ars_opd.serving.server.weights``). Under the fault option ``ignore_weight_updates`` it
        reads and checks the file, answers the same, and keeps the old weights.
        """
        if self.stopping or self._model_lock is None:
            raise RequestError(503, "the server is shutting down", "unavailable")
        async with self._model_lock:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, self._load_weights, path)
        self.stats.weight_loads += 1
        return result

    def _load_weights(self, path: str) -> dict:
        start = time.perf_counter()
        options = self.options
        loaded = load_state_file(self.model, path, not options.ignore_weight_updates, options.keep_old_head)
        if options.ignore_weight_updates or options.keep_old_head:
            log.warning(
                "fault injection: loaded %s but kept the old %s", path, "head" if options.keep_old_head else "weights"
            )
        # "vocab": the ids its log-probabilities are normalised over (the tokenizer's), for the trainer's probe;
        # "prefix_cache": none here (every batch computes its prompts afresh), so nothing for the trainer to reset
        return {"loaded": loaded, "seconds": time.perf_counter() - start, "vocab": self.vocab, "prefix_cache": False}

    async def fingerprint(self) -> dict:
        """The sha256 of every tensor the served model computes with (``weights.state_fingerprint``), between
        batches as a load is: ``{"tensors", "vocab", "seconds"}``."""
        if self.stopping or self._model_lock is None:
            raise RequestError(503, "the server is shutting down", "unavailable")
        async with self._model_lock:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._fingerprint)

    def _fingerprint(self) -> dict:
        start = time.perf_counter()
        tensors = state_fingerprint(self.model)
        return {"tensors": tensors, "vocab": self.vocab, "seconds": time.perf_counter() - start}

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._pending.wait()
            batch = []
            try:
                await self._gather()
                # in arrival order, within max_batch_size rows and max_batch_tokens; rows of clients gone dropped
                batch, dropped = self._pending.take(self._limits())
                self.stats.rows_dropped += dropped
                # requests arriving while these run wait in the queue and form the next batch
                scoring = [j for j in batch if isinstance(j, ScoreJob)]
                generating = [j for j in batch if not isinstance(j, ScoreJob)]
                if generating:  # the queue's estimate counts these rows as running from now
                    self.throughput.begin(len(generating), max(j.max_tokens for j in generating))
                stopped = self.stats.rows_stopped
                try:
                    async with self._model_lock:  # a weight load waits until the batch is done
                        if scoring:
                            await loop.run_in_executor(self._executor, self._score_batch, scoring)
                        if generating:
                            await loop.run_in_executor(self._executor, self._generate_batch, generating)
                finally:
                    # its steps are timed either way; one cut short by clients that left says nothing of how far
                    # batches run towards their longest max_tokens
                    self.throughput.end(complete=self.stats.rows_stopped == stopped and not self.stopping)
                    self.stats.step_fixed_s, self.stats.step_per_row_s = self.throughput.step_model() or (None, None)
            except asyncio.CancelledError:  # stopping: answer the rows taken from the queue but not finished
                for job in batch:
                    if not job.done:
                        job.fail(503, "the server is shutting down")
                raise

    async def _gather(self) -> None:
        """Give concurrent requests a moment to join the batch: ``max_wait_ms``, and again while more arrived
        during the last wait and the queue holds less than a batch (``GATHER_WAITS`` at most). A burst of
        requests takes tens of milliseconds to arrive; a batch started after its first few would leave the
        rest waiting a whole batch, or, under pushback, refused."""
        seen = 0
        for _ in range(GATHER_WAITS):
            if self.max_wait_s <= 0 or len(self._pending) == seen or len(plan(self._pending, self._limits())) > 1:
                return
            seen = len(self._pending)
            await asyncio.sleep(self.max_wait_s)
