"""Prompt rendering and token encoding shared by every stage.

One rule everywhere: a training or generation example is the chat template applied to the *prompt*
messages with the generation prompt appended, followed by the completion's tokens and EOS. Encoding
prompt and completion separately (rather than templating the whole conversation and searching for the
assistant turn) makes the prompt/response boundary exact for any template and makes the tokens a
model is trained on identical to the tokens it sees when it generates.

A teacher completion ends with EOS only where the teacher ended it (``teacher_ended``): a completion the
teacher was cut off in at its length limit (``finish_reason: length``) gets none, so that no student learns
to stop where a teacher ran out of ``max_tokens`` (``encode_teacher_completions``; whether such rows are
trained on without an end or dropped is each training stage's ``truncated_completions``).

Alpaca rows become one user message: ``### Instruction:\\n{instruction}`` followed, when the input is not
empty, by ``\\n\\n### Input:\\n{input}``; the Alpaca "### Response:" part is the assistant turn.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def alpaca_user_message(instruction: str, inp: str | None) -> str:
    """Render the Instruction / Input part of the Alpaca template as one user message."""
    text = f"### Instruction:\n{instruction.strip()}"
    if inp is not None and inp.strip():
        text += f"\n\n### Input:\n{inp.strip()}"
    return text


def alpaca_messages(instruction: str, inp: str | None, system_prompt: str | None = None) -> list[dict]:
    """Prompt messages for an Alpaca row (the response is the assistant turn, not included)."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": alpaca_user_message(instruction, inp)})
    return msgs


def encode_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    """Token ids of the chat-templated prompt, ending with the assistant generation prompt."""
    enc = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(enc["input_ids"])  # transformers 5 returns a BatchEncoding


def encode_prompts(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]]) -> list[list[int]]:
    """``encode_prompt`` for many prompts at once: render each template, tokenize in one batched call.

    Identical to ``apply_chat_template(tokenize=True)`` (which renders, then tokenizes without adding
    special tokens) and several times faster for training batches.
    """
    if not conversations:
        return []
    texts = tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encode_completions(
    tokenizer: PreTrainedTokenizerBase, completions: list[str], add_eos: bool = True
) -> list[list[int]]:
    """``encode_completion`` for many completions in one batched tokenizer call."""
    if not completions:
        return []
    if add_eos and tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token; cannot mark where a completion ends")
    out = [list(ids) for ids in tokenizer(completions, add_special_tokens=False)["input_ids"]]
    return [ids + [tokenizer.eos_token_id] for ids in out] if add_eos else out


def encode_completion(tokenizer: PreTrainedTokenizerBase, completion: str, add_eos: bool = True) -> list[int]:
    """Token ids of a completion, followed by EOS so the model learns to stop."""
    ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token; cannot mark where a completion ends")
        ids.append(tokenizer.eos_token_id)
    return ids


TRUNCATED = "length"  # the finish_reason of a completion cut at the length limit (max_tokens or the context)


def teacher_ended(row: dict) -> bool:
    """Whether the teacher ended this teacher_gen row's completion itself (EOS or a stop string): every
    ``finish_reason`` but ``length``, the completion cut at ``max_tokens`` or the context, which has no end."""
    return row.get("finish_reason") != TRUNCATED


def encode_teacher_completions(tokenizer: PreTrainedTokenizerBase, rows: list[dict]) -> list[list[int]]:
    """The ``completion`` tokens of teacher_gen rows, each followed by EOS where the teacher ended it
    (``teacher_ended``) and by nothing where it was cut off, in one batched tokenizer call."""
    ids = encode_completions(tokenizer, [r["completion"] for r in rows], add_eos=False)
    if any(teacher_ended(r) for r in rows) and tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token; cannot mark where a completion ends")
    return [x + [tokenizer.eos_token_id] if teacher_ended(r) else x for x, r in zip(ids, rows)]
