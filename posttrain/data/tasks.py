"""Built-in synthetic verifiable tasks: the offline data of the default pipeline.

Configured by ``data.tasks`` (e.g. ``{name: arithmetic, ops: [add, sub, mul], digits: 2}``).
Each task maps an integer index onto one problem, so its problem space can be counted and, when
small, enumerated. A problem is held out for eval or kept for training by a hash of its canonical
text, never by the seed or the split sizes: the same problem sits on the same side in every run,
so no eval problem is ever trained on, whatever the seed, sizes or task mix.

Every example is a dict of strings: ``id`` (content hash, the same for the same problem),
``task``, ``prompt`` (user message), ``answer`` (canonical final answer), ``response`` (SFT
target, ends with ``#### <answer>``), ``wrong_answer`` and ``rejected_response`` (a plausible
mistake, for preference pairs).
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from posttrain.data import reasoning_gym
from posttrain.rewards.verifiers import final_answer_text

SPLITS = ("sft", "preference", "prompts", "eval")
EVAL_BUCKETS = 10  # one problem in EVAL_BUCKETS (by hash) is on the eval side
EXHAUSTIVE_LIMIT = 100_000  # problem spaces up to this size are enumerated, larger ones sampled


def _require_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}: must be an integer >= {minimum}, got {value!r}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _on_eval_side(digest: bytes) -> bool:
    return int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0


def is_held_out(task: Task, problem: Any) -> bool:
    """Whether ``problem`` is on the eval side of ``task``'s hash split."""
    return _on_eval_side(_digest(task.key(problem)))


class Task(ABC):
    """A problem space indexed by ``range(size)`` plus how to state, solve and get one wrong."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def size(self) -> int:
        """Number of distinct problems."""

    @abstractmethod
    def problem(self, index: int) -> Any:
        """The problem with this index in ``range(size)``."""

    @abstractmethod
    def canonical(self, problem: Any) -> str:
        """A text that identifies the problem regardless of the task's parameters."""

    @abstractmethod
    def prompt(self, problem: Any) -> str: ...

    @abstractmethod
    def answer(self, problem: Any) -> str: ...

    @abstractmethod
    def wrong_answer(self, problem: Any, rng: random.Random) -> str:
        """A plausible mistake, always different from `answer`."""

    @property
    def label(self) -> str:
        """The rows' `task` (what the `task` verifier dispatches on and the report groups by)."""
        return self.name

    def key(self, problem: Any) -> str:
        return f"{self.label}:{self.canonical(problem)}"

    def example(self, problem: Any, rng: random.Random) -> dict[str, Any]:
        answer, wrong = self.answer(problem), self.wrong_answer(problem, rng)
        return {
            "id": f"{self.label}-{_digest(self.key(problem)).hex()[:12]}",
            "task": self.label,
            "prompt": self.prompt(problem),
            "answer": answer,
            "response": final_answer_text(answer),
            "wrong_answer": wrong,
            "rejected_response": final_answer_text(wrong),
        }


