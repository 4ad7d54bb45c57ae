"""reasoning-gym generators as data tasks and as a verifier, checked against reasoning-gym's own scoring."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from eval_fixtures import run_stage

reasoning_gym = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (envs/test-cpu.txt has it)")

from posttrain.data.sources import canonical_rows  # noqa: E402
from posttrain.data.store import load_split  # noqa: E402
from posttrain.data.tasks import make_splits  # noqa: E402
from posttrain.rewards.verifiers import VerifierError, reasoning_gym_match, score, task_verifier  # noqa: E402
from posttrain.workflow.preflight import task_problems, verifier_problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TASKS = [
    {"name": "reasoning_gym", "dataset": "chain_sum", "size": 3000, "config": {"min_terms": 2, "max_terms": 2, "max_digits": 2}},
    {"name": "reasoning_gym", "dataset": "spell_backward", "size": 3000, "seed": 7, "config": {"max_word_len": 6}},
    {"name": "reasoning_gym", "dataset": "number_sorting", "size": 3000, "config": {"max_numbers": 4, "max_decimals": 0}},
]
SIZES = {"sft": 60, "preference": 30, "prompts": 30, "eval": 60}


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return make_splits(TASKS, SIZES, seed=3)


def _own_items(task: dict) -> dict[str, dict]:
    """question -> item, from reasoning-gym directly (not through posttrain)."""
    data = reasoning_gym.create_dataset(task["dataset"], seed=task.get("seed", 0), size=task["size"], **task["config"])
    return {entry["question"]: (data, entry) for entry in data}


def test_splits_hold_generator_items_and_eval_is_never_trained_on(splits: dict[str, list[dict]]) -> None:
    own = {}
    for task in TASKS:
        own.update(_own_items(task))
    for split, rows in splits.items():
        assert len(rows) == SIZES[split]
        assert {r["task"] for r in rows} == {f"reasoning_gym/{t['dataset']}" for t in TASKS}
        for row in rows:
            data, entry = own[row["prompt"]]  # the generator's own question, answer and item
            assert row["answer"] == entry["answer"]
            assert row["response"] == f"#### {entry['answer']}"
            assert data.score_answer(row["wrong_answer"], entry) < 1.0 <= data.score_answer(row["answer"], entry)
    train = {r["prompt"] for s in ("sft", "preference", "prompts") for r in splits[s]}
    assert train.isdisjoint(r["prompt"] for r in splits["eval"])
    assert make_splits(TASKS, SIZES, seed=3) == splits
    assert make_splits(TASKS, SIZES, seed=4)["sft"] != splits["sft"]


def _completions(rows: list[dict], rng: random.Random) -> list[str]:
    """Completions in reasoning-gym's format (`<answer>`) and ours (`####`), right, wrong and unanswered."""
    out = []
    for row in rows:
        right, wrong = row["answer"], row["wrong_answer"]
        out += [f"Thinking.\n<answer>{right}</answer>", f"<answer>{wrong}</answer>", f"#### {right}", f"x\n#### {wrong}",
                rng.choice(["I do not know.", f"<answer> {right} </answer>", f"{right}"])]
    return out


def test_scores_equal_reasoning_gym_score_answer_on_200_completions(splits: dict[str, list[dict]]) -> None:
    rows = canonical_rows(splits["eval"][:40], "eval", "test")[0]
    examples = [json.loads(json.dumps(row["example"])) for row in rows]  # as the prompt split stores them
    rng = random.Random(0)
    completions = _completions(examples, rng)
    assert len(completions) == 200
    own = {}
    for task in TASKS:
        own.update(_own_items(task))
    ours = [s["reasoning_gym"] for s in score(completions, [e for e in examples for _ in range(5)],
                                                {"reasoning_gym": reasoning_gym_match})]
    theirs = []
    for completion, example in zip(completions, [e for e in examples for _ in range(5)]):
        data, entry = own[example["prompt"]]
        tagged = reasoning_gym.utils.extract_answer(completion)  # reasoning-gym's own extractor
        answer = tagged if tagged is not None else (completion.rsplit("####", 1)[1].strip() if "####" in completion else None)
        theirs.append(float(data.score_answer(answer, entry)))
    assert ours == theirs
    assert {0.0, 1.0} <= set(ours)  # right and wrong answers are told apart
    assert [task_verifier(c, e) for c, e in zip(completions[:10], [e for e in examples for _ in range(5)])] == ours[:10]


def test_a_row_without_the_spec_is_refused() -> None:
    with pytest.raises(VerifierError, match="not a reasoning-gym row"):
        score(["#### 4"], [{"prompt": "2+2", "answer": "4", "task": "", "id": "a"}], {"reasoning_gym": reasoning_gym_match})


def test_dry_run_names_the_task_key(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = [{"name": "sort"}, {"name": "reasoning_gym", "dataset": "chainsum"},
           {"name": "reasoning_gym", "dataset": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}},
           {"name": "reasoning_gym", "dataset": "chain_sum", "config": {"seed": 1}}]
    problems = task_problems(bad)
    assert [key for key, _ in problems] == ["data.tasks[1].dataset", "data.tasks[2].config", "data.tasks[3].config.seed"]
    assert "did you mean chain_sum" in problems[0][1] and "max_terms must be >= min_terms" in problems[1][1]
    assert verifier_problem("reasoning_gym", []) is None
    monkeypatch.setattr("posttrain.data.reasoning_gym.installed", lambda: False)
    assert "pip install" in verifier_problem("reasoning_gym", [])
    (key, why), = task_problems(bad[1:2])
    assert key == "data.tasks[0].name" and "reasoning-gym installed" in why


def test_prepare_data_writes_reasoning_gym_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["data"].update(tasks=TASKS[:2], n_sft=40, n_preference=20, n_prompts=20, n_eval=20, max_seq_len=96)
    cfg.update(stage="prepare_data", key="test-key", upstream={})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    run_stage("prepare_data", ["--config", config, "--out", tmp_path / "data"], monkeypatch)
    split = load_split(tmp_path / "data", "eval")
    examples = [json.loads(e) for e in split["example"]]
    assert len(examples) == 20 and all(e["reasoning_gym"]["dataset"] in ("chain_sum", "spell_backward") for e in examples)
    # the stored rows score their own answers in full and their wrong answers below it
    assert all(reasoning_gym_match(f"#### {e['answer']}", e) == 1.0 > reasoning_gym_match(f"#### {e['wrong_answer']}", e)
               for e in examples)
