"""Rule-based verifiers: score a completion against a reference answer, no model needed.

A verifier is any callable ``fn(completion: str, example: dict) -> float``. ``example`` holds at
least ``prompt``, ``answer`` (the canonical reference answer as text) and ``task``; rows of the
built-in tasks also carry ``id``. Built-in verifiers return 1.0 or 0.0. Users plug their own in
the config as ``module:function`` (see `load_verifier`).

Answer extraction, shared by the built-ins: the *marked* answer is the latest of
``#### X``, ``\\boxed{X}``, ``The answer is X`` / ``Answer: X`` in the text; the first number
(or list) inside it counts. Without a marker, the last number (or list) in the text counts.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

Verifier = Callable[[str, Mapping[str, Any]], float]

FINAL_ANSWER_MARKER = "####"

# A sign counts only when it does not follow a word character or a dot: "10-5" holds 10 and 5.
_SIGN = r"(?<![\w.])[-\u2212]?"
_NUMBER = re.compile(_SIGN + r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d|\.\d)")
_INT = _SIGN + r"\d+(?!\d|\.\d)"
_INT_RUN = re.compile(rf"{_INT}(?:[ \t]*,[ \t]*{_INT}|[ \t]+{_INT})*")
_MARKED = re.compile(
    rf"{FINAL_ANSWER_MARKER}[ \t]*([^\n]*)|\banswer\s*(?:is\b\s*:?|:)[ \t]*([^\n]*)", re.IGNORECASE
)
_BOXED = re.compile(r"\\boxed\s*\{")
_FORMAT = re.compile(rf"{FINAL_ANSWER_MARKER}[ \t]*(.+?)\.?")


class VerifierError(RuntimeError):
    """A verifier raised (or returned a non-number) on one row: names the row and the verifier."""

    def __init__(self, verifier: str, index: int, example: Mapping[str, Any], cause: str):
        self.verifier = verifier
        self.index = index
        super().__init__(
            f"verifier {verifier!r} failed on prompt index {index} "
            f"(id {example.get('id')!r}, task {example.get('task')!r}): {cause}"
        )


def final_answer_text(answer: str) -> str:
    """The line built-in task responses end with, and the form `format_reward` checks."""
    return f"{FINAL_ANSWER_MARKER} {answer}"


def _boxed(text: str) -> list[tuple[int, str]]:
    """(position, content) of every brace-balanced ``\\boxed{...}``; unclosed ones are skipped."""
    found = []
    for match in _BOXED.finditer(text):
        depth = 1
        for end in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                found.append((match.start(), text[match.end() : end]))
                break
    return found


def extract_answer(text: str) -> str | None:
    """The latest marked answer (``####``, ``\\boxed{}``, "the answer is"), stripped; None if unmarked."""
    found = [(m.start(), m.group(1) if m.group(1) is not None else m.group(2)) for m in _MARKED.finditer(text)]
    found = [(pos, content.strip()) for pos, content in found + _boxed(text) if content.strip()]
    return max(found)[1] if found else None


def _to_fraction(number: str) -> Fraction:
    return Fraction(number.replace(",", "").replace("\u2212", "-"))


def _ints(run: str) -> list[int]:
    return [int(x.replace("\u2212", "-")) for x in re.findall(_INT, run)]


def extract_number(text: str) -> Fraction | None:
    """The answer as an exact number: first number of the marked answer, else last number in the text."""
    marked = extract_answer(text)
    if marked is not None:
        match = _NUMBER.search(marked)
        return _to_fraction(match.group()) if match else None
    numbers = _NUMBER.findall(text)
    return _to_fraction(numbers[-1]) if numbers else None


def extract_list(text: str) -> list[int] | None:
    """The answer as a list of integers (comma or space separated, brackets ignored).

    First run of integers in the marked answer, else the last run in the text.
    """
    marked = extract_answer(text)
    runs = _INT_RUN.findall(marked if marked is not None else text)
    if not runs:
        return None
    return _ints(runs[0] if marked is not None else runs[-1])


def _reference(example: Mapping[str, Any]) -> str:
    answer = example.get("answer")
    if not isinstance(answer, str):
        raise ValueError(f"example field 'answer' must be a string, got {answer!r}")
    return answer.strip()


def number_match(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the extracted number equals ``example['answer']`` exactly (``12.0`` equals ``12``)."""
    reference = _reference(example)
    if not _NUMBER.fullmatch(reference):
        raise ValueError(f"example answer {reference!r} is not a number")
    return float(extract_number(completion) == _to_fraction(reference))


def list_match(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the extracted list equals ``example['answer']`` element by element, in order."""
    reference = _reference(example).strip("[]() ")
    if not _INT_RUN.fullmatch(reference):
        raise ValueError(f"example answer {_reference(example)!r} is not a list of integers")
    return float(extract_list(completion) == _ints(reference))


def format_reward(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the last non-empty line is ``#### <number or list>``, the built-in tasks' form."""
    lines = completion.strip().splitlines()
    match = _FORMAT.fullmatch(lines[-1].strip()) if lines else None
    if match is None:
        return 0.0
    content = match.group(1).strip()
    if content.startswith("[") and content.endswith("]"):
        content = content[1:-1].strip()
    return float(bool(_NUMBER.fullmatch(content) or _INT_RUN.fullmatch(content)))


TASK_VERIFIERS: dict[str, Verifier] = {"arithmetic": number_match, "sort": list_match, "reverse": list_match}


def task_verifier(completion: str, example: Mapping[str, Any]) -> float:
    """The verifier of the row's own built-in task (``example['task']``)."""
    task = example.get("task")
    if task not in TASK_VERIFIERS:
        raise ValueError(
            f"no built-in verifier for task {task!r} (built-in: {', '.join(sorted(TASK_VERIFIERS))}); "
            "configure a 'module:function' verifier for it"
        )
    return TASK_VERIFIERS[task](completion, example)


VERIFIERS: dict[str, Verifier] = {
    "task": task_verifier,
    "number": number_match,
    "list": list_match,
    "format": format_reward,
    **TASK_VERIFIERS,
}


def load_verifier(spec: str) -> Verifier:
    """A built-in verifier by name (see `VERIFIERS`) or a user one as ``package.module:function``.

    The user function must have the signature ``fn(completion: str, example: dict) -> float``.
    """
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ValueError(
            f"verifier {spec!r}: neither a built-in ({', '.join(sorted(VERIFIERS))}) nor 'module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"verifier {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn: Any = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ImportError(f"verifier {spec!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"verifier {spec!r}: {attr!r} is not callable")
    return fn


def load_verifiers(specs: Sequence[str]) -> dict[str, Verifier]:
    """{spec: verifier} for a config list such as ``reward.verifiers``; specs must be distinct."""
    if len(set(specs)) != len(specs):
        raise ValueError(f"verifiers: duplicate entries in {list(specs)!r}")
    return {spec: load_verifier(spec) for spec in specs}


def score(
    completions: Sequence[str], examples: Sequence[Mapping[str, Any]], verifiers: Mapping[str, Verifier]
) -> list[dict[str, float]]:
    """One {verifier name: reward} dict per completion; ``examples[i]`` is the row of ``completions[i]``.

    A verifier that raises or returns a non-finite value stops scoring with a `VerifierError`
    naming the index and the verifier; nothing is silently scored as zero.
    """
    if len(completions) != len(examples):
        raise ValueError(f"score: {len(completions)} completions but {len(examples)} examples")
    rows = []
    for index, (completion, example) in enumerate(zip(completions, examples)):
        row = {}
        for name, verifier in verifiers.items():
            try:
                value = float(verifier(completion, example))
            except Exception as e:
                raise VerifierError(name, index, example, f"{type(e).__name__}: {e}") from e
            if not math.isfinite(value):
                raise VerifierError(name, index, example, f"returned {value}, not a finite number")
            row[name] = value
        rows.append(row)
    return rows
