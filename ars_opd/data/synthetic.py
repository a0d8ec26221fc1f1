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

The long-horizon family (``ars_opd.config.LONG_HORIZON_TASKS``, off by default): answers of 20-60 tokens
written as a chain of steps joined by ``", "``, each step computed from the one before it, so that one
wrong intermediate token carries into every later step (the regime where a student trained only on
teacher text never learns to recover from its own states):

- ``running_sum``: ``"7 + 5 + 9 + 3 + 8"`` -> ``"7+5=12, 12+9=21, 21+3=24, 24+8=32"`` (5-7 terms of 1..9);
  the final answer is the last sum;
- ``shift_steps``: instruction ``"Shift the letters 4 times."``, input ``"hqzt"`` -> ``"iral, jsbm, ktcn,
  ludo"``: each step moves every letter of the previous one to the next letter of the alphabet (z -> a);
  4-7 steps of 4-5 letters; the final answer is the last step.

``check_steps`` compares an answer with the reference step by step (which steps are right, where the first
error is); exact match on these tasks counts the final answer (``is_correct_for``).

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

from ars_opd.config import DEFAULT_TASKS, LONG_HORIZON_TASKS, TASK_NAMES

LETTERS = string.ascii_lowercase
DIGITS = string.digits

INSTRUCTIONS = {
    "add": "Add the two numbers.",
    "reverse": "Reverse the letters.",
    "sort_digits": "Sort the digits.",
    "length": "Count the letters.",
    "uppercase": "Uppercase the letters.",
    "count_letter": "Count the letter {letter}.",
    "running_sum": "Add the numbers.",
    "shift_steps": "Shift the letters {steps} times.",
}
# The tokenizer's whole words come from the short tasks' instructions only, so the vocabulary is the same
# for every task mix (a model trained on one mix reads another); a long-horizon instruction's other words are
# spelt in characters ("Shift", "times").
WORD_TASKS = ("add", "reverse", "sort_digits", "length", "uppercase", "count_letter")
STEP_SEPARATOR = ", "
RUNNING_SUM_TERMS = (5, 7)  # terms per running_sum prompt, each in 1..9: 4-6 steps, 26-51 answer tokens
SHIFT_STEPS = (4, 7)  # steps per shift_steps prompt
SHIFT_LETTERS = (4, 5)  # letters per shift_steps string: 22-41 answer tokens


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of the synthetic payloads."""

    max_operand: int = 19
    min_len: int = 3
    max_len: int = 5


def instruction_words() -> list[str]:
    """Every word that appears in an instruction template, for the tokenizer's whole-word tokens."""
    words: set[str] = set()
    for task in WORD_TASKS:
        words.update(re.findall(r"[A-Za-z]{2,}", INSTRUCTIONS[task].replace("{letter}", "")))
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


def running_sum_steps(terms: list[int]) -> list[str]:
    """``"a+b=c"`` for each term after the first, ``a`` the running total so far."""
    steps, total = [], terms[0]
    for x in terms[1:]:
        steps.append(f"{total}+{x}={total + x}")
        total += x
    return steps


def _shift(s: str) -> str:
    return "".join(LETTERS[(LETTERS.index(c) + 1) % 26] for c in s)


def shift_chain(s: str, steps: int) -> list[str]:
    """``s`` shifted by one letter, then that shifted again, ``steps`` times."""
    out = []
    for _ in range(steps):
        s = _shift(s)
        out.append(s)
    return out


def _make_running_sum(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    terms = [rng.randint(1, 9) for _ in range(rng.randint(*RUNNING_SUM_TERMS))]
    return INSTRUCTIONS["running_sum"], " + ".join(map(str, terms)), STEP_SEPARATOR.join(running_sum_steps(terms))


def _make_shift_steps(rng: random.Random, spec: TaskSpec) -> tuple[str, str, str]:
    steps = rng.randint(*SHIFT_STEPS)
    reserved = {w.lower() for w in instruction_words()}
    while True:  # no string of the chain may be a whole-word token ("user"): the task is letter by letter
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(*SHIFT_LETTERS)))
        chain = shift_chain(s, steps)
        if reserved.isdisjoint([s, *chain]):
            return INSTRUCTIONS["shift_steps"].format(steps=steps), s, STEP_SEPARATOR.join(chain)


_MAKERS: dict[str, Callable[[random.Random, TaskSpec], tuple[str, str, str]]] = {
    "add": _make_add,
    "reverse": _make_reverse,
    "sort_digits": _make_sort_digits,
    "length": _make_length,
    "uppercase": _make_uppercase,
    "count_letter": _make_count_letter,
    "running_sum": _make_running_sum,
    "shift_steps": _make_shift_steps,
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
    if task == "running_sum":
        return STEP_SEPARATOR.join(running_sum_steps([int(x) for x in inp.split("+")]))
    if task == "shift_steps":
        m = re.search(r"letters (\d+) times\.", instruction)
        if not m:
            raise ValueError(f"shift_steps instruction names no step count: {instruction!r}")
        return STEP_SEPARATOR.join(shift_chain(inp.strip(), int(m.group(1))))
    raise ValueError(f"unknown synthetic task {task!r}; allowed: {list(TASK_NAMES)}")


def is_correct(answer: str, reference: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return answer.strip() == reference.strip()


def final_answer(task: str, text: str) -> str:
    """A long-horizon answer's final answer: the last sum of ``running_sum``, the last step of
    ``shift_steps``. Other tasks' answers are their own final answer."""
    last = text.strip().split(STEP_SEPARATOR.strip())[-1].strip()
    if task == "running_sum":
        return last.rsplit("=", 1)[-1].strip() if "=" in last else ""
    return last if task in LONG_HORIZON_TASKS else text.strip()


def is_correct_for(task: str | None, answer: str, reference: str) -> bool:
    """Exact match as the evaluation counts it: the final answer on long-horizon tasks, the whole answer on
    the others."""
    if task in LONG_HORIZON_TASKS:
        return final_answer(task, answer) == final_answer(task, reference)
    return is_correct(answer, reference)


@dataclass(frozen=True)
class StepCheck:
    """A long-horizon answer against its reference, step by step."""

    correct: tuple[bool, ...]  # per reference step: the answer's step at that index equals it
    extra_steps: int  # steps the answer writes beyond the reference's

    @property
    def first_error(self) -> int | None:
        """Index of the first wrong (or missing) reference step; ``len(correct)`` when every reference step is
        right but the answer goes on; None when the answer is the reference."""
        for i, ok in enumerate(self.correct):
            if not ok:
                return i
        return len(self.correct) if self.extra_steps else None

    @property
    def step_accuracy(self) -> float:
        return sum(self.correct) / len(self.correct)


def answer_steps(text: str) -> list[str]:
    """An answer split into its steps (whitespace around each step ignored)."""
    return [s.strip() for s in text.strip().split(STEP_SEPARATOR.strip())] if text.strip() else []


def check_steps(answer: str, reference: str) -> StepCheck:
    """Which of the reference's steps the answer gets right, index by index. A step is right when its text
    equals the reference step's: a wrong intermediate token makes its own step wrong, and on these tasks
    every later step computed from it wrong too."""
    got, want = answer_steps(answer), answer_steps(reference)
    correct = tuple(i < len(got) and got[i] == w for i, w in enumerate(want))
    return StepCheck(correct, max(0, len(got) - len(want)))
