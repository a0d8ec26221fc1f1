import pytest

from ars_opd.data import synthetic


def test_generation_is_deterministic_and_seed_dependent():
    a = synthetic.generate(300, seed=7)
    assert a == synthetic.generate(300, seed=7)
    assert a != synthetic.generate(300, seed=8)
    # a prefix of a longer run equals the shorter run: size does not reshuffle
    assert synthetic.generate(100, seed=7) == a[:100]


def test_every_answer_is_correct_by_an_independent_computation():
    spec = synthetic.TaskSpec(max_operand=99, min_len=3, max_len=8)
    rows = synthetic.generate(3000, seed=1, tasks=synthetic.TASK_NAMES, spec=spec)
    seen = set()
    for r in rows:
        t, inp, out = r["task"], r["input"], r["output"]
        seen.add(t)
        if t == "add":
            a, b = inp.split(" + ")
            assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99
            assert int(out) == int(a) + int(b)
        elif t == "reverse":
            assert out == "".join(reversed(inp)) and inp.isalpha() and inp.islower()
        elif t == "sort_digits":
            assert inp.isdigit() and list(out) == sorted(inp)
        elif t == "count_letter":
            letter = r["instruction"].split("letter ")[1][0]
            assert int(out) == sum(1 for c in inp if c == letter)
        elif t == "length":
            assert int(out) == len(inp) and inp.isalpha()
        elif t == "uppercase":
            assert out == inp.upper() and inp.islower()
        if t in synthetic.LONG_HORIZON_TASKS:
            continue  # checked step by step below
        if t != "add":
            assert 3 <= len(inp) <= 9  # count_letter may append one letter to avoid a reserved word
        assert synthetic.expected_answer(t, r["instruction"], inp) == out
    assert seen == set(synthetic.TASK_NAMES)


def test_default_mix_leaves_out_count_letter():
    assert {r["task"] for r in synthetic.generate(500, seed=0)} == set(synthetic.DEFAULT_TASKS)
    assert "count_letter" not in synthetic.DEFAULT_TASKS and "count_letter" in synthetic.TASK_NAMES


def test_task_subset_and_unknown_task():
    rows = synthetic.generate(50, seed=0, tasks=("reverse",))
    assert {r["task"] for r in rows} == {"reverse"}
    with pytest.raises(ValueError, match="divide"):
        synthetic.generate(5, seed=0, tasks=("divide",))


def test_letter_payloads_never_equal_instruction_words():
    words = {w.lower() for w in synthetic.instruction_words()}
    rows = synthetic.generate(5000, seed=3, tasks=synthetic.TASK_NAMES, spec=synthetic.TaskSpec(min_len=3, max_len=4))
    assert not any(r["input"] in words for r in rows if r["task"] != "add")


def test_exact_match_strips_whitespace_only():
    assert synthetic.is_correct(" 95\n", "95")
    assert not synthetic.is_correct("095", "95")


def test_config_names_exactly_the_tasks_the_registry_generates_and_checks():
    from ars_opd import config

    assert tuple(synthetic.INSTRUCTIONS) == config.TASK_NAMES
    assert set(config.DEFAULT_TASKS) <= set(config.TASK_NAMES)
    for task in config.TASK_NAMES:
        row = synthetic.generate(1, seed=0, tasks=(task,))[0]
        assert row["task"] == task
        assert synthetic.expected_answer(task, row["instruction"], row["input"]) == row["output"]


def _long_rows(n=2000, seed=5):
    return synthetic.generate(n, seed=seed, tasks=synthetic.LONG_HORIZON_TASKS)


