"""Synthetic instruction tasks with checkable answers, in Alpaca form.

The offline default needs tasks that a tiny model can learn in minutes on two CPU cores and whose
answers a program can check, so that "did distillation work" becomes an exact-match number rather
than an impression. Each example is an Alpaca row (``instruction``, ``input``, ``output``) plus the
``task`` name. Generation is seeded and deterministic: the same (seed, n, config) always gives the
same rows, in the same order.

Tasks (``ars_opd.config.TASK_NAMES``: the values accepted by ``synthetic.tasks`` in params.yaml):

- ``add``: ``"13 + 8"`` -> ``"21"`` (operands 0..max_operand)
- ``reverse``: ``"hqzt"`` -> ``"tzqh"``
- ``sort_digits``: ``"5382"`` -> ``"2358"``
- ``length``: ``"hqzt"`` -> ``"4"`` (count the letters)
- ``uppercase``: ``"hqzt"`` -> ``"HQZT"``
- ``count_letter``: instruction names a letter, input is a letter string -> how often it occurs. Not in
  the default mix: a tiny model needs far longer to learn it (measured: stuck at the majority class
  after 1,500 steps while the other tasks passed 60%).

Letter payloads never equal one of the instruction words, so the local tokenizer (which keeps those
words whole) always sees them letter by letter. What this module leaves out: tokenisation and
prompt rendering (see ``ars_opd.models.tokenizer`` and ``ars_opd.data.prompts``).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Callable

from ars_opd.config import DEFAULT_TASKS, TASK_NAMES

LETTERS = string.ascii_lowercase
DIGITS = string.digits

INSTRUCTIONS = {
    "add": "Add the two numbers.",
    "reverse": "Reverse the letters.",
    "sort_digits": "Sort the digits.",
    "length": "Count the letters.",
    "uppercase": "Uppercase the letters.",
    "count_letter": "Count the letter {letter}.",
}


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of the synthetic payloads."""

    max_operand: int = 19
    min_len: int = 3
    max_len: int = 5


def instruction_words() -> list[str]:
    """Every word that appears in an instruction template, for the tokenizer's whole-word tokens."""
    words: set[str] = set()
    for text in INSTRUCTIONS.values():
        words.update(re.findall(r"[A-Za-z]{2,}", text.replace("{letter}", "")))
    return sorted(words)


def _letters(rng: random.Random, spec: TaskSpec) -> str:
    reserved = {w.lower() for w in instruction_words()}
    while True:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(spec.min_len, spec.max_len)))
        if s not in reserved:
            return s


def _make_add(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    a, b = rng.randint(0, spec.max_operand), rng.randint(0, spec.max_operand)
    return INSTRUCTIONS["add"], f"{a} + {b}", str(a + b)


def _make_reverse(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    s = _letters(rng, spec)
    return INSTRUCTIONS["reverse"], s, s[::-1]


def _make_sort_digits(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    s = "".join(rng.choice(DIGITS) for _ in range(rng.randint(spec.min_len, spec.max_len)))
    return INSTRUCTIONS["sort_digits"], s, "".join(sorted(s))


def _make_length(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    s = _letters(rng, spec)
    return INSTRUCTIONS["length"], s, str(len(s))


def _make_count_letter(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    letter = rng.choice(LETTERS)
    s = _letters(rng, spec)
    # Plant the letter a few times so counts other than 0 are common.
    chars = list(s)
    for _ in range(rng.randint(0, 3)):
        chars[rng.randrange(len(chars))] = letter
    s = "".join(chars)
    if s in {w.lower() for w in instruction_words()}:  # planting can recreate a reserved word
        s = s + letter
    return INSTRUCTIONS["count_letter"].format(letter=letter), s, str(s.count(letter))


def _make_uppercase(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    s = _letters(rng, spec)
    return INSTRUCTIONS["uppercase"], s, s.upper()


_MAKERS: dict[str, Callable[[random.Random, TaskSpec], tuple[str, str, str]]] = {
    "add": _make_add,
    "reverse": _make_reverse,
    "sort_digits": _make_sort_digits,
    "length": _make_length,
    "uppercase": _make_uppercase,
    "count_letter": _make_count_letter,
}


def generate(n: int, seed: int, tasks: tuple[str, ...] = DEFAULT_TASKS, spec: TaskSpec = TaskSpec()) -> list[dict]:
    """Return ``n`` Alpaca rows ``{instruction, input, output, task}``; tasks drawn uniformly, seeded."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    unknown = [t for t in tasks if t not in _MAKERS]
    if unknown or not tasks:
        raise ValueError(f"unknown synthetic task(s) {unknown}; allowed: {list(TASK_NAMES)}")
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        task = tasks[rng.randrange(len(tasks))]
        instruction, inp, out = _MAKERS[task](rng, spec)
        rows.append({"instruction": instruction, "input": inp, "output": out, "task": task})
    return rows


def stream(seed: int, tasks: tuple[str, ...] = DEFAULT_TASKS, spec: TaskSpec = TaskSpec(), chunk: int = 4096):
    """Endless deterministic stream of rows (for training the built-in teacher)."""
    k = 0
    while True:
        yield from generate(chunk, seed=seed * 1_000_003 + k, tasks=tasks, spec=spec)
        k += 1


def expected_answer(task: str, instruction: str, inp: str) -> str:
    """Recompute the answer from the instruction and input text alone (the exact-match oracle)."""
    if task == "add":
        a, b = (int(x) for x in inp.split("+"))
        return str(a + b)
    if task == "reverse":
        return inp[::-1]
    if task == "sort_digits":
        return "".join(sorted(inp))
    if task == "length":
        return str(len(inp))
    if task == "count_letter":
        m = re.search(r"letter (\w)\.", instruction)
        if not m:
            raise ValueError(f"count_letter instruction names no letter: {instruction!r}")
        return str(inp.count(m.group(1)))
    if task == "uppercase":
        return inp.upper()
    raise ValueError(f"unknown synthetic task {task!r}; allowed: {list(TASK_NAMES)}")


def is_correct(answer: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return answer.strip() == reference.strip()
