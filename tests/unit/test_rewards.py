"""Rewards with the (prompt, completion, answer, **fields) signature: the GSM8K and MATH answer parsers, math-verify
equivalence, exact match, and a user's ``module:function`` reward that reads a row's fields."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rlfabric.services.env.tasks.answers import after_hashes, gsm8k_answer, last_boxed, last_number, to_number
from rlfabric.services.env.tasks.rewards import (
    REWARDS,
    call_reward,
    exact_match,
    format_match,
    gsm8k,
    signed_match,
)


@pytest.mark.parametrize("text, expected", [
    ("She pays 600 + 634 = 1,234 dollars.\n#### 1,234", "1234"),
    ("#### $18", "18"),
    ("#### -3.5 apples", "-3.5"),
    ("so 12 eggs, then 7 more: 19", "19"),  # no "####": the last number
    ("in 2023 there were 1,000,000 of them.", "1000000"),
    ("no number here", None),
])
def test_gsm8k_answers(text, expected):
    assert gsm8k_answer(text) == expected


def test_hashes_and_numbers_parse_as_written():
    assert after_hashes("work\n####  72 ") == "72" and after_hashes("72") is None
    assert last_number("1, 2 and 3,456.5") == "3456.5"
    assert to_number("18.00") == to_number("18") == 18 and to_number("1,234") == 1234
    assert to_number("abc") is None and to_number(None) is None and to_number("9" * 100) is None


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),  # the last one counts, braces nest
    (r"\boxed {x^{2}}", "x^{2}"),
    (r"\fbox{7}", "7"),
    (r"the set \boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are content
    (r"\boxed{3} and an unclosed \boxed{4", "3"),  # an unbalanced last one: the one before it
    ("no box", None),
])
def test_last_boxed_reads_balanced_braces(text, expected):
    assert last_boxed(text) == expected


def test_gsm8k_reward_compares_numbers():
    ref = "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert gsm8k("q", "She sold 72 clips in total.", ref) == 1.0
    assert gsm8k("q", "#### 72.0", ref) == 1.0
    assert gsm8k("q", "#### 7,200", "#### 7200") == 1.0
    assert gsm8k("q", "72 clips, no wait, 71", ref) == 0.0
    assert gsm8k("q", "I do not know", ref) == 0.0


@pytest.mark.parametrize("completion, reference, expected", [
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{1/2}", r"$\boxed{\frac{1}{2}}$", 1.0),  # a MATH solution: its own last \boxed is the reference
    (r"\boxed{\dfrac{2}{4}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1+x}", "x+1", 1.0),
    (r"\boxed{\frac{1}{3}}", r"\frac{1}{2}", 0.0),
    ("0.5", r"\frac{1}{2}", 0.0),  # no \boxed{}: nothing to parse
    (r"\boxed{}", r"\frac{1}{2}", 0.0),
])
def test_math_reward_compares_by_value(completion, reference, expected):
    reward = REWARDS.load("math")
    assert reward("prompt", completion, reference) == expected


def test_exact_match_takes_integers_as_integers_and_other_answers_as_stripped_strings():
    assert exact_match("Q: 1+2= A:", " 3 ", "3") == 1.0
    assert exact_match("Q", "03", "3") == 1.0  # the same integer
    assert exact_match("Q", "3.0", "3") == 0.0  # not an integer answer
    assert exact_match("Q", " Paris\n", "Paris") == 1.0 and exact_match("Q", "paris", "Paris") == 0.0
    assert format_match("Q", "4", "3") == 0.1 and format_match("Q", "four", "3") == 0.0
    assert signed_match("Q", "4", "3") == -1.0 and signed_match("Q", "3", "3") == 1.0


def test_a_users_module_function_reward_gets_the_fields_it_names(tmp_path, monkeypatch):
    (tmp_path / "rlf_user_reward.py").write_text(textwrap.dedent("""
        def by_level(prompt, completion, answer, level, **fields):
            return float(completion.strip() == answer) * level + len(fields)

        def three_args(prompt, completion, answer):
            return 0.25

        def only_source(prompt, completion, answer, *, source):
            return 1.0 if source == "gsm8k" else 0.0
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(REWARDS, "_loaded", {})
    fields = {"level": 3, "source": "gsm8k", "id": 7}
    assert call_reward(REWARDS.load("rlf_user_reward:by_level"), "p", "42", "42", fields) == 5.0  # 3 + 2 others
    assert call_reward(REWARDS.load("rlf_user_reward:three_args"), "p", "x", "y", fields) == 0.25
    assert call_reward(REWARDS.load("rlf_user_reward:only_source"), "p", "x", "y", fields) == 1.0
    with pytest.raises(ValueError, match="finite"):
        call_reward(lambda p, c, a: float("nan"), "p", "c", "a", {})
    with pytest.raises(TypeError, match="a number"):
        call_reward(lambda p, c, a: "1.0", "p", "c", "a", {})
    del sys.modules["rlf_user_reward"]