def test_long_horizon_answers_are_right_by_an_independent_computation_and_20_to_60_characters():
    for r in _long_rows():
        out, steps = r["output"], r["output"].split(", ")
        assert 20 <= len(out) <= 60
        if r["task"] == "running_sum":
            terms = [int(x) for x in r["input"].split(" + ")]
            assert 5 <= len(terms) <= 7 and all(1 <= x <= 9 for x in terms)
            assert len(steps) == len(terms) - 1
            for i, step in enumerate(steps):  # "a+b=c" with a the sum of the first i+1 terms, b the next term
                a, rest = step.split("+")
                b, c = rest.split("=")
                assert (int(a), int(b), int(c)) == (sum(terms[: i + 1]), terms[i + 1], sum(terms[: i + 2]))
            assert synthetic.final_answer("running_sum", out) == str(sum(terms))
        else:
            n = int(r["instruction"].split()[3])
            assert r["instruction"] == f"Shift the letters {n} times." and 4 <= n <= 7 and len(steps) == n
            for i, step in enumerate(steps):  # letter j moved i+1 places along the alphabet, z wrapping to a
                assert step == "".join(chr((ord(c) - 97 + i + 1) % 26 + 97) for c in r["input"])
            assert synthetic.final_answer("shift_steps", out) == steps[-1]
        assert synthetic.expected_answer(r["task"], r["instruction"], r["input"]) == out


def test_long_horizon_checker_accepts_the_reference_and_rejects_every_single_token_corruption():
    """Every character of an answer here is one token of the built-in tokenizer (checked); changing any one
    character of any step to any other character of its kind marks that step wrong and sets the first error
    at or before it; a corrupted final step also fails exact match."""
    from ars_opd.models.tokenizer import build_char_word_tokenizer

    tok = build_char_word_tokenizer(synthetic.instruction_words())
    for r in _long_rows(200, seed=9):
        ref = r["output"]
        assert len(tok(ref, add_special_tokens=False)["input_ids"]) == len(ref)
        ok = synthetic.check_steps(ref, ref)
        assert all(ok.correct) and ok.first_error is None and ok.step_accuracy == 1.0
        assert synthetic.is_correct_for(r["task"], ref, ref)
        starts, pos = [], 0
        for step in ref.split(", "):
            starts.append(pos)
            pos += len(step) + 2
        for i, ch in enumerate(ref):
            if ch in ", ":
                continue
            step = max(j for j, s in enumerate(starts) if s <= i)
            alphabet = synthetic.DIGITS + "+=" if r["task"] == "running_sum" else synthetic.LETTERS
            for other in alphabet.replace(ch, ""):
                bad = ref[:i] + other + ref[i + 1 :]
                c = synthetic.check_steps(bad, ref)
                assert not c.correct[step] and c.first_error is not None and c.first_error <= step
                final_start = ref.rindex("=") + 1 if r["task"] == "running_sum" else starts[-1]
                if i >= final_start:  # a character of the final answer
                    assert not synthetic.is_correct_for(r["task"], bad, ref)


def test_step_check_counts_missing_and_extra_steps():
    ref = "7+5=12, 12+9=21, 21+3=24"
    assert synthetic.check_steps("7+5=12, 12+9=21", ref).correct == (True, True, False)
    assert synthetic.check_steps("7+5=12, 12+9=21", ref).first_error == 2
    extra = synthetic.check_steps(ref + ", 24+1=25", ref)
    assert all(extra.correct) and extra.first_error == 3 and extra.extra_steps == 1
    assert synthetic.check_steps("", ref).first_error == 0
    # exact match counts the final answer: right final sum after a wrong intermediate is right, a wrong one not
    assert synthetic.is_correct_for("running_sum", "7+5=13, 13+9=21, 21+3=24", ref)
    assert not synthetic.is_correct_for("running_sum", "7+5=12, 12+9=21, 21+3=25", ref)
    assert not synthetic.is_correct_for("running_sum", "7+5=12, 12+9=21", ref)
    assert synthetic.is_correct_for("add", " 95\n", "95") and not synthetic.is_correct_for("add", "095", "95")


def test_the_tokenizer_is_the_same_whatever_tasks_are_mixed():
    # whole words come from the short tasks' instructions only: adding the long-horizon family changes no id
    assert "Shift" not in synthetic.instruction_words() and "times" not in synthetic.instruction_words()
    assert set(synthetic.WORD_TASKS) | set(synthetic.LONG_HORIZON_TASKS) == set(synthetic.TASK_NAMES)
