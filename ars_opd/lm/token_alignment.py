"""Aligning two tokenisations of one text into spans whose boundaries both share (cross-tokenizer OPD).

The student samples token ids; their text is what the student's tokenizer decodes them to. The teacher tokenises
that text with its own tokenizer. Neither side's tokens need line up with the other's, but some of their
boundaries do: a character position where a student token ends and a teacher token ends too. Cutting the text at
every shared boundary gives spans; each token of either side lies in exactly one span, so a span's
log-probability on a side is the sum of its tokens' (the chain rule), and the spans' sum is the whole
sequence's, exactly, on both sides.

Where a token ends is read off its tokenizer, not guessed from strings: the end of token k is the length of the
decoded prefix ``ids[:k + 1]`` when that decoded prefix is a prefix of the text, and undefined otherwise
(a byte-level token ending inside a multi-byte character decodes to U+FFFD, which is no prefix; a SentencePiece
prefix space is stripped the same way in the prefix and in the whole). So:

- **whitespace merging**: "  a" as one token on one side and " ", " a" on the other share only the boundary at
  "a"'s end: one span;
- **a different number of pieces at a boundary**: "hello" against "hel", "lo": one span of one and two tokens;
- **tokens that cover no character** (a special token other than the end, decoded to nothing): they join the
  span before them (the first span if they lead; the end span when the completion has no text before its end);
- **the end**: the student's EOS, when it ended its completion, and the teacher's end-of-turn token appended to
  the teacher's tokens are their own span, the last;
- **a BOS on one side only**: it belongs to that side's prompt, never to the completion, which is tokenised
  without special tokens (``teacher_completion_ids``), so it cannot shift the alignment;
- **text the teacher cannot spell** (its decoded tokens are not the text, e.g. an unknown character that the
  character tokenizer writes as ``<|unk|>``): the teacher's prefix decodes stop being prefixes of the text there,
  so a teacher token past the difference gets its end from the tokenizer's offset mapping (fast tokenizers; a
  slow one has none, and its tokens past the difference have no end), accepted only where the tokenizer itself
  verifies it: the teacher's tokens after it decode to exactly the rest of the text (``decode(ids[u + 1:]) ==
  text[e:]``; for the last token ``"" == text[len(text):]``), its end is not before the previous accepted end, and
  the teacher's tokens since that previous end, its unknown tokens left out, decode to exactly that stretch of the
  text, the characters under the unknown tokens' offsets left out. So the alignment resumes after text the
  teacher cannot spell: the span holding the unspellable characters pairs the student's tokens of them with the
  teacher's unknown token(s) (the student pays log q - log p_T(<|unk|>) there; with several unknown stretches,
  everything from the first to the last is one span, since a suffix decode that still holds an ``<|unk|>`` is not
  the text), the text after them aligns as usual, and the end span exists when the text's end is verified. A
  teacher whose normaliser changes the text (e.g. lowercasing) fails the last check from its first difference
  on: its tokens after the last boundary both share before that difference, and the end, belong to no span
  (index -1) and carry no loss (counted: ``Alignment.unaligned_student``), as does any token that no verified
  boundary follows. Suffix decodes run only for tokens whose prefix check failed.
"""

from __future__ import annotations

from dataclasses import dataclass

UNALIGNED = -1


@dataclass(frozen=True)
class Alignment:
    """Spans of one completion: ``student_span[k]`` / ``teacher_span[u]`` the span of each side's token k / u
    (``UNALIGNED`` for the tokens that no verified shared boundary follows, e.g. past a teacher normaliser's change);
    ``ends[j]`` the character position where span j ends (the end span ends at ``len(text)`` too)."""

    text: str
    student_span: tuple[int, ...]
    teacher_span: tuple[int, ...]
    ends: tuple[int, ...]
    end_span: bool  # the last span is the pair of end tokens (the student ended its completion)

    @property
    def n_spans(self) -> int:
        return len(self.ends)

    @property
    def unaligned_student(self) -> int:
        return sum(s == UNALIGNED for s in self.student_span)

    def starts(self, side: str) -> list[int]:
        """Index of each span's first token on ``side`` ('student' or 'teacher'), -1 for a span with none there."""
        spans = self.student_span if side == "student" else self.teacher_span
        first = [-1] * self.n_spans
        for k, s in enumerate(spans):
            if s != UNALIGNED and first[s] < 0:
                first[s] = k
        return first


