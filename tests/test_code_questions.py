"""Coding questions with checkable answers (data.code_questions)."""

from mlx_kvlingo.data.code_questions import KINDS, answered, code_questions, printed, stated


def test_questions_cycle_the_kinds_and_carry_what_their_program_prints():
    qs = code_questions(24, seed=5)
    assert [q.kind for q in qs[:len(KINDS)]] == list(KINDS)
    for q in qs:
        assert q.answer == printed(q.code) and q.answer
        assert q.code in q.prompt and "print" in q.code
    assert [q.code for q in code_questions(24, seed=5)] == [q.code for q in qs]
    assert [q.code for q in code_questions(24, seed=6)] != [q.code for q in qs]


def test_an_answer_counts_on_its_first_line_without_fences_or_quotes():
    assert answered("```\n[1, 2]\n```", "[1, 2]")
    assert answered("'falcon'\nbecause the string has no spaces", "falcon")
    assert answered("Output: 42", "42")
    assert not answered("The program prints 42.", "42")
    assert not answered("", "42")
    assert not answered("421", "42")


def test_a_chat_reply_states_the_output_in_a_sentence_or_a_block():
    assert stated("The output of `f()` is `'ember'`.", "ember")
    assert stated("The printed output is:\n\n```\n[0, 2, 4]\n```", "[0, 2, 4]")
    assert stated("It prints 42.", "42")
    assert stated("[1, 2]", "[1, 2]")  # what answered() accepts
    assert not stated("The output of `f()` is `'lantern'`.", "ember")
    assert not stated("It prints 421.", "42")
    assert not stated("It prints 42 and then 7.", "42")
    assert not stated("", "42")
