"""Scoring token-id prompts for the bundled server: vLLM's ``prompt_logprobs`` on ``POST /v1/completions``.

An OPD trainer that does not hold the teacher sends each rollout (prompt + completion token ids) as a
completions request with ``prompt_logprobs: k`` and reads back, for every position after the first, the
teacher's log-probability of the actual token and the k most likely tokens. This module is the server's
side of that contract, in exactly vLLM's shape so that the same client works against ``vllm serve``:

- ``parse_score_request`` validates a decoded body: ``model``; ``prompt`` a list of token ids or a list of
  such lists (one choice each, in order); ``max_tokens`` 0 or 1 (this server scores, it does not write);
  ``echo``; ``prompt_logprobs`` k >= 0 (at most the server's ``max_logprobs``, as vLLM's
  ``--max-logprobs``); ``temperature`` absent, 0 or 1, since prompt log-probabilities are the model's
  log-softmax at temperature 1 whatever the sampling temperature (vLLM's raw log-probabilities).
- ``score_rows`` runs the model on a right-padded batch and returns, per row and position i >= 1,
  log p(x_i | x_<i), its rank (1 + the number of tokens strictly more likely, vLLM's definition) and the
  top-k (ids, log-probs), from the last hidden states through the output head in chunks of positions (the
  same arithmetic as the trainer's local teacher, ``ars_opd.lm.head``), in fp32.
- ``vllm_prompt_logprobs`` formats one row: a list whose first item is None, then per position a dict
  ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the top-k and always the actual token
  (k + 1 entries when the actual token is outside the top-k). JSON turns the int keys into strings.

The vocabulary is the tokenizer's ids 0..len(tokenizer)-1 (embedding rows beyond it are padding and are
left out, as in training), so the endpoint's numbers equal the local teacher's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ars_opd.lm.head import OutputHead, last_hidden_states
from ars_opd.serving.server.options import DEFAULT_MAX_LOGPROBS
from ars_opd.serving.server.validation import UNSUPPORTED_FIELDS, RequestError, check_model


@dataclass(frozen=True)
class ScoreRequest:
    """The validated fields of a scoring (``/v1/completions``) request."""

    prompts: list[list[int]]
    """Token-id prompts, one choice each."""
    max_tokens: int
    """0 (score only) or 1 (also the greedy next token)."""
    echo: bool
    top_k: int | None
    """``prompt_logprobs``: how many most likely tokens per position (None: no prompt log-probabilities)."""


def _token_lists(prompt, vocab: int) -> list[list[int]]:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        lists = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        lists = prompt
    else:
        raise RequestError(
            400,
            "'prompt' must be a non-empty list of token ids or a list of such lists (this "
            "server scores token ids; text prompts are not supported)",
            "invalid_value",
            "prompt",
        )
    for i, ids in enumerate(lists):
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise RequestError(
                400, f"prompt[{i}] must be a non-empty list of token ids in [0, {vocab})", "invalid_value", "prompt"
            )
    return lists


def parse_score_request(
    body, model_name: str, vocab: int, context_length: int | None, max_logprobs: int = DEFAULT_MAX_LOGPROBS
) -> ScoreRequest:
    """Validate a decoded ``/v1/completions`` body; raises ``RequestError`` (400, or 404 for the model)."""
    check_model(body, model_name)
    prompts = _token_lists(body.get("prompt"), vocab)
    max_tokens = body.get("max_tokens", 16)
    if max_tokens not in (0, 1) or isinstance(max_tokens, bool):
        raise RequestError(
            400,
            f"this server's /v1/completions only scores prompts: 'max_tokens' must be 0 or 1, "
            f"got {max_tokens!r} (use /v1/chat/completions to generate)",
            "invalid_value",
            "max_tokens",
        )
    k = body.get("prompt_logprobs")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max_logprobs):
        raise RequestError(
            400,
            f"'prompt_logprobs' must be an integer in [0, {max_logprobs}] (the server's --max-logprobs), got {k!r}",
            "invalid_value",
            "prompt_logprobs",
        )
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise RequestError(400, f"'echo' must be a boolean, got {echo!r}", "invalid_type", "echo")
    temperature = body.get("temperature")
    if temperature not in (None, 0, 1) or isinstance(temperature, bool):
        raise RequestError(
            400,
            f"prompt log-probabilities are the model's log-softmax at temperature 1; "
            f"'temperature' must be absent, 0 or 1, got {temperature!r}",
            "invalid_value",
            "temperature",
        )
    for name in (*UNSUPPORTED_FIELDS, "stream", "suffix", "best_of"):
        if body.get(name):
            raise RequestError(
                400, f"'{name}' is not supported by this server's scoring endpoint", "unsupported_parameter", name
            )
    if body.get("n") not in (None, 1):
        raise RequestError(400, f"only n=1 is supported, got n={body['n']!r}", "unsupported_parameter", "n")
    if context_length is not None:
        for i, ids in enumerate(prompts):
            if len(ids) + max_tokens > context_length:
                raise RequestError(
                    400,
                    f"this model's context is {context_length} tokens; prompt[{i}] has "
                    f"{len(ids)} tokens plus {max_tokens} completion tokens",
                    "context_length_exceeded",
                    "prompt",
                )
    return ScoreRequest(prompts, max_tokens, echo, k)


@dataclass
class RowScores:
    """One scored row of L tokens: for positions 1..L-1 (the first token has no context)."""

    logprobs: torch.Tensor  # (L-1,) fp32: log p(x_i | x_<i)
    ranks: torch.Tensor  # (L-1,) int64: 1 + #tokens strictly more likely than x_i
    top_ids: torch.Tensor  # (L-1, k) int64, most likely first
    top_logprobs: torch.Tensor  # (L-1, k) fp32
    next_token: int  # argmax after the last position (the greedy completion token)


SCORE_CHUNK = 256  # positions per chunk of the head's log-softmax: bounds its (chunk x vocabulary) memory


@torch.no_grad()
def score_rows(model: torch.nn.Module, rows: list[list[int]], k: int, vocab: int, pad_id: int) -> list[RowScores]:
    """Prompt log-probabilities of each row (right-padded into one batch on the model's device; padding is never
    attended), ``SCORE_CHUNK`` positions of the head at a time."""
    device, chunk_size = next(model.parameters()).device, SCORE_CHUNK
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    hidden = last_hidden_states(model, ids.to(device), mask.to(device))  # (B, T, H)
    head = OutputHead.of(model, vocab)
    out = []
    for i, r in enumerate(rows):
        L = len(r)
        h = hidden[i, :L]  # (L, H): position t predicts x_{t+1}; the last one the next token
        targets = torch.tensor(r[1:], device=device)  # (L-1,)
        lp, rank, tid, tlp = [], [], [], []
        next_token = 0
        for start in range(0, L, chunk_size):
            end = min(L, start + chunk_size)
            z = torch.log_softmax(head.logits(h[start:end]), -1)  # (c, V) fp32
            if end == L:
                next_token = int(z[-1].argmax())
                z = z[:-1]
            if z.shape[0] == 0:
                continue
            y = targets[start : start + z.shape[0], None]  # (c, 1)
            ly = z.gather(-1, y)  # (c, 1)
            lp.append(ly.squeeze(-1))
            rank.append((z > ly).sum(-1) + 1)
            top = z.topk(k, dim=-1) if k > 0 else None
            tid.append(
                top.indices if top is not None else torch.zeros((z.shape[0], 0), dtype=torch.long, device=device)
            )
            tlp.append(top.values if top is not None else torch.zeros((z.shape[0], 0), device=device))
        cat = lambda xs, shape: torch.cat(xs).cpu() if xs else torch.zeros(shape)  # noqa: E731
        out.append(
            RowScores(cat(lp, (0,)), cat(rank, (0,)).long(), cat(tid, (0, k)).long(), cat(tlp, (0, k)), next_token)
        )
    return out


def vllm_prompt_logprobs(row: list[int], scores: RowScores, decode: Callable[[int], str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` for one row: [None, {id: {logprob, rank, decoded_token}}, ...]."""
    out: list[dict | None] = [None]
    lp, ranks = scores.logprobs.tolist(), scores.ranks.tolist()
    top_ids, top_lp = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    for i in range(len(row) - 1):
        entry = {
            t: {"logprob": v, "rank": j + 1, "decoded_token": decode(t)}
            for j, (t, v) in enumerate(zip(top_ids[i], top_lp[i]))
        }
        actual = row[i + 1]
        # the actual token is always there, with its own log-prob and vocabulary rank (vLLM adds it first)
        entry = {
            actual: {"logprob": lp[i], "rank": ranks[i], "decoded_token": decode(actual)},
            **{t: v for t, v in entry.items() if t != actual},
        }
        out.append(entry)
    return out
