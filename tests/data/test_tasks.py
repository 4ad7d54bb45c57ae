"""Built-in synthetic tasks: determinism, held-out eval, sizes, verifiability, difficulty, errors."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from posttrain.data.tasks import SPLITS, TASKS, build_task, is_held_out, make_splits
from posttrain.rewards import TASK_VERIFIERS, format_reward, task_verifier

ROOT = Path(__file__).resolve().parents[2]
ALL_TASKS = [
    {"name": "arithmetic", "ops": ["add", "sub", "mul"], "digits": 2},
    {"name": "sort", "length": 5, "max_value": 99},
    {"name": "reverse", "length": 4, "max_value": 50},
]
SMALL = {"sft": 300, "preference": 150, "prompts": 90, "eval": 60}
KEYS = {"id", "task", "prompt", "answer", "response", "wrong_answer", "rejected_response"}


def _bytes(splits) -> bytes:
    return json.dumps(splits, sort_keys=True).encode()


def test_default_config_sizes_and_even_mix():
    data = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["data"]
    sizes = {split: data[f"n_{split}"] for split in SPLITS}
    splits = make_splits(data["tasks"], sizes, seed=1234)
    assert list(splits) == list(SPLITS)
    for split, rows in splits.items():
        assert len(rows) == sizes[split]
        assert all(set(row) == KEYS and all(isinstance(v, str) for v in row.values()) for row in rows)
        assert len({row["id"] for row in rows}) == len(rows)  # distinct problems within a split
        counts = Counter(row["task"] for row in rows)
        assert set(counts) == {cfg["name"] for cfg in data["tasks"]}
        assert max(counts.values()) - min(counts.values()) <= 1
        assert max(len(row["prompt"]) + len(row["response"]) for row in rows) < 80  # fits tiny contexts


def test_same_seed_identical_bytes_other_seed_differs():
    first = make_splits(ALL_TASKS, SMALL, seed=7)
    assert _bytes(first) == _bytes(make_splits(ALL_TASKS, SMALL, seed=7))
    other = make_splits(ALL_TASKS, SMALL, seed=8)
    assert _bytes(first) != _bytes(other)
    assert [r["id"] for r in first["sft"]] != [r["id"] for r in other["sft"]]


def test_eval_never_overlaps_training_across_seeds_sizes_and_mixes():
    runs = [
        make_splits(ALL_TASKS, SMALL, seed=1),
        make_splits(ALL_TASKS[:2], {"sft": 500, "eval": 100}, seed=2),
        make_splits([{"name": "arithmetic", "ops": ["sub", "add"], "digits": 2}], {"prompts": 400, "eval": 40}, seed=3),
    ]
    eval_problems = {(r["task"], r["prompt"]) for run in runs for r in run["eval"]}
    train_problems = {(r["task"], r["prompt"]) for run in runs for s in ("sft", "preference", "prompts")
                      for r in run.get(s, [])}
    assert eval_problems and train_problems
    assert not eval_problems & train_problems
    # the same problem keeps its id everywhere
    ids = {}
    for run in runs:
        for rows in run.values():
            for r in rows:
                assert ids.setdefault(r["prompt"], r["id"]) == r["id"]


def _train_side_size(task_cfg) -> int:
    task = build_task(task_cfg)
    return sum(not is_held_out(task, task.problem(i)) for i in range(task.size))


def test_training_splits_share_problems_only_once_the_train_side_is_used_up():
    sort = [{"name": "sort", "length": 3, "max_value": 9}]  # 1,000 problems, about 900 on the train side
    available = _train_side_size(sort[0])
    disjoint = make_splits(sort, {"sft": 400, "preference": 300, "prompts": 150}, seed=5)
    ids = [{r["id"] for r in disjoint[s]} for s in ("sft", "preference", "prompts")]
    assert len(set.union(*ids)) == 850
    # past the train side, the prompts split reuses exactly the shortfall
    full = make_splits(sort, {"sft": 600, "prompts": 600}, seed=5)
    sft, prompts = ({r["id"] for r in full[s]} for s in ("sft", "prompts"))
    assert len(sft & prompts) == 1200 - available > 0


@pytest.mark.parametrize("name", sorted(TASK_VERIFIERS))
def test_responses_verify_and_wrong_answers_do_not(name):
    rows = make_splits([{"name": name}], {"preference": 300}, seed=0)["preference"]
    assert set(TASKS) == set(TASK_VERIFIERS) | {"reasoning_gym"}  # its rows: tests/data/test_reasoning_gym.py
    for row in rows:
        assert row["wrong_answer"] != row["answer"]
        assert task_verifier(row["response"], row) == 1.0
        assert task_verifier(row["rejected_response"], row) == 0.0
        assert format_reward(row["response"], row) == format_reward(row["rejected_response"], row) == 1.0
        if name != "arithmetic":  # a list mistake keeps the list's length
            assert len(row["wrong_answer"].split(", ")) == len(row["answer"].split(", "))
    if name == "arithmetic":
        assert any(row["answer"].startswith("-") for row in rows)  # subtraction goes negative


def _operands(row):
    return re.fullmatch(r"Compute (\d+) [-+*] (\d+)\.", row["prompt"]).groups()


@pytest.mark.parametrize("digits", [1, 3, 4])
def test_digits_knob_sets_operand_length(digits):
    rows = make_splits([{"name": "arithmetic", "digits": digits, "ops": ["mul"]}], {"sft": 50}, seed=0)["sft"]
    lengths = {len(x) for row in rows for x in _operands(row)}
    assert lengths == {digits}
    assert all(int(row["answer"]) == int(a) * int(b) for row in rows for a, b in [_operands(row)])


def test_list_knobs_set_length_and_range():
    cfg = {"name": "sort", "length": 8, "max_value": 9}
    rows = make_splits([cfg], {"sft": 100}, seed=0)["sft"]
    for row in rows:
        values = [int(v) for v in row["prompt"].split(": ")[1].split(", ")]
        assert len(values) == 8 and max(values) <= 9
        assert row["answer"] == ", ".join(map(str, sorted(values)))


@pytest.mark.parametrize(
    "tasks, sizes, message",
    [
        ([{"name": "division"}], {"sft": 1}, r"data\.tasks\[0\]\.name: unknown task 'division'"),
        ([{"name": "sort"}, {"name": "arithmetic", "digit": 2}], {"sft": 1}, r"data\.tasks\[1\]\.digit: unknown key"),
        ([{"name": "arithmetic", "digits": 0}], {"sft": 1}, r"data\.tasks\[0\]\.digits: must be an integer >= 1"),
        ([{"name": "arithmetic", "ops": ["div"]}], {"sft": 1}, r"data\.tasks\[0\]\.ops: must be"),
        ([{"name": "sort", "length": True}], {"sft": 1}, r"data\.tasks\[0\]\.length"),
        ([{"ops": ["add"]}], {"sft": 1}, r"data\.tasks\[0\]: must be a mapping with a 'name'"),
        ([], {"sft": 1}, r"data\.tasks: must be a non-empty list"),
        ([{"name": "sort"}], {"train": 1}, r"unknown split 'train'"),
        ([{"name": "sort"}], {"eval": -1}, r"data\.n_eval: must be an integer >= 0"),
        # 100 one-digit sums, about 10 held out: 40 eval rows cannot exist
        ([{"name": "arithmetic", "ops": ["add"], "digits": 1}], {"eval": 40},
         r"data\.tasks\[0\] \(arithmetic\): problem space too small: data\.n_eval needs 40"),
        # a large space (10^6 lists) is sampled, never enumerated; asking for most of it is refused
        ([{"name": "reverse", "length": 6, "max_value": 9}], {"eval": 90_000}, r"problem space too small"),
    ],
)
def test_clear_errors(tasks, sizes, message):
    with pytest.raises(ValueError, match=message):
        make_splits(tasks, sizes, seed=0)