def token_ends(
    tokenizer,
    ids: list[int],
    text: str,
    *,
    skip_special_tokens: bool,
    offsets: list[tuple[int, int]] | None = None,
) -> list[int | None]:
    """The character position in ``text`` where each token of ``ids`` ends, or None where that is undefined:
    the decoded prefix up to and including the token is not a prefix of ``text``, or would end before an
    earlier token's end.

    ``offsets``: each token's character range in ``text`` from the tokenizer's offset mapping, given when ``ids``
    are ``tokenizer``'s own tokens of ``text`` (the teacher's side). Then a token whose prefix check fails ends
    where its offsets end, if the tokenizer verifies that end (``_resumed_end``); the suffix decodes this takes run
    only for such tokens."""
    ends: list[int | None] = []
    last, gap = 0, 0  # the last accepted end, and the first token after the one that ended there
    for k in range(len(ids)):
        prefix = tokenizer.decode(ids[: k + 1], skip_special_tokens=skip_special_tokens)
        if text.startswith(prefix) and len(prefix) >= last:
            end: int | None = len(prefix)
        elif offsets is not None:
            end = _resumed_end(tokenizer, ids, text, offsets, k, last, gap, skip_special_tokens)
        else:
            end = None
        if end is not None:
            last, gap = end, k + 1
        ends.append(end)
    return ends


def _resumed_end(tokenizer, ids, text, offsets, k, last, gap, skip_special_tokens) -> int | None:
    """Token k's end from its offsets, when the tokenizer verifies it: not before ``last`` (the previous accepted
    end, of token ``gap - 1``), the tokens after k decode to exactly ``text[end:]``, and the tokens ``gap..k`` other
    than the unknown token decode to exactly ``text[last:end]`` less the characters under the unknown tokens'
    offsets (the only text the teacher may fail to spell; a normaliser's change, e.g. a lowercased letter, fails)."""
    end = int(offsets[k][1])
    if not last <= end <= len(text):
        return None
    if tokenizer.decode(ids[k + 1 :], skip_special_tokens=skip_special_tokens) != text[end:]:
        return None
    unk = getattr(tokenizer, "unk_token_id", None)
    kept, spelled, pos = [], [], last
    for u in range(gap, k + 1):
        if unk is not None and ids[u] == unk:
            lo, hi = (int(x) for x in offsets[u])
            if not pos <= lo <= hi <= end:
                return None
            spelled.append(text[pos:lo])
            pos = hi
        else:
            kept.append(ids[u])
    spelled.append(text[pos:end])
    if tokenizer.decode(kept, skip_special_tokens=skip_special_tokens) != "".join(spelled):
        return None
    return end


def _assign(ends: list[int | None], index: dict[int, int]) -> list[int]:
    """Each token's span: the one closed by the nearest shared boundary at or after the token's own end."""
    spans = [UNALIGNED] * len(ends)
    nxt = UNALIGNED
    for k in range(len(ends) - 1, -1, -1):
        e = ends[k]
        if e is not None and e in index:
            nxt = index[e]
        spans[k] = nxt
    return spans


def align(
    text: str,
    student_ends: list[int | None],
    teacher_ends: list[int | None],
    *,
    student_end_token: bool = False,
    teacher_end_token: bool = False,
) -> Alignment:
    """Spans of two tokenisations of ``text`` given each token's end (``token_ends``). ``*_end_token``: the side's
    last token is its end token (EOS / end of turn), which covers no character and is not in ``*_ends``."""
    if student_end_token != teacher_end_token:
        raise ValueError("the end token must be on both sides or on neither (the teacher's mirrors the student's)")
    shared = sorted(({e for e in student_ends if e} & {e for e in teacher_ends if e}))
    index = {e: j for j, e in enumerate(shared)}
    student = _assign(student_ends, index)
    teacher = _assign(teacher_ends, index)
    ends = list(shared)
    complete = bool(shared) and shared[-1] == len(text) or not text
    if student_end_token:
        if complete:  # the end tokens: their own span, predicted from the whole text on both sides
            if not text:  # only zero-width tokens before the end (special tokens): they lead the only span
                student = [len(ends)] * len(student)
            student.append(len(ends))
            teacher.append(len(ends))
            ends.append(len(text))
        else:
            student.append(UNALIGNED)
            teacher.append(UNALIGNED)
    return Alignment(text, tuple(student), tuple(teacher), tuple(ends), student_end_token and complete)


