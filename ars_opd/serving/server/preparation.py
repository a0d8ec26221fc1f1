"""The bundled server's request side: raw request bodies to validated, tokenized rows, off the event loop.

Preparing a request (JSON decoding, validation, chat template, tokenization) is CPU work proportional
to its size, so ``RequestPreparer`` runs it in a small pool of threads, never on the event loop: one huge
prompt must not stall every other client. Before tokenizing it refuses a prompt longer than
``max_prompt_chars`` = context length × the longest token in characters × 2: every token covers at most
that many characters of the text, so a longer prompt cannot fit (the factor 2 leaves room for
normalizers that merge characters; a tokenizer that deletes most of its input, or whose unknown token
covers whole words, could still be refused wrongly, with a message naming the bound). The application
also derives its body-size limit from that bound (``ars_opd.serving.server.app.body_limit``).

The engine (``ars_opd.serving.server.engine``) owns one preparer and starts and stops its threads; the
handlers hand it each body and submit what it returns to the engine's queue.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from jinja2 import TemplateError

from ars_opd.data.prompts import encode_prompt
from ars_opd.serving.server.generation import GenerateRequest, parse_generate_request
from ars_opd.serving.server.scoring import ScoreRequest, parse_score_request
from ars_opd.serving.server.validation import ChatRequest, RequestError, parse_chat_request

CHARS_MARGIN = 2  # see the module docstring: max_prompt_chars
PREPARE_THREADS = 4  # requests prepared at once: a few huge ones cannot hold up the small ones behind them


class RequestPreparer:
    """Chat and scoring request bodies to validated requests (and a chat's prompt token ids), in threads."""

    def __init__(self, tokenizer, model_name: str, context_length: int | None, vocab: int, max_logprobs: int):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.context_length, self.vocab, self.max_logprobs = context_length, vocab, max_logprobs
        longest_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = (
            self.context_length * longest_token * CHARS_MARGIN if self.context_length is not None else None
        )
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="prepare")

    async def stop(self) -> None:
        """Join the preparation threads (requests being prepared finish first)."""
        if self._pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown)

    async def prepare_async(self, body: bytes) -> tuple[ChatRequest, list[int], int]:
        """``prepare`` in the preparation threads (the event loop stays free)."""
        if self._pool is None:
            raise RequestError(503, "the server is not serving", "unavailable")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare, body)

    def prepare(self, body: bytes) -> tuple[ChatRequest, list[int], int]:
        """Raw request body -> (validated request, prompt token ids, max_tokens); ``RequestError`` on a 4xx."""
        try:
            decoded = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:  # bad JSON or bad UTF-8
            raise RequestError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
        chat = parse_chat_request(decoded, self.model_name)
        chars = sum(len(m["content"]) for m in chat.messages)
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestError(
                400,
                f"this model's context is {self.context_length} tokens; the request's messages "
                f"have {chars} characters, more than the {self.max_prompt_chars} that many "
                "tokens can hold with this tokenizer",
                "context_length_exceeded",
                "messages",
            )
        prompt_ids = self.encode(chat.messages)
        return chat, prompt_ids, self.resolve_max_tokens(chat.max_tokens, len(prompt_ids))

    def encode(self, messages: list[dict]) -> list[int]:
        try:
            return encode_prompt(self.tokenizer, messages)
        except (TemplateError, ValueError, TypeError) as e:  # e.g. a template that requires alternating roles
            raise RequestError(
                400, f"the chat template rejected the messages: {e}", "invalid_value", "messages"
            ) from None

    def resolve_max_tokens(self, max_tokens: int | None, prompt_tokens: int) -> int:
        """The request's max_tokens, or the rest of the context; 400 when prompt and completion do not fit."""
        if self.context_length is None:
            return max_tokens if max_tokens is not None else 2048
        room = self.context_length - prompt_tokens
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" plus {max_tokens} completion tokens" if max_tokens is not None else ""
            raise RequestError(
                400,
                f"this model's context is {self.context_length} tokens; the request has "
                f"{prompt_tokens} prompt tokens{asked}",
                "context_length_exceeded",
                "messages",
            )
        return max_tokens if max_tokens is not None else room

    def prepare_score(self, body: bytes) -> ScoreRequest:
        """Raw ``/v1/completions`` body -> validated scoring request; ``RequestError`` on a 4xx."""
        try:
            decoded = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
        return parse_score_request(decoded, self.model_name, self.vocab, self.context_length, self.max_logprobs)

    async def prepare_score_async(self, body: bytes) -> ScoreRequest:
        if self._pool is None:
            raise RequestError(503, "the server is not serving", "unavailable")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare_score, body)

    def prepare_completion(self, body: bytes) -> ScoreRequest | GenerateRequest:
        """Raw ``/v1/completions`` body -> a scoring request when it has ``prompt_logprobs``, else a
        generation request (``ars_opd.serving.server.generation``); ``RequestError`` on a 4xx."""
        try:
            decoded = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {e}", "invalid_json") from None
        if isinstance(decoded, dict) and decoded.get("prompt_logprobs") is not None:
            return parse_score_request(decoded, self.model_name, self.vocab, self.context_length, self.max_logprobs)
        return parse_generate_request(decoded, self.model_name, self.vocab, self.context_length)

    async def prepare_completion_async(self, body: bytes) -> ScoreRequest | GenerateRequest:
        if self._pool is None:
            raise RequestError(503, "the server is not serving", "unavailable")
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prepare_completion, body)
