"""Scoring token sequences on a served teacher through vLLM's ``prompt_logprobs`` (OpenAI completions API).

``score_sequences`` sends each sequence (prompt + completion token ids) as one ``POST /v1/completions``
request ``{"model", "prompt": [ids], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": k}``, at most
``concurrency`` in flight (a fixed pool of workers pulling from one iterator), and reads each choice's
``prompt_logprobs``: a list whose first item is null, then per position a dict keyed by token id (a string
in JSON) of ``{"logprob", "rank", "decoded_token"}`` holding the top-k and always the actual token. Every
request goes through the teacher client's one retry loop (``ars_opd.teacher.client.endpoint.with_retries``:
timeouts, dropped connections, 429 and 5xx with backoff and retry-after). A response that is not exactly
that shape (wrong length, a position without its actual token, a value that is not a finite number) is
retried as malformed. All or nothing: if any sequence still fails, ``ScoringError`` names the endpoint and
the reasons, and no partial result is returned, so a training step never trains on a partial score.

Every position's values must be log-probabilities (``check_logprobs``): each <= 0, and their log-sum-exp
<= 0 up to ``logsumexp_tolerance``. A vLLM server started with ``--logprobs-mode raw_logits`` answers
``prompt_logprobs`` with logits (since vLLM PR #47680 prompt log-probs follow that flag); negative logits
pass a check of the sign alone, but the top-k of a distribution cannot hold more than probability 1. Such
an answer is not retried (the server would give the same again): ``NotLogprobsError`` names the flag and
nothing is trained on it, whether it comes from the probe before step 0 (``check_scores``) or from any
step's response.

``check_tokenizer`` compares the endpoint's tokenization of a probe text with the local tokenizer's before
any training: through vLLM's ``POST /tokenize`` where it is served, else by echoing the probe text with
``prompt_logprobs: 0``, whose per-position dicts then hold only the actual tokens; then it scores the probe
once (``check_scores``). vLLM serves ``/tokenize`` at the server root and the completions API under ``/v1``:
the endpoint URL may be either the root or the root + ``/v1`` (``_root``).

``max_tokens`` is 1 and ``temperature`` 1 because some servers refuse ``max_tokens: 0`` and older vLLM
versions computed prompt log-probabilities after temperature scaling: at temperature 1 both readings give
the model's log-softmax. The one sampled completion token is ignored.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ars_opd.teacher.client.endpoint import (
    ClientSettings,
    EndpointError,
    FinalError,
    RetryableError,
    post_json,
    with_retries,
)

if TYPE_CHECKING:  # annotations only (see endpoint.py)
    import openai

PROBE_TEXT = "Reverse the word 'distillation', then add 12 + 30 = 42.\nDone? Yes: <ok> {x} [1, 2]"


class ScoringError(EndpointError):
    """Scoring failed for a sequence after every retry, or the endpoint's tokenizer is not the student's."""


class NotLogprobsError(ScoringError):
    """The endpoint's ``prompt_logprobs`` are not log-probabilities (e.g. vLLM's ``--logprobs-mode raw_logits``)."""


# bf16's machine epsilon: the coarsest float a server computes or keeps log-probabilities in
LOGPROB_EPS = 2.0**-7
# a log-prob a hair above 0 is fp32 rounding of a probability-1 token (z_max - logsumexp(z) for logits z)
ABOVE_ZERO = 1e-4
SERVER_FLAGS = (
    "start vLLM with `--logprobs-mode raw_logprobs` (with raw_logits or processed_logits it "
    "returns logits there) and `--no-enable-prefix-caching` (with prefix caching, its default, "
    "prompt log-probs of cached positions can be stale, vLLM issue #42019)"
)


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


def logsumexp_tolerance(n: int) -> float:
    """How far above 0 the log-sum-exp of ``n`` returned log-probabilities of one position may be: n * eps.

    The n entries are log-probabilities of n distinct tokens of one distribution, so their probabilities
    sum to at most 1 and their log-sum-exp is at most 0, exactly. What arrives is each value after the
    server's float arithmetic and serialisation. Rounding a log-prob l to bf16 (eps = 2^-7, the coarsest
    float in use) changes it by at most |l| eps / 2, so its probability p = e^l by at most
    p |ln p| eps / 2 <= eps / (2e); the n probabilities then sum to at most 1 + n eps / (2e), a log-sum-exp
    of at most n eps / (2e). The allowance n eps is 2e times that, leaving room for the log-softmax's own
    arithmetic (vLLM's is fp32, 2^16 times finer than bf16). For k = 20 (21 entries with the actual token)
    it is 0.164, probabilities summing to at most 1.18.
    """
    return n * LOGPROB_EPS


def _logsumexp(values: list[float]) -> float:
    m = max(values)
    return m + math.log(sum(math.exp(v - m) for v in values))


def check_logprobs(values: list[float], where: str) -> None:
    """``NotLogprobsError`` unless ``values`` (one position's returned entries) can be log-probabilities:
    each <= 0 (up to ``ABOVE_ZERO``) and their log-sum-exp <= ``logsumexp_tolerance(len(values))``.

    Logits whose top-k has a log-sum-exp within the allowance (all far below 0) cannot be told from
    log-probabilities by any check of k values; a language model's largest logits rarely are.
    """
    top = max(values)
    if top > ABOVE_ZERO:
        raise NotLogprobsError(f"{where} has the value {top!r} > 0, which no log-probability has")
    lse, tol = _logsumexp(values), logsumexp_tolerance(len(values))
    if lse > tol:
        raise NotLogprobsError(
            f"{where}: the {len(values)} returned values have log-sum-exp {lse:.4g} > {tol:.4g} "
            f"(their probabilities sum to {math.exp(lse):.4g}; those of any k tokens of one "
            f"distribution sum to at most 1, and {tol:.4g} is the allowance for rounding)"
        )


def _entry_logprob(value, where: str) -> float:
    lp = value.get("logprob") if isinstance(value, dict) else None
    # vLLM writes -inf as -9999.0; the sign and the sum are checked per position (check_logprobs)
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
        raise RetryableError(f"malformed_response: {where} has logprob {lp!r}, not a finite number")
    return float(lp)


def parse_prompt_logprobs(prompt_logprobs, ids: list[int]) -> SequenceScores:
    """Read one choice's vLLM ``prompt_logprobs`` for the sequence ``ids``; ``RetryableError`` if malformed,
    ``NotLogprobsError`` if a position's values are not log-probabilities (``check_logprobs``)."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) != len(ids):
        n = len(prompt_logprobs) if isinstance(prompt_logprobs, list) else None
        raise RetryableError(
            f"malformed_response: prompt_logprobs has {n} positions for a {len(ids)}-token prompt "
            "(is prompt_logprobs supported by this server?)"
        )
    if prompt_logprobs[0] is not None:
        raise RetryableError("malformed_response: prompt_logprobs[0] is not null")
    out = SequenceScores([], [], [])
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        if not isinstance(entry, dict):
            raise RetryableError(f"malformed_response: prompt_logprobs[{i}] is {type(entry).__name__}, not an object")
        try:
            parsed = {int(t): _entry_logprob(v, f"prompt_logprobs[{i}][{t}]") for t, v in entry.items()}
        except ValueError:
            raise RetryableError(f"malformed_response: prompt_logprobs[{i}] has a key that is not a token id") from None
        if ids[i] not in parsed:
            raise RetryableError(f"malformed_response: prompt_logprobs[{i}] lacks the actual token {ids[i]}")
        check_logprobs(list(parsed.values()), f"prompt_logprobs[{i}]")
        parsed = {t: min(v, 0.0) for t, v in parsed.items()}
        out.logprobs.append(parsed[ids[i]])
        out.support_ids.append(list(parsed))
        out.support_logprobs.append(list(parsed.values()))
    return out


def _root(client: openai.AsyncOpenAI) -> str:
    """The server root: the endpoint URL without a trailing ``/v1`` (vLLM serves /tokenize beside /v1)."""
    base = str(client.base_url).rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def _completions_url(client: openai.AsyncOpenAI) -> str:
    """``/v1/completions`` under the server root, whether the endpoint URL ends with ``/v1`` or not."""
    return f"{_root(client)}/v1/completions"


def _refusal(client: openai.AsyncOpenAI, model: str, e: NotLogprobsError, outcome: str) -> NotLogprobsError:
    return NotLogprobsError(
        f"the teacher endpoint {client.base_url} (model {model!r}) returns prompt_logprobs that "
        f"are not log-probabilities: {e}. {outcome}. To score on it, {SERVER_FLAGS}."
    )


async def _score_one(client: openai.AsyncOpenAI, model: str, ids: list[int], k: int) -> SequenceScores:
    resp = await post_json(client, _completions_url(client), score_body(model, ids, k))
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise RetryableError("malformed_response: expected exactly one choice")
    return parse_prompt_logprobs(choices[0].get("prompt_logprobs"), ids)


async def score_sequences(
    client: openai.AsyncOpenAI,
    model: str,
    sequences: list[list[int]],
    k: int,
    settings: ClientSettings,
    section: str = "opd.teacher_endpoint",
) -> list[SequenceScores]:
    """The teacher's scores of every sequence, in order, or ``ScoringError`` (nothing partial):
    ``NotLogprobsError`` at the first response whose values are not log-probabilities (not retried)."""
    results: list[SequenceScores | None] = [None] * len(sequences)
    failures: list[str] = []
    refused: list[NotLogprobsError] = []
    queue = iter(range(len(sequences)))

    async def worker() -> None:
        for i in queue:
            if failures:  # one sequence failed for good: the step is lost anyway, stop sending
                return
            try:
                results[i], _ = await with_retries(lambda: _score_one(client, model, sequences[i], k), settings)
            except (FinalError, RetryableError) as e:
                failures.append(f"sequence {i}: {e.reason} after {e.attempts} attempt(s)")
            except NotLogprobsError as e:
                failures.append(f"sequence {i}: not log-probabilities")
                refused.append(NotLogprobsError(f"sequence {i}: {e}"))

    await asyncio.gather(*(worker() for _ in range(min(settings.limits.concurrency, len(sequences)))))
    if refused:
        raise _refusal(client, model, refused[0], "The step was not trained")
    if failures:
        raise ScoringError(
            f"scoring on the teacher endpoint {client.base_url} (model {model!r}) failed: "
            f"{failures[0]}{f' (and {len(failures) - 1} more)' if len(failures) > 1 else ''}; "
            f"the step was not trained. Check the server, or raise {section}.max_attempts / "
            f"request_timeout_s."
        )
    return results  # type: ignore[return-value]


async def endpoint_tokens(client: openai.AsyncOpenAI, model: str, text: str, settings: ClientSettings) -> list[int]:
    """The endpoint's token ids for ``text`` (no special tokens added): /tokenize, else echo + prompt_logprobs."""
    try:
        resp, _ = await with_retries(
            lambda: post_json(
                client, f"{_root(client)}/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}
            ),
            settings,
        )
        tokens = resp.get("tokens")
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
    except FinalError as e:
        if e.status != 404:
            raise
    # no /tokenize: the first token of an echoed text prompt is not returned, so the probe starts with a space
    # that every tokenizer ends up putting in its own first token, and the rest is compared
    resp, _ = await with_retries(
        lambda: post_json(
            client,
            _completions_url(client),
            {
                "model": model,
                "prompt": text,
                "max_tokens": 1,
                "echo": True,
                "prompt_logprobs": 0,
                "add_special_tokens": False,
            },
        ),
        settings,
    )
    entries = (resp.get("choices") or [{}])[0].get("prompt_logprobs")
    if not isinstance(entries, list) or any(not isinstance(e, dict) or len(e) != 1 for e in entries[1:]):
        raise ScoringError(
            f"the teacher endpoint {client.base_url} serves neither /tokenize nor prompt_logprobs "
            "with one entry per position; it cannot score OPD rollouts"
        )
    return [None] + [int(next(iter(e))) for e in entries[1:]]  # type: ignore[list-item]


async def check_scores(
    client: openai.AsyncOpenAI, model: str, ids: list[int], settings: ClientSettings, k: int = 1
) -> None:
    """Score ``ids`` once with ``prompt_logprobs: k`` before any training: ``NotLogprobsError`` naming the
    server flags if the values are not log-probabilities, ``ScoringError`` if the probe cannot be scored."""
    try:
        await with_retries(lambda: _score_one(client, model, ids, k), settings)
    except NotLogprobsError as e:
        raise _refusal(client, model, e, "Refused before training") from None
    except (FinalError, RetryableError) as e:
        raise ScoringError(
            f"the teacher endpoint {client.base_url} (model {model!r}) could not score a probe "
            f"sequence with prompt_logprobs: {e.reason} after {e.attempts} attempt(s)"
        ) from None


async def check_tokenizer(
    client: openai.AsyncOpenAI,
    model: str,
    tokenizer,
    settings: ClientSettings,
    section: str = "opd.teacher_endpoint",
    k: int = 1,
) -> None:
    """Refuse (``ScoringError``) an endpoint whose tokenizer gives other ids than ``tokenizer`` for a probe,
    then score the probe with ``prompt_logprobs: k`` (``check_scores``, ``NotLogprobsError``)."""
    probe = PROBE_TEXT + (tokenizer.eos_token or "")
    local = tokenizer(probe, add_special_tokens=False)["input_ids"]
    try:
        remote = await endpoint_tokens(client, model, probe, settings)
    except (FinalError, RetryableError) as e:
        raise ScoringError(
            f"could not check the tokenizer of the teacher endpoint {client.base_url}: {e.reason}"
        ) from None
    compared = local if remote[:1] != [None] else [None] + local[1:]
    if remote != compared:
        first = next((i for i, (a, b) in enumerate(zip(remote, compared)) if a != b), min(len(remote), len(compared)))
        raise ScoringError(
            f"the teacher endpoint {client.base_url} (model {model!r}) tokenizes differently from the student's "
            f"tokenizer: the probe text {probe!r} gives {len(remote)} ids there and {len(local)} here, first "
            f"differing at position {first} ({remote[first : first + 5]} vs {compared[first : first + 5]}). OPD "
            f"compares log-probabilities token by token, so teacher and student must share the tokenizer: serve a "
            f"teacher with the student's tokenizer, or fix {section}.endpoint / model."
        )
    await check_scores(client, model, local, settings, k)
