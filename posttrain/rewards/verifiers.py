"""Rule-based verifiers and reward functions: score a completion against its row, no model needed.

A verifier is any callable ``fn(completion: str, example: dict) -> float``. ``example`` holds at
least ``prompt``, ``answer`` (the canonical reference answer as text) and ``task``; rows of the
built-in tasks also carry ``id``, rows of a data source every other column. Built-in verifiers
return 1.0 or 0.0. A *batched* reward function is ``fn(completions: list[str], examples: list[dict])
-> list[float]``, one value per completion, called once per batch (as TRL calls its ``reward_funcs``).

`reward.verifiers` entries (`reward_spec`): a name, or ``{fn: name, weight: w, batched: b}``. A name is
a built-in (`VERIFIERS`), ``package.module:function`` (imported from the working directory, the
checkout or PYTHONPATH) or ``path/to/file.py:function`` (a file, relative to the working directory).
A completion's reward is the weighted sum of the entries' values (`Rewards.total`); the first entry
alone decides whether it is correct (full credit, >= 1, on its own unweighted value).

Answer extraction, shared by the built-ins: the *marked* answer is the latest of
``#### X``, ``\\boxed{X}``, ``The answer is X`` / ``Answer: X`` in the text; the first number
(or list) inside it counts. Without a marker, the last number (or list) in the text counts.
A reference answer with a ``#### X`` line (GSM8K's worked solutions) is read as X (`reference_answer`).
`math` compares the final answer with the reference by math-verify (LaTeX, fractions, sets, ...);
`reasoning_gym` scores a reasoning-gym task's row with its generator's own scorer (`task` does too).
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from posttrain.rewards.specs import (
    BUILTIN_VERIFIERS,
    RewardSpec,
    reward_spec,
    reward_specs,
    user_function,
    verifier_name,  # noqa: F401 (re-exported)
)

Verifier = Callable[[str, Mapping[str, Any]], float]
BatchedVerifier = Callable[[list[str], list[Mapping[str, Any]]], Sequence[float]]

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
    """A verifier raised (or returned a non-number) on one row: names the row and the verifier.

    A batched function that raises, or returns the wrong number of values, fails on its whole batch:
    `index` is None and `batch` the number of completions it was called with.
    """

    def __init__(self, verifier: str, index: int | None, example: Mapping[str, Any] | None, cause: str,
                 batch: int | None = None):
        self.verifier = verifier
        self.index = index
        self.batch = batch
        if index is None:
            super().__init__(f"verifier {verifier!r} failed on a batch of {batch} completions: {cause}")
        else:
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


def marked_answer(text: str) -> tuple[str, str] | None:
    """(marker, content) of the latest marked answer: marker ``####``, ``boxed`` or ``answer``; None if unmarked."""
    found = [(m.start(), m.group(1), "####") if m.group(1) is not None else (m.start(), m.group(2), "answer")
             for m in _MARKED.finditer(text)]
    found += [(pos, content, "boxed") for pos, content in _boxed(text)]
    found = [(pos, content.strip(), marker) for pos, content, marker in found if content.strip()]
    if not found:
        return None
    _, content, marker = max(found)
    return marker, content


def extract_answer(text: str) -> str | None:
    """The latest marked answer (``####``, ``\\boxed{}``, "the answer is"), stripped; None if unmarked."""
    marked = marked_answer(text)
    return None if marked is None else marked[1]


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


def reference_answer(example: Mapping[str, Any]) -> str:
    """``example['answer']``, stripped; a worked solution with a ``#### X`` line (GSM8K) gives X, with a
    number's thousands separators dropped (``#### 1,234``: ``1234``)."""
    answer = example.get("answer")
    if not isinstance(answer, str):
        raise ValueError(f"example field 'answer' must be a string, got {answer!r}")
    answer = answer.strip()
    if FINAL_ANSWER_MARKER not in answer:
        return answer
    final = [m.group(1).strip() for m in re.finditer(rf"{FINAL_ANSWER_MARKER}[ \t]*([^\n]*)", answer)]
    final = [f for f in final if f]
    if not final:
        raise ValueError(f"example answer {answer!r} has a {FINAL_ANSWER_MARKER} marker with nothing after it")
    return final[-1].replace(",", "") if _NUMBER.fullmatch(final[-1]) else final[-1]


