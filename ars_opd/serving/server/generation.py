"""Generating from a token-id prompt on ``POST /v1/completions``: the rollout engine's request, in vLLM's shape.

A completions request *without* ``prompt_logprobs`` is a generation request (with it, a scoring request:
``ars_opd.serving.server.scoring``). It is what an OPD trainer that generates its student's rollouts on an
engine sends, one prompt per request, and the same body works against vLLM:

- ``prompt``: one list of token ids (one prompt per request; text and several prompts are refused);
- ``max_tokens`` >= 1, ``temperature`` >= 0 (0: greedy), ``top_p`` in (0, 1], ``top_k`` 0 or -1 (off),
  ``seed`` (any integer; absent: a random one);
- ``stop_token_ids``: ids that end the completion besides the model's own EOS ids (which always do);
- ``logprobs``: 0 returns, per sampled token, its log-probability under the RAW model distribution, the
  log-softmax of the logits at temperature 1 in fp32, before temperature and top-p (vLLM's
  ``--logprobs-mode raw_logprobs``); ``return_token_ids`` returns the sampled ids (``choices[0].token_ids``,
  including the EOS id a completion stopped on);
- ``skip_special_tokens`` only shapes ``text``.

Sampling is softmax(logits / T) restricted to the top-p nucleus, by the chat path's ``RowSampler``
(``ars_opd.serving.server.sampling``), over the tokenizer's vocabulary (embedding rows beyond it are padding
and are never sampled, as the trainer's head leaves them out). The checkpoint's generation_config does not
apply (the engine resets it). Fields this server does not implement are refused with 400 when set to anything
but their neutral value (``NEUTRAL``): a repetition penalty, ``min_p``, ``n`` > 1, stop strings, ... would
otherwise be silently ignored and the rollouts would come from another distribution than asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ars_opd.serving.server.validation import RequestError, check_model

# field -> the values that mean "off"; anything else is refused (see the module docstring)
NEUTRAL: dict[str, tuple] = {
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "n": (None, 1),
    "best_of": (None, 1),
    "stream": (None, False),
    "echo": (None, False),
    "suffix": (None, ""),
    "stop": (None, [], ""),
    "logit_bias": (None, {}),
    "ignore_eos": (None, False),
    "include_stop_str_in_output": (None, False),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "response_format": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "structured_outputs": (None,),
    "prompt_embeds": (None,),
}


@dataclass(frozen=True)
class GenerateRequest:
    """The validated fields of a generation (``/v1/completions`` without ``prompt_logprobs``) request."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop_ids: frozenset[int]
    """Ids that end the completion besides the model's EOS ids."""
    logprobs: bool
    """Return each sampled token's raw log-probability."""
    return_token_ids: bool
    skip_special_tokens: bool = True


def _prompt(body: dict, vocab: int) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # [[ids]]: one prompt, as a batch of one
    ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not ok:
        raise RequestError(
            400,
            "'prompt' must be one non-empty list of token ids: this server generates from token ids, one prompt "
            "per request (text prompts and several prompts per request are not supported)",
            "invalid_value",
            "prompt",
        )
    if not all(0 <= t < vocab for t in prompt):
        raise RequestError(400, f"'prompt' must hold token ids in [0, {vocab})", "invalid_value", "prompt")
    return prompt


def _number(body: dict, name: str, default: float, ok, expected: str) -> float:
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise RequestError(400, f"'{name}' must be {expected}, got {value!r}", "invalid_value", name)
    return float(value)


def _is_neutral(value, neutral: tuple) -> bool:
    """``value`` is one of ``neutral`` (a bool is never taken for 0 or 1)."""
    for v in neutral:
        if v is None or value is None:
            if v is value:
                return True
        elif isinstance(value, bool) == isinstance(v, bool) and type(value) in (int, float, str, list, dict, bool):
            if value == v:
                return True
    return False


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if not _is_neutral(value, neutral):
            allowed = " or ".join(repr(v) for v in neutral if v is not None)
            raise RequestError(
                400,
                f"'{name}' = {value!r} is not supported by this server's generation (allowed: absent"
                f"{' or ' + allowed if allowed else ''}): it would change the sampled distribution, so it is "
                "refused rather than ignored",
                "unsupported_parameter",
                name,
            )
    top_k = body.get("top_k")
    if top_k not in (None, 0, -1) or isinstance(top_k, bool):
        raise RequestError(
            400, f"'top_k' must be 0 or -1 (off) on this server, got {top_k!r}", "unsupported_parameter", "top_k"
        )
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise RequestError(
            400,
            f"'logprobs' must be 0 (the sampled tokens' own log-probabilities) or absent, got {logprobs!r}",
            "unsupported_parameter",
            "logprobs",
        )


def parse_generate_request(body, model_name: str, vocab: int, context_length: int | None) -> GenerateRequest:
    """Validate a decoded ``/v1/completions`` body without ``prompt_logprobs``; ``RequestError`` on a 4xx."""
    check_model(body, model_name)
    prompt = _prompt(body, vocab)
    _refuse_unsupported(body)
    max_tokens = body.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(
            400, f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", "invalid_value", "max_tokens"
        )
    if context_length is not None and len(prompt) + max_tokens > context_length:
        raise RequestError(
            400,
            f"this model's context is {context_length} tokens; the prompt has {len(prompt)} tokens plus "
            f"{max_tokens} completion tokens",
            "context_length_exceeded",
            "prompt",
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, f"'seed' must be an integer, got {seed!r}", "invalid_type", "seed")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError(400, "'stop_token_ids' must be a list of token ids", "invalid_value", "stop_token_ids")
    flags = {
        name: body.get(name, default) for name, default in (("return_token_ids", False), ("skip_special_tokens", True))
    }
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, f"'{name}' must be a boolean, got {value!r}", "invalid_type", name)
    return GenerateRequest(
        prompt_ids=prompt,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, lambda v: v >= 0, "a number >= 0"),
        top_p=_number(body, "top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        seed=seed,
        stop_ids=frozenset(stop_ids),
        logprobs=body.get("logprobs") == 0,
        return_token_ids=bool(flags["return_token_ids"]),
        skip_special_tokens=flags["skip_special_tokens"] is not False,
    )
