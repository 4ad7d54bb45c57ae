"""Verifiers on tricky completions, user verifiers by module:function, and error reporting."""

import math

import pytest

from posttrain.rewards import (
    VERIFIERS,
    VerifierError,
    extract_answer,
    format_reward,
    list_match,
    load_verifier,
    load_verifiers,
    number_match,
    score,
)


def _row(answer: str, task: str = "arithmetic", **extra) -> dict:
    return {"prompt": "p", "answer": answer, "task": task, **extra}


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ("564", "#### 564", 1.0),
        ("564", "47 * 12 = 564", 1.0),
        ("564", "First I got 565, then fixed it: 564", 1.0),  # unmarked: last number
        ("564", "47 * 12 = 564, not 565", 0.0),
        ("564", "The answer is 564. Check: 47 * 12 = 564 since 12 * 47 = 564.", 1.0),
        ("564", "#### 564 (that is 47*12)", 1.0),  # marked: first number after the marker
        ("564", "Answer: 564!", 1.0),
        ("564", "so the result is $\\boxed{564}$ and not 12", 1.0),
        ("564", "\\boxed{\\text{564}}", 1.0),  # nested braces
        ("564", "564\n#### 565", 0.0),  # a marker beats a later-looking bare number
        ("564", "#### 565\nWait, the answer is 564", 1.0),  # the latest marker wins
        ("564", "564.0", 1.0),
        ("564", "#### 564.5", 0.0),
        ("564", "#### 5640", 0.0),
        ("564", "The answer is unknown.\nMaybe 564", 0.0),  # a marked answer without a number
        ("-35", "47 - 82 = -35", 1.0),
        ("-35", "#### \u221235", 1.0),  # unicode minus
        ("-35", "#### 35", 0.0),
        ("35", "82-47 = 35", 1.0),
        ("47", "82-47", 1.0),  # a hyphen after a digit is not a sign
        ("1234", "The answer is 1,234.", 1.0),
        ("1234", "#### 1,234", 1.0),
        ("-1234567", "#### -1,234,567", 1.0),
        ("12", "#### 12.00", 1.0),
        ("564", "", 0.0),
        ("564", "I don't know", 0.0),
        ("564", "####", 0.0),
        ("564", "\\boxed{", 0.0),
    ],
)
def test_number_match(answer, completion, expected):
    assert number_match(completion, _row(answer)) == expected


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ("3, 12, 47", "#### 3, 12, 47", 1.0),
        ("3, 12, 47", "#### [3, 12, 47]", 1.0),
        ("3, 12, 47", "#### 3,12,47", 1.0),
        ("3, 12, 47", "####   3  12 47 ", 1.0),
        ("3, 12, 47", "[3,12,47]", 1.0),
        ("3, 12, 47", "Sorted: 3, 12, 47.", 1.0),
        ("3, 12, 47", "The answer is (3, 12, 47), done", 1.0),
        ("3, 12, 47", "\\boxed{[3, 12, 47]}", 1.0),
        ("[3, 12, 47]", "#### 3, 12, 47", 1.0),  # a bracketed reference
        ("3, 12, 47", "#### 47, 12, 3", 0.0),  # order matters
        ("3, 12, 47", "#### 3, 12", 0.0),
        ("3, 12, 47", "#### 3, 12, 47, 50", 0.0),
        ("3, 12, 47", "#### 3, 12.5, 47", 0.0),
        ("3, 12, 47", "3, 12, 47\n#### 3, 47, 12", 0.0),
        ("3, 12, 47", "", 0.0),
        ("3, 12, 47", "####", 0.0),
        ("-1, 0, 2", "#### -1, 0, 2", 1.0),
    ],
)
def test_list_match(answer, completion, expected):
    assert list_match(completion, _row(answer, task="sort")) == expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("#### 564", 1.0),
        ("  work...\n#### -35.\n\n", 1.0),
        ("#### 3, 12, 47", 1.0),
        ("#### [3, 12, 47]", 1.0),
        ("The answer is 564", 0.0),
        ("\\boxed{564}", 0.0),
        ("#### 564\nand some trailing text", 0.0),
        ("#### banana", 0.0),
        ("####", 0.0),
        ("", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion, _row("564")) == expected


def test_extract_answer_styles():
    assert extract_answer("x\n#### 7 \n") == "7"
    assert extract_answer("The final answer is: 8.") == "8."
    assert extract_answer("\\boxed{a{b}c} then \\boxed{9}") == "9"
    assert extract_answer("no marker 5") is None


def test_bad_reference_answer_raises():
    with pytest.raises(ValueError, match="not a number"):
        number_match("#### 5", _row("five"))
    with pytest.raises(ValueError, match="not a list of integers"):
        list_match("#### 5", _row("a, b", task="sort"))


def test_builtin_verifiers_by_name():
    assert load_verifier("format") is format_reward
    assert load_verifier("arithmetic") is number_match and load_verifier("sort") is list_match
    task = load_verifier("task")
    assert task("#### 3, 12", _row("3, 12", task="reverse")) == 1.0
    assert task("#### 15", _row("15")) == 1.0
    assert set(load_verifiers(["task", "format"])) == {"task", "format"}
    with pytest.raises(ValueError, match="duplicate"):
        load_verifiers(["task", "task"])
    with pytest.raises(ValueError, match="neither a built-in"):
        load_verifier("exact")


def test_user_verifier_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_penalty(completion, example):\n"
        "    return -len(completion) / 100\n"
        "THRESHOLD = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_verifier("my_rewards:length_penalty")
    rows = score(["#### 564", "#### 1"], [_row("564"), _row("564")], {"task": VERIFIERS["task"], "my": fn})
    assert rows == [{"task": 1.0, "my": -0.08}, {"task": 0.0, "my": -0.06}]
    with pytest.raises(ImportError, match="has no attribute 'missing'"):
        load_verifier("my_rewards:missing")
    with pytest.raises(TypeError, match="not callable"):
        load_verifier("my_rewards:THRESHOLD")
    with pytest.raises(ImportError, match="cannot import module 'no_such_rewards_module'"):
        load_verifier("no_such_rewards_module:fn")


def _fails_on_seven(completion, example):
    return 1 / (int(completion) - 7)


def test_raising_verifier_reported_with_index():
    completions = ["5", "6", "7", "8"]
    examples = [_row(c, id=f"ex{i}") for i, c in enumerate(completions)]
    with pytest.raises(VerifierError, match=r"'mine' failed on prompt index 2 \(id 'ex2'.*ZeroDivisionError") as info:
        score(completions, examples, {"format": format_reward, "mine": _fails_on_seven})
    assert info.value.index == 2 and info.value.verifier == "mine"
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_non_finite_and_unknown_task_and_length_mismatch():
    with pytest.raises(VerifierError, match="prompt index 0.*not a finite number"):
        score(["x"], [_row("1")], {"nan": lambda c, e: math.nan})
    with pytest.raises(VerifierError, match="prompt index 1.*no built-in verifier for task 'poetry'"):
        score(["#### 1", "#### 1"], [_row("1"), _row("1", task="poetry")], load_verifiers(["task"]))
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        score(["a", "b"], [_row("1")], {"format": format_reward})
