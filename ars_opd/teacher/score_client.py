"""Scoring token sequences on a served teacher through vLLM's ``prompt_logprobs`` (OpenAI completions API).

``score_sequences`` sends each sequence (prompt + completion token ids) as one ``POST /v1/completions``
request ``{"model", "prompt": [ids], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}``, at most
``concurrency`` in flight (a fixed pool of workers pulling from one iterator), and reads each choice's
``prompt_logprobs``: a list whose first item is null, then per position a dict keyed by token id (a string
in JSON) of ``{"logprob", "rank", "decoded_token"}`` holding the top-k and always the actual token. Every
request goes through the teacher client's one retry loop (``ars_opd.teacher.client.with_retries``:
timeouts, dropped connections, 429 and 5xx with backoff and retry-after). A response that is not exactly
that shape (wrong length, a position without its actual token, a non-finite or positive log-prob) is
retried as malformed. All or nothing: if any sequence still fails, ``ScoringError`` names the endpoint and
the reasons, and no partial result is returned, so a training step never trains on a partial score.

``check_tokenizer`` compares the endpoint's tokenization of a probe text with the local tokenizer's before
any training: through vLLM's ``POST /tokenize`` where it is served, else by echoing the probe text with
``prompt_logprobs: 0``, whose per-position dicts then hold only the actual tokens.

``max_tokens`` is 1 and ``temperature`` 1 because some servers refuse ``max_tokens: 0`` and older vLLM
versions computed prompt log-probabilities after temperature scaling: at temperature 1 both readings give
the model's log-softmax. The one sampled completion token is ignored.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import openai

from ars_opd.teacher.client import ClientSettings, EndpointError, _Final, _Retryable, post_json, with_retries

PROBE_TEXT = "Reverse the word 'distillation', then add 12 + 30 = 42.\nDone? Yes: <ok> {x} [1, 2]"


class ScoringError(EndpointError):
    """Scoring failed for a sequence after every retry, or the endpoint's tokenizer is not the student's."""


@dataclass
class SequenceScores:
    """The teacher's prompt log-probabilities of one sequence of L tokens, positions 1..L-1."""

    logprobs: list[float]
    """(L-1) log p_T(x_i | x_<i) of the actual tokens, at temperature 1."""
    support_ids: list[list[int]]
    """Per position the ids the endpoint returned: its top-k and the actual token (k or k + 1 ids)."""
    support_logprobs: list[list[float]]
    """Their log-probabilities, aligned with ``support_ids``."""


def score_body(model: str, ids: list[int], k: int) -> dict:
    """The completions request that scores ``ids`` (see the module docstring)."""
    return {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}


def _entry_logprob(value, where: str) -> float:
    lp = value.get("logprob") if isinstance(value, dict) else None
    # a log-prob a hair above 0 is rounding of a probability-1 token; vLLM writes -inf as -9999.0
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-4:
        raise _Retryable(f"malformed_response: {where} has logprob {lp!r}, not a finite number <= 0")
    return min(float(lp), 0.0)


