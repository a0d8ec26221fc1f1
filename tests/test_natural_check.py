"""The natural prompts' answer rule on hand-written answers: right, wrong, a restated question, an answer buried
later, multi-word references, numbers that contain the reference's digits, number words, distractors."""

from __future__ import annotations

import pytest

from ars_opd.data.natural_check import first_sentence, gives_away, is_correct, number_words, words

CAPITAL = "What is the capital of France?"
SUM = "What is 7 + 5? Answer with just the number."
OPPOSITE = "What is the opposite of hot?"


@pytest.mark.parametrize(
    "kind, answer, reference, prompt, ok",
    [
        # the teacher's measured answers
        ("nl_capital", "The capital of France is Paris.", "Paris", CAPITAL, True),
        ("nl_sum", "7 + 5 = 12\n\nThis is a classic example of how math works: 13 people...", "12", SUM, True),
        ("nl_opposite", "The opposite of hot is cold.", "cold", OPPOSITE, True),
        ("nl_plural", "The plural of mouse is mice.", "mice", "What is the plural of mouse?", True),
        # a bare answer, any case, any punctuation around it
        ("nl_capital", "PARIS!", "Paris", CAPITAL, True),
        ("nl_capital", '"Paris"', "Paris", CAPITAL, True),
        # wrong
        ("nl_capital", "The capital of France is Lyon.", "Paris", CAPITAL, False),
        ("nl_sum", "7 + 5 = 13", "12", SUM, False),
        ("nl_opposite", "The opposite of hot is warm.", "cold", OPPOSITE, False),
        # the question restated, no answer
        ("nl_capital", "The capital of France is a city.", "Paris", CAPITAL, False),
        ("nl_sum", "7 + 5 is a sum of 7 and 5.", "12", SUM, False),
        ("nl_opposite", "The opposite of hot is a word.", "cold", OPPOSITE, False),
        # the right answer only after the first sentence (or line)
        ("nl_capital", "France is a country in Europe. Its capital is Paris.", "Paris", CAPITAL, False),
        ("nl_sum", "To add them we count on.\n7 + 5 = 12", "12", SUM, False),
        ("nl_opposite", "The opposite of hot is warm! Or cold.", "cold", OPPOSITE, False),
        # numbers: whole numbers only, 12 is neither 120 nor 112 nor 12.5; words count
        ("nl_sum", "7 + 5 = 120", "12", SUM, False),
        ("nl_sum", "The answer is 112.", "12", SUM, False),
        ("nl_sum", "The answer is 12.5.", "12", SUM, False),
        ("nl_sum", "The answer is 12.", "12", SUM, True),
        ("nl_sum", "Seven plus five is twelve.", "12", SUM, True),
        ("nl_sum", "It is twenty-one.", "21", "What is 13 + 8? Answer with just the number.", True),
        ("nl_sum", "It is twenty.", "21", "What is 13 + 8? Answer with just the number.", False),
        ("nl_sum", "It is 1,200.", "1200", "What is 700 + 500? Answer with just the number.", True),
        # another candidate before the reference: wrong; operands of the question are no distractors
        ("nl_sum", "It is 13, no, 12.", "12", SUM, False),
        ("nl_sum", "12, not 13.", "12", SUM, True),
        ("nl_capital", "The capital of France is Berlin, or Paris.", "Paris", CAPITAL, False),
        ("nl_opposite", "The opposite of cold is hot, and of hot is cold.", "cold", OPPOSITE, True),
        # multi-word references: the whole sequence, and a partial one is not enough
        ("nl_capital", "The capital of India is New Delhi.", "New Delhi", "What is the capital of India?", True),
        ("nl_capital", "The capital of India is Delhi.", "New Delhi", "What is the capital of India?", False),
        (
            "nl_continent",
            "Brazil is in the Americas, in South America.",
            "South America",
            "Which continent is Brazil part of?",
            True,
        ),
        ("nl_continent", "Brazil is in North America.", "South America", "Which continent is Brazil part of?", False),
        # a continent's adjective names it (and nothing longer does)
        (
            "nl_continent",
            "Algeria is part of the African continent.",
            "Africa",
            "Which continent is Algeria part of?",
            True,
        ),
        (
            "nl_continent",
            "It is part of the Eurasian continent.",
            "Asia",
            "Which continent is Uzbekistan part of?",
            False,
        ),
        ("nl_continent", "It is European, or Asian.", "Asia", "Which continent is Turkey part of?", False),
        # accents dropped; no stemming; a possessive is another word
        ("nl_capital", "The capital of Colombia is Bogotá.", "Bogota", "What is the capital of Colombia?", True),
        ("nl_currency", "It uses US dollars.", "dollar", "What is the currency of the United States?", False),
        ("nl_plural", "A kitten's mother.", "kitten", "What is a baby cat called?", False),
        # the rule's known leniency: a wrong answer outside the kind's vocabulary does not disqualify
        ("nl_capital", "It is Sydney, not Canberra.", "Canberra", "What is the capital of Australia?", True),
    ],
)
def test_the_rule_on_hand_written_answers(kind, answer, reference, prompt, ok):
    assert is_correct(kind, answer, reference, prompt) is ok


def test_first_sentence_and_words():
    assert first_sentence("  7 + 5 = 12\n\nMore.") == "7 + 5 = 12"
    assert first_sentence("It is 12.5 metres. Then") == "It is 12.5 metres"
    assert first_sentence("Yes! No.") == "Yes"
    assert first_sentence("no end") == "no end"
    assert words("It's 1,200 (h2o) Bogotá-twenty") == ["it's", "1,200", "h2o", "bogota", "twenty"]
    assert [number_words(n) for n in (0, 7, 13, 20, 21, 99)] == [
        "zero",
        "seven",
        "thirteen",
        "twenty",
        "twenty one",
        "ninety nine",
    ]
    with pytest.raises(ValueError):
        number_words(100)


def test_gives_away():
    assert gives_away("nl_capital", "Paris", "Is Paris the capital of France?")
    assert not gives_away("nl_capital", "Paris", CAPITAL)
    assert gives_away("nl_sum", "12", "What is 12 + 0?")
    assert gives_away("nl_sum", "12", "What is twelve plus zero?")
    assert not gives_away("nl_sum", "12", "What is 120 - 108?")
    assert not gives_away("nl_capital", "New Delhi", "Is New York in Delhi?")  # each word, not the sequence