def number_match(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the extracted number equals ``example['answer']`` exactly (``12.0`` equals ``12``)."""
    reference = reference_answer(example)
    if not _NUMBER.fullmatch(reference):
        raise ValueError(f"example answer {reference!r} is not a number")
    return float(extract_number(completion) == _to_fraction(reference))


def list_match(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the extracted list equals ``example['answer']`` element by element, in order."""
    reference = reference_answer(example).strip("[]() ")
    if not _INT_RUN.fullmatch(reference):
        raise ValueError(f"example answer {reference_answer(example)!r} is not a list of integers")
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


def reasoning_gym_match(completion: str, example: Mapping[str, Any]) -> float:
    """The reasoning-gym generator's own `score_answer` (its value, partial credit included) on the completion's
    answer (`reasoning_gym.extract`), for the item the row's `reasoning_gym` field names."""
    from posttrain.data import reasoning_gym

    spec = example.get(reasoning_gym.SPEC_FIELD)
    if not isinstance(spec, Mapping):
        raise ValueError(f"not a reasoning-gym row: no {reasoning_gym.SPEC_FIELD!r} field (rows of data.tasks "
                         "{name: reasoning_gym, ...} carry it)")
    return reasoning_gym.score_answer(reasoning_gym.extract(completion, extract_answer(completion)), spec)


def environment_reward(completion: str, example: Mapping[str, Any]) -> float:
    """The episode's reward from its environment (`environment.fn`: the sum of its turns' rewards)."""
    if "env_reward" not in example:
        raise ValueError("the environment verifier scores multi-turn episodes: set environment.fn (docs/environments.md)")
    return float(example["env_reward"])


TASK_VERIFIERS: dict[str, Verifier] = {"arithmetic": number_match, "sort": list_match, "reverse": list_match}


def task_verifier(completion: str, example: Mapping[str, Any]) -> float:
    """The verifier of the row's own built-in task (``example['task']``); a reasoning-gym task's is its scorer."""
    task = example.get("task")
    if isinstance(task, str) and task.startswith("reasoning_gym/"):
        return reasoning_gym_match(completion, example)
    if task not in TASK_VERIFIERS:
        raise ValueError(
            f"no built-in verifier for task {task!r} (built-in: {', '.join(sorted(TASK_VERIFIERS))}); "
            "configure another verifier for it (math, number, or a function of your own)"
        )
    return TASK_VERIFIERS[task](completion, example)


def _math_timeout() -> int | None:
    """math-verify bounds each parse and comparison with SIGALRM, which only the main thread may set."""
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


MATH_TIMEOUT_S = 5  # seconds per parse and per comparison (math-verify's default)
_LATEX = re.compile(r"[\\{}^$]")


def _math_parse(text: str, latex: bool) -> list[Any]:
    from math_verify import parse

    timeout = _math_timeout()
    if latex:
        found = parse(text if "$" in text else f"${text}$", parsing_timeout=timeout)
        if found:
            return found
    return parse(text, parsing_timeout=timeout)


@functools.lru_cache(maxsize=4096)
def _math_reference(reference: str) -> tuple[Any, ...]:
    """The parsed reference (a reference is parsed once per process, its samples many times)."""
    found = _math_parse(reference, latex=True)
    if not found:
        raise ValueError(f"example answer {reference!r} is not an expression math-verify parses")
    return tuple(found)


def _math_completion(completion: str) -> list[Any]:
    """The completion's final answer, parsed: the latest ``\\boxed{}``, ``####`` or "the answer is" content, else
    math-verify's own pick from the whole text (the last expression)."""
    text = completion.replace("\u2212", "-")
    marked = marked_answer(text)
    if marked is None:
        return _math_parse(text, latex=False)
    marker, content = marked
    if marker == "boxed":
        from math_verify import parse

        return parse(f"\\boxed{{{content}}}", parsing_timeout=_math_timeout())
    return _math_parse(content, latex=bool(_LATEX.search(content)))


def math_match(completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when math-verify finds the completion's final answer equal to the reference (`reference_answer`).

    Equal as mathematics: ``\\frac{1}{2}`` equals 0.5, ``\\{1, 2\\}`` equals ``\\{2, 1\\}``, ``3\\pi`` is not 3.
    A reference without a ``$`` is read as LaTeX math (wrapped in ``$...$``); one math-verify cannot parse
    raises (nothing is scored as zero for a bad reference).
    """
    from math_verify import verify

    gold = list(_math_reference(reference_answer(example)))
    predicted = _math_completion(completion)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=_math_timeout()))


VERIFIERS: dict[str, Verifier] = {
    "task": task_verifier,
    "math": math_match,
    "number": number_match,
    "list": list_match,
    "format": format_reward,
    "environment": environment_reward,
    "reasoning_gym": reasoning_gym_match,
    **TASK_VERIFIERS,
}
assert set(VERIFIERS) == set(BUILTIN_VERIFIERS), "posttrain.rewards.specs.BUILTIN_VERIFIERS lists the built-ins"


class Batched:
    """A reward function called once per batch: ``fn(completions, examples) -> one value per completion``."""

    def __init__(self, fn: BatchedVerifier, name: str):
        self.fn, self.name = fn, name

    def __call__(self, completions: list[str], examples: list[Mapping[str, Any]]) -> Sequence[float]:
        return self.fn(completions, examples)

    def __repr__(self) -> str:
        return f"Batched({self.name!r})"


def load_verifier(entry: str | Mapping[str, Any] | RewardSpec, workdir: str | os.PathLike | None = None) -> Verifier | Batched:
    """The function of a `reward.verifiers` entry: a built-in verifier by name (see `VERIFIERS`), or a user
    one as ``package.module:function`` or ``path/file.py:function`` (relative to `workdir`, by default the
    working directory).

    A per-sample function is returned as is: ``fn(completion: str, example: dict) -> float``; a batched one
    (``batched: true``) wrapped in `Batched`: ``fn(completions: list[str], examples: list[dict]) -> list[float]``.
    """
    spec = reward_spec(entry)
    if spec.name in VERIFIERS:
        if spec.batched:
            raise ValueError(f"verifier {spec.name!r}: a built-in verifier scores one completion at a time; drop batched")
        return VERIFIERS[spec.name]
    if spec.module is None or not spec.attr:
        raise ValueError(
            f"verifier {spec.name!r}: neither a built-in ({', '.join(sorted(VERIFIERS))}), 'module:function' "
            "nor 'path/file.py:function'"
        )
    fn = user_function(spec, workdir)
    return Batched(fn, spec.name) if spec.batched else fn


def load_verifiers(entries: Sequence[str | Mapping[str, Any] | RewardSpec],
                   workdir: str | os.PathLike | None = None) -> dict[str, Verifier | Batched]:
    """{name: verifier} for a config list such as ``reward.verifiers``; names must be distinct."""
    return {spec.name: load_verifier(spec, workdir) for spec in reward_specs(entries)}


def _batch_values(name: str, verifier: Batched, completions: Sequence[str],
                  examples: Sequence[Mapping[str, Any]]) -> list[Any]:
    """One call of a batched function on every completion; its values, one per completion."""
    try:
        values = list(verifier(list(completions), list(examples)))
    except Exception as e:
        raise VerifierError(name, None, None, f"{type(e).__name__}: {e}", batch=len(completions)) from e
    if len(values) != len(completions):
        raise VerifierError(name, None, None, f"returned {len(values)} values for {len(completions)} completions "
                            "(a batched function returns one per completion)", batch=len(completions))
    return values


def score(
    completions: Sequence[str], examples: Sequence[Mapping[str, Any]], verifiers: Mapping[str, Verifier | Batched]
) -> list[dict[str, float]]:
    """One {verifier name: reward} dict per completion; ``examples[i]`` is the row of ``completions[i]``.

    Per-sample verifiers are called completion after completion; a `Batched` one once, on all of them.
    A verifier that raises or returns a non-finite value stops scoring with a `VerifierError`
    naming the index and the verifier; nothing is silently scored as zero.
    """
    if len(completions) != len(examples):
        raise ValueError(f"score: {len(completions)} completions but {len(examples)} examples")
    batched = {name: _batch_values(name, verifier, completions, examples)
               for name, verifier in verifiers.items() if isinstance(verifier, Batched) and completions}
    rows = []
    for index, (completion, example) in enumerate(zip(completions, examples)):
        row = {}
        for name, verifier in verifiers.items():
            try:
                value = float(batched[name][index] if name in batched else verifier(completion, example))
            except Exception as e:
                raise VerifierError(name, index, example, f"{type(e).__name__}: {e}") from e
            if not math.isfinite(value):
                raise VerifierError(name, index, example, f"returned {value}, not a finite number")
            row[name] = value
        rows.append(row)
    return rows


class Rewards:
    """The configured reward functions (`reward.verifiers`), loaded: their scores, their weighted sum, correctness.

    `workdir`: what a `path/file.py:function` is relative to (the working directory by default).
    """

    def __init__(self, entries: Sequence[str | Mapping[str, Any] | RewardSpec], workdir: str | os.PathLike | None = None):
        if not entries:
            raise ValueError("reward.verifiers is empty: at least one verifier decides what is correct")
        self.specs = reward_specs(entries)
        self.verifiers = {spec.name: load_verifier(spec, workdir) for spec in self.specs}
        self.weights = {spec.name: spec.weight for spec in self.specs}
        self.first = self.specs[0].name

    def score(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
        """Each function's own (unweighted) value per completion (`score`)."""
        return score(completions, examples, self.verifiers)

    def total(self, values: Mapping[str, float]) -> float:
        """The reward of one completion: sum over the entries, in config order, of weight x value."""
        return sum(self.weights[name] * values[name] for name in self.weights)

    def correct(self, values: Mapping[str, float]) -> bool:
        """Full credit (>= 1) from the first entry, on its own value."""
        return values[self.first] >= 1.0

