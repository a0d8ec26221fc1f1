"""The locally built tokenizer of the offline default, and the white-box tokenizer check.

Why this shape: on the synthetic letter tasks (reverse, uppercase, count) a BPE tokenizer fuses letter
pairs and a tiny model then cannot learn letter-level operations in minutes; single characters plus
whole-word tokens for the template and instruction words worked (measured: BPE with 300 to 1,000 merges
made no progress on reverse and uppercase in 100 s, this vocabulary did). So the vocabulary is:
special tokens, every printable ASCII character plus newline and tab, the Alpaca section headers as
single tokens (``### Instruction:\\n`` and ``\\n\\n### Input:\\n``), and a short list of whole words, each
also with its leading space, that match only between non-letters. Short sequences matter on two CPU
cores: the prompt of a synthetic task is about 18 tokens. Anything else (e.g. non-ASCII text) maps to
``<|unk|>``: this tokenizer serves the synthetic default, real data uses the real models' tokenizers.

The chat template is ChatML (as Qwen uses): ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, and the
generation prompt ``<|im_start|>assistant\\n``. EOS is ``<|im_end|>``; PAD is ``<|endoftext|>``.

``check_shared_tokenizer`` implements the white-box rule of token-level distillation: teacher and student
must share vocabulary and special tokens; a difference is refused with the first differing entries named, and
with the one switch that lifts the rule, ``opd.cross_tokenizer`` (the teacher then scores its own tokenisation
of the student's text, aligned span by span, so ids need not agree). ``tokenizer_differences`` is the same
comparison as a list, for the models stage, which records whether a cross-tokenizer pair happens to share one.
"""

from __future__ import annotations

import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS_CHAT, EOS, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS_CHAT, EOS, UNK)
TEMPLATE_WORDS = ("###", "Instruction", "Input", "Response", "system", "user", "assistant")
TEMPLATE_PIECES = ("### Instruction:\n", "\n\n### Input:\n")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class TokenizerMismatchError(ValueError):
    """Teacher and student tokenizers differ: white-box distillation is undefined."""


def build_char_word_tokenizer(words: list[str] | tuple[str, ...]) -> PreTrainedTokenizerFast:
    """Build the character + whole-word tokenizer with the ChatML template.

    ``words`` are kept whole where they stand between non-letters; all other text is split into
    single characters. The vocabulary order is fixed (specials, characters, sorted words), so the same
    word list always gives the same ids.
    """
    all_words = sorted(set(TEMPLATE_WORDS) | set(words))
    for w in all_words:
        if len(w) < 2 or any(c.isspace() for c in w):
            raise ValueError(f"whole-word token {w!r} must be at least 2 characters without spaces")
    chars = [chr(i) for i in range(32, 127)] + ["\n", "\t"]
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *chars, *TEMPLATE_PIECES, *all_words, *(" " + w for w in all_words)):
        vocab.setdefault(token, len(vocab))
    pieces = "|".join(re.escape(p) for p in TEMPLATE_PIECES)
    alternation = "|".join(re.escape(w) for w in sorted(all_words, key=lambda w: (-len(w), w)))
    # a piece; else a word after a space; else a word between non-letters; else one character
    pattern = rf"{pieces}| (?:{alternation})(?![A-Za-z])|(?<![A-Za-z])(?:{alternation})(?![A-Za-z])|[\s\S]"

    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> dict:
    """What must agree between teacher and student: vocabulary and special tokens."""
    return {
        "vocab_size": len(tok),
        "special_tokens": {
            name: getattr(tok, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        },
        "additional_special_tokens": sorted(str(t) for t in (tok.all_special_tokens or [])),
    }


def tokenizer_differences(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase) -> list[str]:
    """What keeps two tokenizers from mapping every token to the same id, one line per kind of difference (special
    tokens, added special tokens, vocabulary; the first few entries of each named); empty when they agree.

    Model embedding matrices may be padded beyond the tokenizer (e.g. 151,936 vs 152,064 rows); that is
    handled where logits are compared, by dropping ids >= len(tokenizer). Here only the tokenizers count.
    """
    fa, fb = tokenizer_fingerprint(teacher), tokenizer_fingerprint(student)
    problems = []
    if fa["special_tokens"] != fb["special_tokens"]:
        problems.append(f"special tokens differ: teacher {fa['special_tokens']} vs student {fb['special_tokens']}")
    if fa["additional_special_tokens"] != fb["additional_special_tokens"]:
        only_t = sorted(set(fa["additional_special_tokens"]) - set(fb["additional_special_tokens"]))[:5]
        only_s = sorted(set(fb["additional_special_tokens"]) - set(fa["additional_special_tokens"]))[:5]
        problems.append(f"added special tokens differ: only teacher {only_t}, only student {only_s}")
    va, vb = teacher.get_vocab(), student.get_vocab()
    if va != vb:
        only_t = sorted(set(va) - set(vb))[:5]
        only_s = sorted(set(vb) - set(va))[:5]
        moved = sorted(k for k in set(va) & set(vb) if va[k] != vb[k])[:5]
        problems.append(
            f"vocabularies differ ({len(va)} vs {len(vb)} tokens): only in teacher {only_t}, "
            f"only in student {only_s}, different ids for {moved}"
        )
    return problems


def mismatch_message(problems: list[str]) -> str:
    """The refusal of a pair that does not share a tokenizer: what differs, and the two ways forward."""
    return (
        "teacher and student do not share a tokenizer, so token-level distillation over one vocabulary is "
        "undefined: " + "; ".join(problems) + ". Choose a teacher and student from one model family, or set "
        "opd.cross_tokenizer: true to distil across tokenizers (the teacher scores its own tokenisation of the "
        "student's text, compared span by span; opd.loss sampled_token or cross_vocab)."
    )


def check_shared_tokenizer(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase) -> None:
    """Raise ``TokenizerMismatchError`` unless both tokenizers map every token to the same id
    (``tokenizer_differences``); the message names ``opd.cross_tokenizer``, the switch that allows such a pair."""
    problems = tokenizer_differences(teacher, student)
    if problems:
        raise TokenizerMismatchError(mismatch_message(problems))
