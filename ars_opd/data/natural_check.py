"""Checking a chat model's sentence answer against a natural prompt's one-word (or one-number) reference.

A real chat teacher answers "What is the capital of France?" with "The capital of France is Paris.", and
"What is 7 + 5? Answer with just the number." with "7 + 5 = 12" and a paragraph after it: a whole-answer
string match scores such a teacher near 0. The rule here is a lenient exact match:

1. Only the answer's **first sentence** counts: the text up to its first line break, or its first ``.``,
   ``!`` or ``?`` followed by white space or the end (so ``12.5`` stays one number). An answer given only in a
   later sentence is wrong.
2. Both texts are cut into **words**: lower case with accents dropped (``Bogotá`` is ``bogota``), runs of
   letters and digits, an apostrophe inside a word kept (``it's``, ``kitten's``), a decimal point or thousands
   comma between digits kept (``12.5``, ``1,200`` = 1200); everything else (punctuation, quotes, ``+``, ``=``,
   ``-``) separates words. So ``12`` does not match ``120`` or ``12.5``, ``Paris.`` matches ``paris``, and
   ``dollars`` does not match ``dollar`` (no stemming).
3. The reference must occur there as whole words (a multi-word reference such as ``new delhi`` as that
   sequence). For a **numeric** kind a number also matches when written in words from 0 to 99 (``twelve``,
   ``twenty-one``, ``twenty one``); no other spelling is recognised (``a dozen``, roman numerals).
   For a continent its adjective counts too (``ALIASES``: ``African`` for Africa), since "part of the African
   continent" is a common way to say it.
4. **No other candidate answer of the same kind comes before it**: for a word kind, any other answer of that
   kind's vocabulary (``CANDIDATES``: every capital, every opposite…); for a numeric kind, any other number.
   Candidates that occur in the prompt do not count, so restating the question ("The opposite of hot is cold",
   "7 + 5 = 12") is no distractor; "13, no, 12" is wrong.

The generator (``ars_opd.data.natural``) guarantees that no prompt contains its own reference (for a
numeric kind, its value) as a whole word (``gives_away``), so a model that only restates the question never
passes.

What it gets wrong, knowingly: a wrong answer that is not in the kind's vocabulary does not disqualify a right
one after it ("The capital of Australia is Sydney, not Canberra" passes, since Sydney is no capital); a negated
right answer passes ("It is not Paris" for Paris); a first sentence that lists several answers passes when the
reference comes first; an answer as right as the reference but other fails (one reference per prompt; the
tables leave out the prompts that have two); a number used as a word before the answer ("One way: 7 + 5 =
12") fails the answer; a sentence ended by an abbreviation ("Dr. …") is cut there; and a right answer given
only after a preamble sentence ("Denmark is a Scandinavian country. The official language is Danish.") fails.
That last one is the price of reading one sentence: taking the first candidate anywhere in the answer instead
would pass it, but would also pass a wrong first sentence whose wrong answer is outside the vocabulary and a
right word mentioned in passing later, and it would depend on how many tokens the model was allowed. On
SmolLM2-135M-Instruct's 788 answers (``bench/natural_teacher.py``) the first-candidate rule would pass 11 more:
8 right answers after a preamble, 3 a wrong answer or a word in passing (`is "wearen"… She wore…`). It never
needs the answer's end (no EOS), only its first sentence.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterable

from ars_opd.data.natural_words import ALIASES, CANDIDATES, CHECKABLE_KINDS, NUMERIC_KINDS

__all__ = ["CHECKABLE_KINDS", "NUMERIC_KINDS", "first_sentence", "gives_away", "is_correct", "number_words", "words"]

WORD = re.compile(r"[^\W_]+(?:['\u2019][^\W_]+)*(?:[.,][0-9]+)*")
SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n")
UNITS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}


def words(text: str) -> list[str]:
    """The text's words, lower case, accents dropped (rule 2)."""
    folded = unicodedata.normalize("NFKD", text.lower())
    return WORD.findall("".join(c for c in folded if not unicodedata.combining(c)))


