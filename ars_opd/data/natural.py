"""Natural-language prompts for a real chat teacher, some with a checkable one-word answer.

The synthetic character-level tasks are for the tiny built-in models; a real chat model cannot do them
(SmolLM2-135M-Instruct answered 0 of 60). This module writes prompts such a model can answer, in the
``prompt`` / ``response`` row format that the subset stage reads like any local file
(``ars_opd.data.normalise``): ``task`` names the kind, ``response`` is the reference answer of a checkable
kind and null for an open one. The teacher writes every completion either way; the reference travels to
``subset``'s rows as ``reference`` and is used by the evaluate stage only.

Regenerate the committed file (a test checks that it equals this module's output)::

    python -m ars_opd.data.natural --out inputs/natural_prompts.jsonl

Kinds (every name starts with ``nl_``, so none can be a synthetic task's):

- checkable, each fact asked once (``ars_opd.data.natural_words`` holds the tables): ``nl_capital``,
  ``nl_continent``, ``nl_language``, ``nl_currency``, ``nl_opposite``, ``nl_plural``, ``nl_past_tense``,
  ``nl_chemical_symbol``, and the numeric ``nl_sum`` (``a + b``, 1..20 each) and ``nl_difference``
  (``a - b``, 3..20, a positive result that is neither operand); scored by ``ars_opd.data.natural_check``'s
  lenient exact match (the reference as whole words in the answer's first sentence, no other candidate
  before it), and no prompt contains its own reference (checked here for every row);
- open, no reference: ``nl_explain``, ``nl_poem``, ``nl_tips``, ``nl_describe``, ``nl_list_three``,
  ``nl_define``, ``nl_story``, ``nl_compare``, ``nl_how_to``, ``nl_advice``.

About three rows in four are checkable, so that a held-out split of 300 drawn at random holds well over 200
of them. Generation is seeded (``random.Random(seed)`` samples the arithmetic pairs) and depends on no dict or
set order; the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ars_opd.data.natural_check import gives_away
from ars_opd.data.natural_words import CHECKABLE_KINDS, TABLES

SEED = 0
DEFAULT_OUT = "inputs/natural_prompts.jsonl"
N_SUM, N_DIFFERENCE = 100, 60

QUESTIONS = {
    "nl_capital": "What is the capital of {}?",
    "nl_continent": "Which continent is {} part of?",
    "nl_language": "What language is spoken in {}?",
    "nl_currency": "What is the currency of {}?",
    "nl_opposite": "What is the opposite of {}?",
    "nl_plural": "What is the plural of {}?",
    "nl_past_tense": 'What is the past tense of the verb "{}"?',
    "nl_chemical_symbol": "What is the chemical symbol for {}?",
    "nl_sum": "What is {} + {}? Answer with just the number.",
    "nl_difference": "What is {} - {}? Answer with just the number.",
}


def _topics(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(";") if t.strip())


OPEN = {
    "nl_explain": (
        "Explain {} in simple terms.",
        _topics("""
        how rainbows form; why the sky is blue; how a plane flies; what gravity is; how vaccines work;
        why leaves change colour in autumn; how the internet works; what photosynthesis is; why we have seasons;
        how a refrigerator keeps food cold; what inflation is; how bees make honey; why the sea is salty;
        how a battery stores energy; what a black hole is; how the heart pumps blood; why we need sleep;
        how tides work; what climate change is; how a compass works; how volcanoes erupt; what DNA is;
        how recycling helps the environment; why ice floats on water; what an atom is; how clouds form"""),
    ),
    "nl_poem": (
        "Write a short poem about {}.",
        _topics("""
        the sea; autumn leaves; a rainy day; the moon; a lost cat; morning coffee; the first snow;
        a mountain at dawn; friendship; an old tree; the city at night; a summer garden; a river; the stars;
        a lighthouse; the wind; a sleeping dog; the desert; spring flowers; a quiet library; a thunderstorm;
        a candle; a long train journey; a butterfly; a bowl of soup; a kite"""),
    ),
    "nl_tips": (
        "Give three tips for {}.",
        _topics("""
        staying focused while studying; sleeping better; saving money; learning a new language;
        staying healthy in winter; writing a good essay; making new friends; keeping a plant alive;
        running a first 5k; cooking on a budget; reducing stress; public speaking; keeping a tidy home;
        travelling with little luggage; starting a vegetable garden; drinking more water; taking better photos;
        managing time at work; preparing for a job interview; reading more books; staying safe while hiking;
        caring for a new puppy; saving energy at home; learning to play the guitar; waking up early;
        staying motivated to exercise"""),
    ),
    "nl_describe": (
        "Describe {} in a few sentences.",
        _topics("""
        a busy market; a quiet beach at sunset; an ideal weekend; a forest after rain; a classroom;
        a train station; a snowy village; a lively kitchen; a farm in spring; a city park; an old castle;
        a football match; a library; a coral reef; a hot air balloon ride; a mountain lake;
        a night sky in the desert; a small bakery; a crowded airport; a fishing village; a museum; a zoo;
        a rainforest; a birthday party; a bus ride through a city; a street after a storm"""),
    ),
    "nl_list_three": (
        "List three {}.",
        _topics("""
        fruits that are red; animals that live in the ocean; musical instruments; planets in the solar system;
        things you can recycle; sports played with a ball; vegetables that grow underground;
        birds that cannot fly; famous painters; kitchen tools; things to pack for a beach trip;
        ways to save water; hobbies you can do at home; board games; types of clouds; healthy breakfast foods;
        jobs in a hospital; animals that hibernate; things that are cold; flowers that bloom in spring;
        renewable energy sources; insects; reasons to read books; types of trees; things found in a school bag;
        colours of the rainbow"""),
    ),
    "nl_define": (
        'Define the word "{}".',
        _topics("""
        nostalgia; resilience; curiosity; empathy; serendipity; ambition; metaphor; democracy; ecosystem;
        habit; courage; patience; gratitude; innovation; tradition; humility; generosity; integrity; optimism;
        solitude; diligence; harmony; wisdom; freedom; kindness; honesty"""),
    ),
    "nl_story": (
        "Write a two-sentence story about {}.",
        _topics("""
        a dragon who is afraid of the dark; a robot learning to cook; a lost key; a talking cat;
        a girl who finds a map; a village without rain; a clock that runs backwards;
        an astronaut's first day on Mars; a boy and his kite; a shy ghost; a magic umbrella;
        a fisherman's lucky day; a forgotten birthday; a tiny giant; a letter from the future;
        a painter who loses her colours; a dog that saves the day; a secret garden; a broken violin;
        a midnight train; a snowman in summer; a king with no crown; a lost penguin; a bakery at dawn;
        a message in a bottle; a race between a snail and a turtle"""),
    ),
    "nl_compare": (
        "What is the difference between {}?",
        _topics("""
        weather and climate; a virus and a bacterium; a lake and a sea; a frog and a toad;
        a crocodile and an alligator; a dolphin and a shark; a city and a town; a hill and a mountain;
        a poem and a song; a tortoise and a turtle; a fruit and a vegetable; speed and velocity;
        a simile and a metaphor; a rabbit and a hare; a butterfly and a moth; a comet and an asteroid;
        a star and a planet; a republic and a monarchy; a noun and a verb; a violin and a cello;
        a bee and a wasp; coffee and tea; a laptop and a tablet; a bicycle and a motorcycle;
        a river and a stream; a cold and the flu"""),
    ),
    "nl_how_to": (
        "How do you {}?",
        _topics("""
        make a cup of tea; tie a shoelace; plant a tree; boil an egg; change a flat tyre;
        write a thank-you note; make a paper airplane; wash a wool sweater;
        start a conversation with a stranger; care for a houseplant; make pancakes; fold a shirt;
        set up a tent; learn to swim; make a budget; clean a window without streaks; bake bread;
        ride a bicycle; wrap a present; brew coffee with a French press; sharpen a pencil; build a birdhouse;
        make a snowman; iron a shirt; pack a suitcase; make lemonade"""),
    ),
    "nl_advice": (
        "What should I do if {}?",
        _topics("""
        I feel nervous before an exam; my houseplant is wilting; I cannot fall asleep; I lose my phone;
        my friend is upset with me; I get lost in a new city; I spill coffee on my laptop; I feel bored at home;
        my bike has a flat tyre; I forget someone's name; I miss my bus; it starts raining on a hike;
        I burn my finger while cooking; my dog will not stop barking; I have too much homework; I feel homesick;
        I see a bee indoors; my bread will not rise; I get a bad grade; I want to learn to draw;
        my computer is slow; I cannot decide what to cook; I feel lonely; I wake up late; I find a lost wallet;
        I have a sore throat"""),
    ),
}
OPEN_KINDS = tuple(OPEN)
KINDS = (*CHECKABLE_KINDS, *OPEN_KINDS)


def _arithmetic(rng: random.Random) -> list[tuple[str, str, str]]:
    """(kind, prompt, reference) for the sampled sums and differences."""
    sums = [(a, b) for a in range(1, 21) for b in range(1, 21)]
    diffs = [(a, b) for a in range(3, 21) for b in range(1, a) if a != 2 * b]
    return [("nl_sum", QUESTIONS["nl_sum"].format(a, b), str(a + b)) for a, b in rng.sample(sums, N_SUM)] + [
        ("nl_difference", QUESTIONS["nl_difference"].format(a, b), str(a - b))
        for a, b in rng.sample(diffs, N_DIFFERENCE)
    ]


def generate(seed: int = SEED) -> list[dict]:
    """Every row, ``{"task", "prompt", "response"}``, kind by kind (the subset stage shuffles)."""
    rng = random.Random(seed)
    checkable = [(kind, QUESTIONS[kind].format(q), a) for kind, table in TABLES.items() for q, a in table]
    checkable += _arithmetic(rng)
    rows = [{"task": kind, "prompt": prompt, "response": ref} for kind, prompt, ref in checkable]
    rows += [{"task": kind, "prompt": t.format(x), "response": None} for kind, (t, xs) in OPEN.items() for x in xs]
    for r in rows:
        if r["response"] is not None and gives_away(r["task"], r["response"], r["prompt"]):
            raise AssertionError(f"{r['task']} prompt contains its own answer: {r['prompt']!r} -> {r['response']!r}")
    prompts = [r["prompt"] for r in rows]
    if len(set(prompts)) != len(prompts):
        raise AssertionError("a prompt occurs twice")
    return rows


def render(rows: list[dict]) -> str:
    """The rows as JSON Lines (what the committed file holds, byte for byte)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"where to write the JSON Lines (default {DEFAULT_OUT})")
    ap.add_argument("--seed", type=int, default=SEED)
    args = ap.parse_args(argv)
    rows = generate(args.seed)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render(rows), encoding="utf-8")
    tmp.replace(out)
    n_checkable = sum(r["response"] is not None for r in rows)
    print(json.dumps({"out": str(out), "rows": len(rows), "checkable": n_checkable, "kinds": len(KINDS)}))


if __name__ == "__main__":
    main()
