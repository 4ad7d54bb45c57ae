"""The `math` verifier (math-verify on the final answer) both ways, and GSM8K's `#### N` references read by it
and by `number`; the built-in `task` verifier keeps its results."""

from __future__ import annotations

import pytest

from posttrain.rewards import VERIFIERS, load_verifier, math_match, number_match, reference_answer, task_verifier

pytest.importorskip("math_verify")


def _row(answer: str) -> dict:
    return {"prompt": "p", "answer": answer, "task": ""}


GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        # the cases: a fraction equals its decimal, a multiple of pi is not an integer
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{3\\pi}", "3", 0.0),
        ("\\boxed{3}", "3\\pi", 0.0),
        ("\\boxed{3\\pi}", "3\\pi", 1.0),
        # GSM8K: a worked solution's '#### N' line is the reference, thousands separators dropped
        ("She has #### 1,234", "The total is 1,000 + 234 = 1,234.\n#### 1,234", 1.0),
        ("The answer is 1234.", "#### 1,234", 1.0),
        ("#### 1,243", "#### 1,234", 0.0),
        ("48 + 24 = 72 clips\n#### 72", GSM8K_ANSWER, 1.0),
        ("48 + 24 = 72 clips, so 73", GSM8K_ANSWER, 0.0),  # unmarked: the last number
        ("#### 71", GSM8K_ANSWER, 0.0),
        # sets in any order, LaTeX forms, the latest marker, unicode minus
        ("\\boxed{\\{3, 1, 2\\}}", "\\{1, 2, 3\\}", 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2, 3\\}", 0.0),
        ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}", 1.0),
        ("first \\boxed{5}, then on reflection \\boxed{7}", "7", 1.0),
        ("first \\boxed{5}, then on reflection \\boxed{7}", "5", 0.0),
        ("#### \u22125", "-5", 1.0),
        ("no answer here", "5", 0.0),
        ("", "5", 0.0),
    ],
)
def test_math_verifier(completion, reference, expected):
    assert math_match(completion, _row(reference)) == expected
    assert load_verifier("math") is math_match and VERIFIERS["math"] is math_match


def test_gsm8k_references_for_number_and_an_unparsable_reference():
    assert reference_answer(_row(GSM8K_ANSWER)) == "72"
    assert reference_answer(_row("#### 1,234")) == "1234"
    assert number_match("#### 72", _row(GSM8K_ANSWER)) == 1.0  # 'number' said "not a number" before
    assert number_match("#### 1,234", _row("work...\n#### 1,234")) == 1.0
    with pytest.raises(ValueError, match="not an expression math-verify parses"):
        math_match("\\boxed{1}", _row(" "))
    with pytest.raises(ValueError, match="nothing after it"):
        reference_answer(_row("####"))


def test_task_verifier_is_unchanged_for_the_built_in_tasks():
    # built-in answers carry no '####': number and list read them as before
    assert task_verifier("#### 564", {"answer": "564", "task": "arithmetic"}) == 1.0
    assert task_verifier("#### 3, 12", {"answer": "3, 12", "task": "sort"}) == 1.0
    with pytest.raises(ValueError, match="no built-in verifier for task ''.*math"):
        task_verifier("#### 72", _row(GSM8K_ANSWER))