def first_sentence(answer: str) -> str:
    """The answer up to its first line break or sentence end (rule 1), leading white space skipped."""
    text = answer.strip()
    m = SENTENCE_END.search(text)
    return text if m is None else text[: m.start()]


def number_words(n: int) -> str:
    """0..99 in English words, ``twenty one`` style (as the word splitter sees ``twenty-one``)."""
    if not 0 <= n <= 99:
        raise ValueError(f"numbers in words are spelt for 0..99 only, got {n}")
    if n < 20:
        return UNITS[n]
    tens = next(w for w, v in TENS.items() if v == n - n % 10)
    return tens if n % 10 == 0 else f"{tens} {UNITS[n % 10]}"


def _numbers(tokens: list[str]) -> list[tuple[int, int, str]]:
    """(start, end, value) of every number among the words: digits (``1,200`` as 1200, ``12.5`` as ``12.5``),
    or 0..99 in words (``twenty one`` one number)."""
    out, i = [], 0
    while i < len(tokens):
        t = tokens[i]
        if re.fullmatch(r"\d+|\d{1,3}(,\d{3})+", t):
            out.append((i, i + 1, str(int(t.replace(",", "")))))
        elif t[0].isdigit():  # 12.5, 3,4: a number, but no whole one
            out.append((i, i + 1, t))
        elif t in TENS:
            if i + 1 < len(tokens) and tokens[i + 1] in UNITS[1:10]:
                out.append((i, i + 2, str(TENS[t] + UNITS.index(tokens[i + 1]))))
                i += 1
            else:
                out.append((i, i + 1, str(TENS[t])))
        elif t in UNITS:
            out.append((i, i + 1, str(UNITS.index(t))))
        i += 1
    return out


def _find(tokens: list[str], phrase: tuple[str, ...]) -> Iterable[int]:
    n = len(phrase)
    return (i for i in range(len(tokens) - n + 1) if tuple(tokens[i : i + n]) == phrase)


def _phrases(kind: str, want: str) -> list[tuple[tuple[str, ...], str]]:
    """(words, the answer they give) for every candidate answer of a word kind, its aliases and ``want``."""
    names = [*CANDIDATES.get(kind, ()), want]
    return [(tuple(c.split()), c) for c in names] + [(tuple(a.split()), c) for a, c in ALIASES.get(kind, {}).items()]


def _spans(tokens: list[str], kind: str, want: str) -> list[tuple[int, int, str]]:
    """(start, end, answer) of every candidate answer of ``kind`` among the words."""
    if kind in NUMERIC_KINDS:
        return _numbers(tokens)
    return [(i, i + len(p), answer) for p, answer in _phrases(kind, want) for i in _find(tokens, p)]


def _key(kind: str, reference: str) -> str:
    """The reference as ``_spans`` names an answer: a number's digits, else its words joined by spaces."""
    if kind in NUMERIC_KINDS:
        return str(int(reference))
    return " ".join(words(reference))


def is_correct(kind: str, answer: str, reference: str, prompt: str) -> bool:
    """Whether ``answer`` gives ``reference`` for a checkable natural prompt of ``kind`` (the module's rule)."""
    want = _key(kind, reference)
    in_prompt = {a for _, _, a in _spans(words(prompt), kind, want)}
    spans = sorted(_spans(words(first_sentence(answer)), kind, want))
    hit = next((s for s in spans if s[2] == want), None)
    if hit is None:
        return False
    return not any(end <= hit[0] and a != want and a not in in_prompt for _, end, a in spans)


def gives_away(kind: str, reference: str, prompt: str) -> bool:
    """Whether the prompt itself contains the reference (as whole words; for a numeric kind, its value in
    digits or words): such a prompt would let a restatement of the question pass."""
    want = _key(kind, reference)
    return any(a == want for _, _, a in _spans(words(prompt), kind, want))