_OPS = {"add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul)}


def _digitwise(a: int, b: int, combine) -> int:
    """Combine aligned digits and drop every carry or borrow: the classic column slip."""
    out, place = 0, 1
    while a or b:
        out += combine(a % 10, b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


@dataclass
class Arithmetic(Task):
    """``a <op> b`` with ``digits``-digit operands (the difficulty knob)."""

    name: ClassVar[str] = "arithmetic"
    ops: Sequence[str] = ("add", "sub", "mul")
    digits: int = 2

    def __post_init__(self) -> None:
        ops = self.ops
        if isinstance(ops, str) or not isinstance(ops, Sequence) or not ops or len(set(ops)) != len(ops) \
                or any(op not in _OPS for op in ops):
            raise ValueError(f"ops: must be a non-empty list of distinct values from {sorted(_OPS)}, got {ops!r}")
        self.ops = tuple(ops)
        _require_int("digits", self.digits, 1)

    @property
    def _operands(self) -> range:
        return range(0 if self.digits == 1 else 10 ** (self.digits - 1), 10**self.digits)

    @property
    def size(self) -> int:
        return len(self.ops) * len(self._operands) ** 2

    def problem(self, index: int) -> tuple[str, int, int]:
        operands = self._operands
        op, rest = divmod(index, len(operands) ** 2)
        a, b = divmod(rest, len(operands))
        return self.ops[op], operands[a], operands[b]

    def canonical(self, problem: tuple[str, int, int]) -> str:
        op, a, b = problem
        return f"{a}{_OPS[op][0]}{b}"

    def prompt(self, problem: tuple[str, int, int]) -> str:
        op, a, b = problem
        return f"Compute {a} {_OPS[op][0]} {b}."

    def _result(self, problem: tuple[str, int, int]) -> int:
        op, a, b = problem
        return _OPS[op][1](a, b)

    def answer(self, problem: tuple[str, int, int]) -> str:
        return str(self._result(problem))

    def wrong_answer(self, problem: tuple[str, int, int], rng: random.Random) -> str:
        op, a, b = problem
        right = self._result(problem)
        wrong = {right + 1, right - 1, right + 10, right - 10}  # one digit off
        if op == "add":
            wrong.add(_digitwise(a, b, operator.add))  # carry dropped
        elif op == "sub" and a >= b:
            wrong.add(_digitwise(a, b, lambda x, y: abs(x - y)))  # borrow dropped
        elif op == "mul":
            wrong.update({right + a, right - a})  # one partial product too many or too few
        digits = str(abs(right))
        if len(digits) >= 2 and digits[-1] != digits[-2]:  # last two digits swapped
            wrong.add(int(digits[:-2] + digits[-1] + digits[-2]) * (-1 if right < 0 else 1))
        wrong.discard(right)
        return str(rng.choice(sorted(wrong)))


@dataclass
class _ListTask(Task):
    """A transformation of ``length`` integers in ``[0, max_value]`` (the difficulty knobs)."""

    instruction: ClassVar[str]
    length: int = 5
    max_value: int = 99

    def __post_init__(self) -> None:
        _require_int("length", self.length, 2)
        _require_int("max_value", self.max_value, 1)

    @abstractmethod
    def solve(self, values: tuple[int, ...]) -> list[int]: ...

    @property
    def size(self) -> int:
        return (self.max_value + 1) ** self.length

    def problem(self, index: int) -> tuple[int, ...]:
        values = []
        for _ in range(self.length):
            index, value = divmod(index, self.max_value + 1)
            values.append(value)
        return tuple(values)

    def canonical(self, problem: tuple[int, ...]) -> str:
        return ",".join(map(str, problem))

    def prompt(self, problem: tuple[int, ...]) -> str:
        return f"{self.instruction}: {', '.join(map(str, problem))}"

    def answer(self, problem: tuple[int, ...]) -> str:
        return ", ".join(map(str, self.solve(problem)))

    def wrong_answer(self, problem: tuple[int, ...], rng: random.Random) -> str:
        values = self.solve(problem)
        unequal = [i for i in range(len(values) - 1) if values[i] != values[i + 1]]
        if unequal:  # one adjacent pair swapped
            i = rng.choice(unequal)
            values[i], values[i + 1] = values[i + 1], values[i]
        else:  # all equal: one element off by one
            values[-1] += 1 if values[-1] < self.max_value else -1
        return ", ".join(map(str, values))


class Sort(_ListTask):
    name: ClassVar[str] = "sort"
    instruction: ClassVar[str] = "Sort ascending"

    def solve(self, values: tuple[int, ...]) -> list[int]:
        return sorted(values)


class Reverse(_ListTask):
    name: ClassVar[str] = "reverse"
    instruction: ClassVar[str] = "Reverse"

    def solve(self, values: tuple[int, ...]) -> list[int]:
        return list(reversed(values))


@dataclass
class ReasoningGym(Task):
    """Items 0..size-1 of a reasoning-gym generator (`posttrain.data.reasoning_gym`), its questions and answers.

    Each row carries the item's spec (`reasoning_gym.SPEC_FIELD`) so the `reasoning_gym` verifier scores
    it with the generator's own `score_answer`. A wrong answer (DPO's rejected) is the first of the
    answer off by one or ten (numbers) or other items' answers that the scorer gives less than full credit.
    """

    name: ClassVar[str] = "reasoning_gym"
    dataset: str = ""
    size: int = 10_000
    seed: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)
    _items: dict[int, dict[str, Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _require_int("size", self.size, 1)
        _require_int("seed", self.seed, 0)
        problem = reasoning_gym.problem(self.dataset, self.config)
        if problem:
            raise ValueError(": ".join(problem))

    @property
    def label(self) -> str:
        return reasoning_gym.TASK_PREFIX + self.dataset

    def _spec(self, index: int) -> dict[str, Any]:
        return reasoning_gym.spec(self.dataset, self.seed, self.size, self.config, index)

    def problem(self, index: int) -> tuple[int, dict[str, Any]]:
        if index not in self._items:  # drawing looks at each candidate twice
            self._items[index] = reasoning_gym.item(self._spec(index))
        return index, self._items[index]

    def canonical(self, problem: tuple[int, dict[str, Any]]) -> str:
        return problem[1]["question"]

    def prompt(self, problem: tuple[int, dict[str, Any]]) -> str:
        return problem[1]["question"]

    def answer(self, problem: tuple[int, dict[str, Any]]) -> str:
        return str(problem[1]["answer"])

    def wrong_answer(self, problem: tuple[int, dict[str, Any]], rng: random.Random) -> str:
        index, _ = problem
        right = self.answer(problem)
        candidates = []
        if re.fullmatch(r"-?\d+", right):
            candidates += [str(int(right) + d) for d in rng.sample([1, -1, 10, -10], 4)]
        candidates += [self.answer(self.problem(rng.randrange(self.size))) for _ in range(16)]
        for wrong in candidates:
            if wrong != right and reasoning_gym.score_answer(wrong, self._spec(index)) < 1.0:
                return wrong
        raise ValueError(f"reasoning_gym {self.dataset}: item {index} has no wrong answer among {len(candidates)} tried "
                         "(its scorer credits all of them); use it for SFT and RL only, without DPO pairs")

    def example(self, problem: tuple[int, dict[str, Any]], rng: random.Random) -> dict[str, Any]:
        return {**super().example(problem, rng), reasoning_gym.SPEC_FIELD: self._spec(problem[0])}


TASKS: dict[str, type[Task]] = {task.name: task for task in (Arithmetic, Sort, Reverse, ReasoningGym)}


def build_task(cfg: Mapping[str, Any], where: str = "task") -> Task:
    """A task from its config mapping; errors name the key under ``where`` (e.g. ``data.tasks[0]``)."""
    if not isinstance(cfg, Mapping) or "name" not in cfg:
        raise ValueError(f"{where}: must be a mapping with a 'name' key, got {cfg!r}")
    name = cfg["name"]
    if name not in TASKS:
        raise ValueError(f"{where}.name: unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    allowed = [f.name for f in fields(cls) if f.init]
    for key in cfg:
        if key != "name" and key not in allowed:
            raise ValueError(f"{where}.{key}: unknown key for task {name!r}; allowed: name, {', '.join(allowed)}")
    try:
        return cls(**{k: v for k, v in cfg.items() if k != "name"})
    except ValueError as e:
        raise ValueError(f"{where}.{e}") from None


def _even_counts(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def _draw(task: Task, n: int, eval_side: bool, taken: set[str], rng: random.Random,
          pool: list[int] | None, where: str, split: str, used: set[str]) -> list[Any]:
    """``n`` distinct problems on one side of the eval hash, not in ``taken`` (updated in place).

    From an enumerated ``pool``, problems outside ``used`` (those earlier training splits hold)
    come first and the rest only when they run out; ``used`` gains the picked keys.
    """
    side = "eval" if eval_side else "train"
    if pool is not None:
        shuffled = (task.problem(index) for index in rng.sample(pool, len(pool)))
        candidates = iter(sorted(shuffled, key=lambda problem: task.key(problem) in used))  # stable: fresh first
    else:
        available = task.size // EVAL_BUCKETS if eval_side else task.size - task.size // EVAL_BUCKETS
        if n > available // 2:  # keeps rejection sampling fast and the answer certain
            raise ValueError(
                f"{where} ({task.name}): problem space too small: data.n_{split} needs {n} distinct {side} "
                f"problems of this task, more than half of the ~{available} on the {side} side; "
                f"lower data.n_{split} or make the task harder"
            )
        candidates = (task.problem(rng.randrange(task.size)) for _ in itertools.count())
    picked = []
    for problem in candidates:
        if len(picked) == n:
            break
        key = task.key(problem)
        if key not in taken and _on_eval_side(_digest(key)) == eval_side:
            taken.add(key)
            used.add(key)
            picked.append(problem)
    if len(picked) < n:
        raise ValueError(
            f"{where} ({task.name}): problem space too small: data.n_{split} needs {n} distinct {side} "
            f"problems of this task, only {len(picked)} exist ({task.size} problems in all, about "
            f"1 in {EVAL_BUCKETS} held out for eval); lower data.n_{split} or make the task harder"
        )
    return picked


def make_splits(tasks_cfg: Sequence[Mapping[str, Any]], sizes: Mapping[str, int], seed: int) -> dict[str, list[dict]]:
    """Generate the requested splits (keys of ``sizes``, from `SPLITS`), tasks mixed evenly.

    Problems are distinct within a split; the eval split shares no problem with any other split
    (in this or any other run); output is identical for the same arguments. The training splits
    (sft, preference, prompts, in that order) of an enumerable task share a problem only once its
    train side is used up: RL prompts the model never saw solved in SFT or DPO reward solving,
    not recall of memorized answers. Sampled (huge) problem spaces overlap rarely by size alone.
    """
    if isinstance(tasks_cfg, (str, Mapping)) or not isinstance(tasks_cfg, Sequence) or not tasks_cfg:
        raise ValueError(f"data.tasks: must be a non-empty list of task mappings, got {tasks_cfg!r}")
    tasks = [build_task(cfg, f"data.tasks[{i}]") for i, cfg in enumerate(tasks_cfg)]
    for split, n in sizes.items():
        if split not in SPLITS:
            raise ValueError(f"sizes: unknown split {split!r}; splits: {', '.join(SPLITS)}")
        _require_int(f"data.n_{split}", n, 0)
    pools: dict[tuple[int, bool], list[int]] = {}
    for i, task in enumerate(tasks):
        if task.size <= EXHAUSTIVE_LIMIT:
            for index in range(task.size):
                side = is_held_out(task, task.problem(index))
                pools.setdefault((i, side), []).append(index)
    splits = {}
    used: list[set[str]] = [set() for _ in tasks]  # per task: keys of earlier training splits
    for split in (s for s in SPLITS if s in sizes):
        taken: set[str] = set()
        rows = []
        for i, (task, n) in enumerate(zip(tasks, _even_counts(sizes[split], len(tasks)))):
            rng = random.Random(f"{seed}/{split}/{i}")
            pool = pools.get((i, split == "eval"), []) if task.size <= EXHAUSTIVE_LIMIT else None
            for problem in _draw(task, n, split == "eval", taken, rng, pool, f"data.tasks[{i}]", split, used[i]):
                rows.append(task.example(problem, rng))
        random.Random(f"{seed}/{split}").shuffle(rows)
        splits[split] = rows
    return splits
