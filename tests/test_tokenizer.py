import pytest

from ars_opd.data import synthetic
from ars_opd.data.prompts import (
    alpaca_messages,
    encode_completion,
    encode_completions,
    encode_prompt,
    encode_prompts,
)
from ars_opd.models.tokenizer import (
    EOS,
    PAD,
    TokenizerMismatchError,
    build_char_word_tokenizer,
    check_shared_tokenizer,
)


def test_letters_and_digits_are_atomic_words_whole(char_tokenizer):
    toks = char_tokenizer.convert_ids_to_tokens(char_tokenizer("Reverse the letters. xthey 1234")["input_ids"])
    assert toks[:4] == ["Reverse", " the", " letters", "."]
    # "the" inside a letter string is not a word: the payload stays letter by letter
    assert toks[4:] == [" ", "x", "t", "h", "e", "y", " ", "1", "2", "3", "4"]


def test_round_trip_and_unknown_characters(char_tokenizer):
    text = "### Instruction:\nCount the letter q.\n\n### Input:\nqqaq {}~"
    ids = char_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert char_tokenizer.decode(ids) == text
    ids = char_tokenizer("é", add_special_tokens=False)["input_ids"]
    assert ids == [char_tokenizer.unk_token_id]


def test_chat_template_renders_chatml_and_generation_prompt(char_tokenizer):
    msgs = alpaca_messages("Add the two numbers.", "3 + 4", system_prompt="Be brief.")
    text = char_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n### Instruction:\nAdd the two numbers.\n\n### Input:\n3 + 4<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = encode_prompt(char_tokenizer, msgs)
    assert char_tokenizer.decode(ids) == text
    assert char_tokenizer.convert_ids_to_tokens(ids[-3:]) == ["<|im_start|>", "assistant", "\n"]


def test_batched_encoding_equals_one_by_one(char_tokenizer):
    rows = synthetic.generate(40, seed=2)
    convs = [alpaca_messages(r["instruction"], r["input"]) for r in rows]
    assert encode_prompts(char_tokenizer, convs) == [encode_prompt(char_tokenizer, c) for c in convs]
    outs = [r["output"] for r in rows]
    assert encode_completions(char_tokenizer, outs) == [encode_completion(char_tokenizer, o) for o in outs]
    assert all(ids[-1] == char_tokenizer.eos_token_id for ids in encode_completions(char_tokenizer, outs))


def test_synthetic_sequences_are_short(char_tokenizer):
    rows = synthetic.generate(200, seed=0)
    lengths = [len(encode_prompt(char_tokenizer, alpaca_messages(r["instruction"], r["input"]))) for r in rows]
    assert max(lengths) <= 26


def test_special_tokens_and_save_load(tmp_path, char_tokenizer):
    from transformers import AutoTokenizer

    assert char_tokenizer.eos_token == EOS and char_tokenizer.pad_token == PAD
    assert char_tokenizer.pad_token_id != char_tokenizer.eos_token_id
    char_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    msgs = alpaca_messages("Sort the digits.", "9313")
    assert encode_prompt(loaded, msgs) == encode_prompt(char_tokenizer, msgs)
    check_shared_tokenizer(loaded, char_tokenizer)


def test_deterministic_vocabulary():
    a = build_char_word_tokenizer(["Alpha", "Beta"]).get_vocab()
    b = build_char_word_tokenizer(["Beta", "Alpha"]).get_vocab()
    assert a == b


def test_mismatched_tokenizers_are_refused_clearly(char_tokenizer):
    other = build_char_word_tokenizer(synthetic.instruction_words() + ["Multiply"])
    with pytest.raises(TokenizerMismatchError, match="Multiply"):
        check_shared_tokenizer(char_tokenizer, other)
    other.eos_token = PAD
    with pytest.raises(TokenizerMismatchError, match="special tokens differ"):
        check_shared_tokenizer(char_tokenizer, other)