def parse_prompt_logprobs(prompt_logprobs, ids: list[int]) -> SequenceScores:
    """Read one choice's vLLM ``prompt_logprobs`` for the sequence ``ids``; ``_Retryable`` if malformed."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != len(ids):
        n = len(prompt_logprobs) if isinstance(prompt_logprobs, list) else None
        raise _Retryable(f"malformed_response: prompt_logprobs has {n} positions for a {len(ids)}-token prompt "
                         "(is prompt_logprobs supported by this server?)")
    if prompt_logprobs[0] is not None:
        raise _Retryable("malformed_response: prompt_logprobs[0] is not null")
    out = SequenceScores([], [], [])
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        if not isinstance(entry, dict):
            raise _Retryable(f"malformed_response: prompt_logprobs[{i}] is {type(entry).__name__}, not an object")
        try:
            parsed = {int(t): _entry_logprob(v, f"prompt_logprobs[{i}][{t}]") for t, v in entry.items()}
        except ValueError:
            raise _Retryable(f"malformed_response: prompt_logprobs[{i}] has a key that is not a token id") from None
        if ids[i] not in parsed:
            raise _Retryable(f"malformed_response: prompt_logprobs[{i}] lacks the actual token {ids[i]}")
        out.logprobs.append(parsed[ids[i]])
        out.support_ids.append(list(parsed))
        out.support_logprobs.append(list(parsed.values()))
    return out


async def _score_one(client: openai.AsyncOpenAI, model: str, ids: list[int], k: int) -> SequenceScores:
    resp = await post_json(client, "/completions", score_body(model, ids, k))
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise _Retryable("malformed_response: expected exactly one choice")
    return parse_prompt_logprobs(choices[0].get("prompt_logprobs"), ids)


async def score_sequences(client: openai.AsyncOpenAI, model: str, sequences: list[list[int]], k: int,
                          settings: ClientSettings, section: str = "opd.teacher_endpoint") -> list[SequenceScores]:
    """The teacher's scores of every sequence, in order, or ``ScoringError`` (nothing partial)."""
    results: list[SequenceScores | None] = [None] * len(sequences)
    failures: list[str] = []
    queue = iter(range(len(sequences)))

    async def worker() -> None:
        for i in queue:
            if failures:  # one sequence failed for good: the step is lost anyway, stop sending
                return
            try:
                results[i], _ = await with_retries(lambda: _score_one(client, model, sequences[i], k), settings)
            except (_Final, _Retryable) as e:
                failures.append(f"sequence {i}: {e.reason} after {e.attempts} attempt(s)")

    await asyncio.gather(*(worker() for _ in range(min(settings.limits.concurrency, len(sequences)))))
    if failures:
        raise ScoringError(f"scoring on the teacher endpoint {client.base_url} (model {model!r}) failed: "
                           f"{failures[0]}{f' (and {len(failures) - 1} more)' if len(failures) > 1 else ''}; "
                           f"the step was not trained. Check the server, or raise {section}.max_attempts / "
                           f"request_timeout_s.")
    return results  # type: ignore[return-value]


def _root(client: openai.AsyncOpenAI) -> str:
    """The server root: vLLM serves /tokenize beside /v1, not under it."""
    base = str(client.base_url).rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


async def endpoint_tokens(client: openai.AsyncOpenAI, model: str, text: str, settings: ClientSettings) -> list[int]:
    """The endpoint's token ids for ``text`` (no special tokens added): /tokenize, else echo + prompt_logprobs."""
    try:
        resp, _ = await with_retries(lambda: post_json(client, f"{_root(client)}/tokenize", {
            "model": model, "prompt": text, "add_special_tokens": False}), settings)
        tokens = resp.get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
    except _Final as e:
        if e.status != 404:
            raise
    # no /tokenize: the first token of an echoed text prompt is not returned, so the probe starts with a space
    # that every tokenizer ends up putting in its own first token, and the rest is compared
    resp, _ = await with_retries(lambda: post_json(client, "/completions", {
        "model": model, "prompt": text, "max_tokens": 1, "echo": True, "prompt_logprobs": 0,
        "add_special_tokens": False}), settings)
    entries = (resp.get("choices") or [{}])[0].get("prompt_logprobs")
    if not isinstance(entries, list) or any(not isinstance(e, dict) or len(e) != 1 for e in entries[1:]):
        raise ScoringError(f"the teacher endpoint {client.base_url} serves neither /tokenize nor prompt_logprobs "
                           "with one entry per position; it cannot score OPD rollouts")
    return [None] + [int(next(iter(e))) for e in entries[1:]]  # type: ignore[list-item]


async def check_tokenizer(client: openai.AsyncOpenAI, model: str, tokenizer, settings: ClientSettings,
                          section: str = "opd.teacher_endpoint") -> None:
    """Refuse (``ScoringError``) an endpoint whose tokenizer gives other ids than ``tokenizer`` for a probe."""
    probe = PROBE_TEXT + (tokenizer.eos_token or "")
    local = tokenizer(probe, add_special_tokens=False)["input_ids"]
    try:
        remote = await endpoint_tokens(client, model, probe, settings)
    except (_Final, _Retryable) as e:
        raise ScoringError(f"could not check the tokenizer of the teacher endpoint {client.base_url}: "
                           f"{e.reason}") from None
    compared = local if remote[:1] != [None] else [None] + local[1:]
    if remote != compared:
        first = next((i for i, (a, b) in enumerate(zip(remote, compared)) if a != b), min(len(remote), len(compared)))
        raise ScoringError(
            f"the teacher endpoint {client.base_url} (model {model!r}) tokenizes differently from the student's "
            f"tokenizer: the probe text {probe!r} gives {len(remote)} ids there and {len(local)} here, first "
            f"differing at position {first} ({remote[first:first + 5]} vs {compared[first:first + 5]}). OPD "
            f"compares log-probabilities token by token, so teacher and student must share the tokenizer: serve a "
            f"teacher with the student's tokenizer, or fix {section}.endpoint / model.")
