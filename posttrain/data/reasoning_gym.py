"""reasoning-gym's procedural generators (PyPI `reasoning-gym`, an optional extra) as tasks and as a verifier.

A generator's item is a pure function of (dataset, seed, size, config, index), so a row needs to carry
only those (`SPEC_FIELD`) for the verifier to regenerate its item and score a completion with the
generator's own `score_answer`, which often reads the item's metadata besides its answer.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Mapping
from typing import Any

SPEC_FIELD = "reasoning_gym"  # the row field holding {dataset, seed, size, config, index}
TASK_PREFIX = "reasoning_gym/"  # a row's `task` is TASK_PREFIX + the dataset's name
RESERVED = ("seed", "size")  # the task's own keys; reasoning-gym's config takes them from there
INSTALL = "pip install 'posttrain[reasoning-gym]' (or pip install reasoning-gym)"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _module() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"reasoning-gym is not installed: {INSTALL}") from err
    return reasoning_gym


def installed() -> bool:
    try:
        _module()
    except ImportError:
        return False
    return True


def version() -> str:
    from importlib.metadata import version as package_version

    return package_version("reasoning-gym")


def problem(dataset: Any, config: Any) -> tuple[str, str] | None:
    """(key of the task to change, what is wrong) with a generator's name or config; None: it builds."""
    if not installed():
        return "name", f"reasoning_gym needs reasoning-gym installed: {INSTALL}"
    from reasoning_gym.factory import DATASETS

    if not isinstance(dataset, str) or dataset not in DATASETS:
        close = difflib.get_close_matches(dataset, DATASETS, n=3) if isinstance(dataset, str) else []
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(DATASETS)} datasets: reasoning_gym.factory.DATASETS"
        return "dataset", f"unknown reasoning-gym dataset {dataset!r}{hint}"
    if not isinstance(config, Mapping):
        return "config", f"must be a mapping of the generator's settings, got {config!r}"
    reserved = [key for key in RESERVED if key in config]
    if reserved:
        return f"config.{reserved[0]}", f"set it as the task's own {reserved[0]} (beside dataset), not in config"
    try:
        generator(dataset, 0, 1, json.dumps(dict(config), sort_keys=True))
    except Exception as err:  # the generator's config class validates: its message, whatever its type
        return "config", f"reasoning-gym's {dataset} rejects it: {type(err).__name__}: {err}"
    return None


@functools.lru_cache(maxsize=64)
def generator(dataset: str, seed: int, size: int, config_json: str) -> Any:
    """The generator object (cached: a GRPO run scores thousands of completions of the same few)."""
    return _module().create_dataset(dataset, seed=seed, size=size, **json.loads(config_json))


def spec(dataset: str, seed: int, size: int, config: Mapping[str, Any], index: int) -> dict[str, Any]:
    return {"dataset": dataset, "seed": seed, "size": size, "config": dict(config), "index": index}


def _generator_of(item_spec: Mapping[str, Any]) -> Any:
    return generator(item_spec["dataset"], item_spec["seed"], item_spec["size"],
                     json.dumps(item_spec["config"], sort_keys=True))


def item(item_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The generator's item (question, answer, metadata) a row's spec names."""
    return _generator_of(item_spec)[item_spec["index"]]


def score_answer(answer: str | None, item_spec: Mapping[str, Any]) -> float:
    """The generator's own score of an extracted answer (None: no answer found)."""
    return float(_generator_of(item_spec).score_answer(answer, item(item_spec)))


def extract(completion: str, marked: str | None) -> str | None:
    """The answer reasoning-gym's scorers expect: the last `<answer>...</answer>` (reasoning-gym's own format),
    else everything after the last `####` (the built-in tasks' format; an answer may span lines), else the
    `marked` answer (`\\boxed{}`, "the answer is"), else None."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    if "####" in completion:
        return completion.rsplit("####", 1)[1].strip()
    return marked