@dataclass(frozen=True)
class RowAlignment:
    """One student completion on the teacher's side: the teacher's completion ids (its tokens of the text, and its
    end token where the student ended) and the alignment of the two."""

    teacher_ids: tuple[int, ...]
    alignment: Alignment


class CrossTokenizer:
    """Render a student completion as text and tokenise it for the teacher, aligned.

    ``student_eos_ids``: the ids that end a student completion (the last kept token when it ended);
    ``teacher_end_id``: the teacher's end-of-turn token, appended where the student ended.
    """

    def __init__(self, student_tokenizer, teacher_tokenizer, student_eos_ids, teacher_end_id: int):
        self.student, self.teacher = student_tokenizer, teacher_tokenizer
        self.student_eos = frozenset(int(i) for i in student_eos_ids)
        self.teacher_end_id = int(teacher_end_id)

    def text(self, ids: list[int]) -> str:
        """The student's text of its completion tokens (no end token): special tokens decode to nothing."""
        return self.student.decode(ids, skip_special_tokens=True)

    def teacher_completion_ids(self, text: str) -> list[int]:
        """The teacher's tokens of ``text``: no BOS or other added special tokens, and a special token's literal
        text (e.g. "<|im_end|>" written out by the student) is spelled as text, never turned into a control id."""
        return self._teacher_tokens(text)[0]

    def _teacher_tokens(self, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
        """``teacher_completion_ids`` and each token's character range in ``text`` (None from a slow tokenizer,
        which has no offset mapping)."""
        fast = bool(getattr(self.teacher, "is_fast", False))
        enc = self.teacher(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=fast)
        ids = list(enc["input_ids"])
        offsets = [tuple(o) for o in enc["offset_mapping"]] if fast else None
        return ids, offsets if offsets is not None and len(offsets) == len(ids) else None

    def align(self, completion: list[int]) -> RowAlignment:
        """``completion``: the student's kept completion ids, its end token last if it ended."""
        completion = [int(i) for i in completion]
        ended = bool(completion) and completion[-1] in self.student_eos
        body = completion[:-1] if ended else completion
        text = self.text(body)
        teacher_body, offsets = self._teacher_tokens(text)
        alignment = align(
            text,
            token_ends(self.student, body, text, skip_special_tokens=True),
            token_ends(self.teacher, teacher_body, text, skip_special_tokens=False, offsets=offsets),
            student_end_token=ended,
            teacher_end_token=ended,
        )
        return RowAlignment(tuple(teacher_body + ([self.teacher_end_id] if ended else [])), alignment)


def special_ids(tokenizer) -> set[int]:
    """Every special token's id: the named ones (bos, eos, pad, unk and the additional specials) and every added
    token marked special (SmolLM2 names 3 of its 17)."""
    special = set(tokenizer.all_special_ids or [])
    return special | {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if t.special}


def teacher_end_id(tokenizer) -> int:
    """The teacher's end-of-turn token, appended where the student ended its completion: the first token its own
    chat template writes after an assistant message's content (``<|im_end|>``, Gemma's ``<end_of_turn>``, Phi-3's
    ``<|end|>``: not always the tokenizer's ``eos_token``), else its ``eos_token``."""
    marker = "\u2063ars-opd-end\u2063"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # a template that cannot render this conversation: fall back to the eos token
        text = ""
    if marker in text:
        after = tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]
        special = special_ids(tokenizer)
        if after and after[0] in special:
            return int(after[0])
    if tokenizer.eos_token_id is None:
        raise ValueError("the teacher's tokenizer has no eos_token: cannot mark where the student's completion ended")
    return int(tokenizer.eos_token_id)
