"""Validating OpenAI-style chat requests for the bundled server.

``parse_chat_request`` turns a decoded ``/v1/chat/completions`` body into a ``ChatRequest`` or raises
``RequestError`` with an OpenAI-style error body: 400 for client mistakes, 404 for an unknown model.
Fields the server does not implement are refused rather than silently ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aiohttp import web

ROLES = ("system", "user", "assistant")
# Fields this server does not implement: a request that sets one (to anything truthy) gets a 400, because
# ignoring e.g. logprobs or a penalty would silently return something other than what was asked for.
UNSUPPORTED_FIELDS = (
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
)


class RequestError(Exception):
    """A client mistake, answered with an OpenAI-style error body and a 4xx status (or 503 when stopping)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self) -> web.Response:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status, headers=self.headers)


@dataclass(frozen=True)
class ChatRequest:
    """The validated fields of a chat completion request."""

    messages: list[dict]
    """Messages with string content (text parts already joined)."""
    temperature: float
    top_p: float
    max_tokens: int | None
    """None: up to the end of the model's context."""
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    """Streaming only: send a last chunk with token counts (``stream_options.include_usage``)."""


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a number, got {value!r}", "invalid_type", name)
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(400, f"'{name}' must be in {bounds}, got {value}", "invalid_value", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{name}' must be an integer, got {value!r}", "invalid_type", name)
    if low is not None and value < low:
        raise RequestError(400, f"'{name}' must be >= {low}, got {value}", "invalid_value", name)
    return value


def _message_text(content, index: int) -> str:
    """A message's content as one string; a list of text parts is joined with newlines (as vLLM does)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise RequestError(
                    400,
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': str}}; "
                    f"got {part!r} (only text is supported)",
                    "invalid_value",
                    "messages",
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(
        400,
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}",
        "invalid_type",
        "messages",
    )


def check_model(body, model_name: str) -> None:
    """A request body must be a JSON object naming the served model (400, or 404 for another model)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is None:
        raise RequestError(400, "'model' is required", "missing_required_parameter", "model")
    if model != model_name:
        raise RequestError(
            404, f"The model `{model}` does not exist; this server serves `{model_name}`.", "model_not_found", "model"
        )


def parse_chat_request(body, model_name: str) -> ChatRequest:
    """Validate a decoded ``/v1/chat/completions`` body; raises ``RequestError`` (400, or 404 for the model)."""
    check_model(body, model_name)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(
            400,
            "'messages' must be a non-empty list of {'role', 'content'} objects",
            "invalid_value" if "messages" in body else "missing_required_parameter",
            "messages",
        )
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise RequestError(
                400, f"messages[{i}] must be an object, got {type(m).__name__}", "invalid_type", "messages"
            )
        if m.get("role") not in ROLES:
            raise RequestError(
                400,
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                "invalid_value",
                "messages",
            )
        messages.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) and not (name == "response_format" and body[name] == {"type": "text"}):
            raise RequestError(400, f"'{name}' is not supported by this server", "unsupported_parameter", name)
    if body.get("n") not in (None, 1):
        raise RequestError(400, f"only n=1 is supported, got n={body['n']!r}", "unsupported_parameter", "n")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be a boolean, got {stream!r}", "invalid_type", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", "invalid_type", "stream_options")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", "invalid_value", "stop")
    # max_completion_tokens is the newer name of max_tokens; it wins when both are given (as in vLLM)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    return ChatRequest(
        messages=messages,
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        max_tokens=max_tokens,
        seed=_integer(body, "seed"),
        stop=tuple(stop),
        stream=stream,
        include_usage=bool(options.get("include_usage")),
    )
