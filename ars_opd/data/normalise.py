"""Row normalisation: one raw dataset row to chat messages (the prompt) and a reference answer.

Row formats (``data.format``, or detected per row with ``auto``): Alpaca (instruction / input / output),
chat ``messages`` (role / content, the last assistant turn is the reference), ``prompt`` with an optional
``response``/``completion``/``output``, and ShareGPT ``conversations`` (from / value). ``messages`` is the
prompt (everything before the reference answer), ``reference`` the dataset's answer or null, ``task`` the
synthetic task name or null. A prompt-only row is valid, since the teacher writes the completion: an Alpaca
row without ``output`` (or with ``output: null``), a conversation that ends with a user turn, a ``prompt``
without a response. An answer that is present but empty is malformed (``empty_response``).

Malformed rows are not fixed up: ``normalise_row`` raises ``RowError(reason)`` and the caller counts it,
so a bad row is reported, never silently repaired into a different example.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from ars_opd.artifacts import dumps_canonical
from ars_opd.data.prompts import alpaca_messages
from ars_opd.data.sources import Malformed

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
RESPONSE_KEYS = ("response", "completion", "output")


class RowError(ValueError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _text(row: Mapping, key: str, required: bool = True) -> str | None:
    if key not in row or row[key] is None:
        if required:
            raise RowError(f"missing_field:{key}")
        return None
    value = row[key]
    if not isinstance(value, str):
        raise RowError(f"wrong_type:{key}")
    return value


def detect_format(row: Mapping) -> str:
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "prompt" in row:
        return "prompt_response"
    raise RowError("unknown_format")


def _chat_turns(turns: Any, role_key: str, content_key: str, role_map: Mapping[str, str]) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise RowError("empty_conversation")
    out = []
    for t in turns:
        if not isinstance(t, Mapping) or role_key not in t or content_key not in t:
            raise RowError("bad_turn")
        role = role_map.get(t[role_key]) if isinstance(t[role_key], str) else None
        if role is None:
            raise RowError("bad_role")
        if not isinstance(t[content_key], str):
            raise RowError("wrong_type:content")
        out.append({"role": role, "content": t[content_key]})
    return out


def _split_conversation(turns: list[dict]) -> tuple[list[dict], str | None]:
    reference = None
    if turns[-1]["role"] == "assistant":
        reference = turns[-1]["content"]
        turns = turns[:-1]
    if not any(t["role"] == "user" for t in turns):
        raise RowError("no_user_turn")
    if turns[-1]["role"] != "user":
        raise RowError("prompt_not_ending_with_user")
    if any(t["role"] == "system" for t in turns[1:]):
        raise RowError("system_not_first")
    return turns, reference


def normalise_row(row: Any, fmt: str,
                  system_prompt: str | None = None) -> tuple[list[dict], str | None, str | None, str]:
    """Normalise one raw row -> (prompt messages, reference or None, task or None, format).

    Raises ``RowError(reason)`` for a malformed row.
    """
    if isinstance(row, Malformed):
        raise RowError(row.reason)
    if not isinstance(row, Mapping):
        raise RowError("not_an_object")
    fmt = detect_format(row) if fmt == "auto" else fmt
    task = row.get("task") if isinstance(row.get("task"), str) else None
    if fmt == "alpaca":
        instruction = _text(row, "instruction")
        inp = _text(row, "input", required=False)
        reference = _text(row, "output", required=False)  # absent or null: a prompt-only row
        if not instruction.strip():
            raise RowError("empty_prompt")
        messages = alpaca_messages(instruction, inp, None)
    elif fmt == "messages":
        messages, reference = _split_conversation(_chat_turns(row.get("messages"), "role", "content",
                                                              {r: r for r in ROLES}))
    elif fmt == "sharegpt":
        messages, reference = _split_conversation(_chat_turns(row.get("conversations"), "from", "value",
                                                              SHAREGPT_ROLES))
    elif fmt == "prompt_response":
        prompt = _text(row, "prompt")
        if not prompt.strip():
            raise RowError("empty_prompt")
        reference = None
        for key in RESPONSE_KEYS:
            if key in row:
                reference = _text(row, key, required=False)
                break
        messages = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"unknown format {fmt!r}")
    if any(not m["content"].strip() for m in messages):
        raise RowError("empty_prompt")
    if reference is not None and not reference.strip():
        raise RowError("empty_response")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages, reference, task, fmt


def row_id(messages: list[dict], reference: str | None) -> str:
    return hashlib.sha256(dumps_canonical({"messages": messages, "reference": reference}).encode()).hexdigest()[:16]
