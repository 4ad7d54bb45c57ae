"""benchmarks/peers/quality.py hands TRL exactly the rows posttrain trained on, in posttrain's order, and tabulates
both sides from the saved comparisons."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups

import quality  # noqa: E402
from sft_testing import prepare_data  # noqa: E402

from posttrain.data.loader import preference_batches, sft_batches  # noqa: E402
from posttrain.data.store import load_split  # noqa: E402
from posttrain.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("quality"), data={"packing": False, "n_preference": 24})


def test_sft_rows_are_the_loaders_rows_with_the_same_trained_tokens(unpacked):
    order = quality.trained_order(sft_batches(unpacked, 8, seed=3), 3)
    again = sft_batches(unpacked, 8, seed=3)
    assert order == [int(i) for _ in range(3) for i in next(again)["index"]]  # the seeded permutation, replayed
    assert order != sorted(order)
    docs = quality.sft_documents(unpacked, order)
    rows = load_split(unpacked, "sft")[np.asarray(order)]
    for ids, labels, ours_ids, ours_labels in zip(docs["input_ids"], docs["labels"], rows["input_ids"], rows["labels"]):
        ours = {(t + 1, int(y)) for t, y in enumerate(ours_labels) if y != -100}  # posttrain: position t predicts t + 1
        theirs = {(t, y) for t, y in enumerate(labels) if y != -100}  # transformers: the label sits on its own token
        assert theirs == ours and ours
        assert ids == list(ours_ids[: len(ids)]) and len(ids) < len(ours_ids)  # the document, without the padding
        assert all(ids[t] == y for t, y in theirs)


def test_packed_rows_are_refused_by_name(tmp_path):
    packed = prepare_data(tmp_path, data={"packing": True, "max_seq_len": 256})
    rows = load_split(packed, "sft")[np.arange(4)]
    several = next(i for i in range(4)
                   if len(set(np.asarray(rows["document_ids"][i])[np.asarray(rows["labels"][i]) != -100])) > 1)
    with pytest.raises(SystemExit, match=rf"sft row {several}: \d trained documents"):
        quality.sft_documents(packed, [several])


def test_preference_pairs_split_at_the_first_trained_token(unpacked):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(unpacked / "tokenizer" / "tokenizer.json"))
    order = quality.trained_order(preference_batches(unpacked, 4, seed=1), 2)
    texts, expected = quality.preference_texts(load_split(unpacked, "preference"), order, tokenizer, "preference")
    rows = load_split(unpacked, "preference")[np.asarray(order)]
    for i, want in enumerate(expected):
        chosen = list(rows["chosen_input_ids"][i])
        labels = list(rows["chosen_labels"][i])
        first = labels.index(next(y for y in labels if y != -100))
        assert want["prompt_ids"] == chosen[: first + 1]
        assert want["prompt_ids"] + want["chosen_ids"] == chosen[: len(want["prompt_ids"]) + len(want["chosen_ids"])]
        assert want["chosen_ids"] == [y for y in labels if y != -100]  # every trained token, nothing else
        assert want["chosen_ids"] != want["rejected_ids"]
        assert texts["prompt"][i] == tokenizer.decode(want["prompt_ids"], skip_special_tokens=False)


def _saved(folder: Path, seed: int, ours: float, theirs: float, commit: str = "abc", threads: int = 1) -> Path:
    stages = {stage: {side: {"metrics": {"accuracy": value, "pass@1": value - 0.05, "pass@4": None, "nll": 0.2,
                                         "pref_acc": 0.9 if stage == "dpo" else None},
                             "wall_time_s": 120.0 * (2 if side == "trl" else 1),
                             **({"threads": threads} if side == "posttrain" else {}),
                             "train_loss": [1.0, 0.5] if side == "trl" else [1.0, 0.52]}
                      for side, value in (("posttrain", ours), ("trl", theirs))}
              for stage in quality.STAGES}
    folder.mkdir()
    env = {"cpu": "Test CPU", "cores": 2, "torch": "2.13.0", "transformers": "5", "trl": "1", "commit": commit,
           "torch_threads": 1,
           "date": "2026-12-04T00:00:00"}
    (folder / "quality.json").write_text(json.dumps({"seed": seed, "stages": stages, "environment": env,
                                                     "differences": ["a difference"]}))
    return folder


def test_the_table_gives_each_side_mean_and_spread_over_seeds(tmp_path, capsys):
    one, two = _saved(tmp_path / "s1", 1, 0.6, 0.5, threads=2), _saved(tmp_path / "s2", 2, 0.7, 0.5, commit="def")
    quality.main(["--table", str(one), str(two)])
    out = capsys.readouterr().out
    assert "TRL at 1 torch thread(s), posttrain's stages at 1, 2," in out and "commit abc, def, 2026-12-04;" in out
    assert "| sft | posttrain | 0.650 ± 0.071 | 0.600 ± 0.071 | – | 0.200 ± 0.000 | – | 2.0 ± 0.0 |" in out
    assert "| dpo | trl | 0.500 ± 0.000 | 0.450 ± 0.000 | – | 0.200 ± 0.000 | 0.900 ± 0.000 | 4.0 ± 0.0 |" in out
    assert "seeds 1, 2" in out and "- a difference" in out
    assert "first 10 steps (any seed): sft 0.0200, dpo 0.0200, grpo 0.0200." in out


def test_the_table_lists_every_seeds_differences_once(tmp_path, capsys):
    one, two = _saved(tmp_path / "s1", 1, 0.6, 0.5), _saved(tmp_path / "s2", 2, 0.7, 0.5)
    result = json.loads((two / "quality.json").read_text())
    (two / "quality.json").write_text(json.dumps({**result, "differences": ["a difference", "another"]}))
    quality.main(["--table", str(one), str(two)])
    out = capsys.readouterr().out
    assert out.count("- a difference") == 1 and "- another" in out


ON_POLICY = {"loss": "sigmoid", "reference": "precompute", "label_smoothing": 0.0, "pairs": "on_policy",
             "batch_size": 4, "steps": 3}


def test_on_policy_pairs_are_the_reward_scorings_in_the_stages_order(unpacked, tmp_path):
    """The reward stage's pairs.jsonl, in the shape it writes, tokenized by the DPO stage's own reader and drawn
    in its loader's order: pairs that only exist in the file, not in the prepared split."""
    from posttrain.rl.curation import write_pairs

    scoring = tmp_path / "reward"
    scoring.mkdir()
    prompts = [f"Sort ascending: {n}, {n + 7}, 3" for n in range(10)]
    write_pairs([{"prompt_index": n, "prompt_id": f"sort-{n}", "prompt": [{"role": "user", "content": prompts[n]}],
                  "chosen": f"#### 3, {n}, {n + 7}", "rejected": f"#### {n}, 3, {n + 7}",
                  "chosen_reward": 1.0, "rejected_reward": 0.0} for n in range(10)], scoring / "pairs.jsonl")
    data_cfg = {"max_seq_len": 64, "truncation": "right"}
    rows, order, source = quality.trained_pairs(unpacked, scoring, ON_POLICY, data_cfg, seed=1)
    assert len(rows) == 10 and source.endswith("reward/pairs.jsonl")
    assert len(order) == 12 and len(set(order[:8])) == 8 and set(order) <= set(range(10))  # 2 full batches an epoch
    stage = quality.dpo_stage()  # what the DPO stage itself draws from the same folder
    args = argparse.Namespace(pairs=str(scoring), data=str(unpacked))
    cfg = {"dpo": ON_POLICY, "data": data_cfg, "seed": 1}
    drawn, files = stage.training_pairs(args, cfg, Tokenizer(unpacked / "tokenizer"), 4, 0, 1)
    assert quality.trained_order(drawn, 3) == order and files == [scoring / "pairs.jsonl"]
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(unpacked / "tokenizer" / "tokenizer.json"))
    texts, expected = quality.preference_texts(rows, order, tokenizer, source)
    assert all(prompts[order[i]].split(": ")[1] in texts["prompt"][i] for i in range(len(order)))
    assert all(t.startswith("#### 3") for t in texts["chosen"])
    with pytest.raises(SystemExit, match="its lineage names none"):
        quality.trained_pairs(unpacked, None, ON_POLICY, data_cfg, seed=1)


def _record(results: Path, stage: str, key: str, upstream: dict[str, str]) -> None:
    folder = results / {"prepare_data": "data"}.get(stage, stage) / key
    folder.mkdir(parents=True)
    (folder / "posttrain.json").write_text(json.dumps({"stage": stage, "key": key, "upstream": upstream}))


def test_the_evaluation_of_a_stage_output_is_its_finished_one(tmp_path):
    _record(tmp_path, "sft", "s0", {})
    evals = tmp_path / "eval"
    evals.mkdir()
    for key in ("a-never-ran", "b-finished"):  # a dry run under other code plans an evaluation it never runs
        (evals / f"{key}.config.json").write_text(json.dumps({"upstream": {"sft": "s0"}, "key": key}))
    (evals / "b-finished").mkdir()
    (evals / "b-finished" / "metrics.json").write_text("{}")
    out, cfg = quality.evaluation_of(tmp_path / "sft" / "s0")
    assert out == evals / "b-finished" and cfg["key"] == "b-finished"
    (evals / "b-finished" / "metrics.json").unlink()
    with pytest.raises(SystemExit, match="a-never-ran, .*b-finished: the evaluation of .* has not finished"):
        quality.evaluation_of(tmp_path / "sft" / "s0")


def test_a_retrained_stage_is_evaluated_afresh(tmp_path, monkeypatch):
    """Rerunning a TRL stage into the same --out: the earlier evaluation (of the model it replaced) is removed
    before the evaluate stage runs, which would refuse an output of another run."""
    stale = tmp_path / "eval" / "dpo"
    stale.mkdir(parents=True)
    (stale / "metrics.json").write_text('{"accuracy": 0.1}')
    seen = []

    def run(command, **_):
        seen.append(stale.exists())
        stale.mkdir()
        (stale / "metrics.json").write_text('{"accuracy": 0.7}')

    monkeypatch.setattr(quality.subprocess, "run", run)
    metrics = quality.evaluate({"stage": "evaluate"}, tmp_path, tmp_path / "dpo", stale, None)
    assert seen == [False] and metrics == {"accuracy": 0.7}


def test_a_run_with_on_policy_dpo_names_each_reward_scoring_by_what_read_it(tmp_path):
    for stage, key, upstream in [("prepare_data", "d0", {}), ("sft", "s0", {"prepare_data": "d0"}),
                                 ("reward", "r-sft", {"prepare_data": "d0", "sft": "s0"}),
                                 ("dpo", "p0", {"prepare_data": "d0", "sft": "s0", "reward": "r-sft"}),
                                 ("reward", "r-dpo", {"prepare_data": "d0", "dpo": "p0"}),
                                 ("grpo", "g0", {"prepare_data": "d0", "dpo": "p0", "reward": "r-dpo"})]:
        _record(tmp_path, stage, key, upstream)
    folders = quality.run_folders(tmp_path / "grpo" / "g0", quality.STAGES)
    assert folders["reward"] == tmp_path / "reward" / "r-dpo" and folders["dpo_pairs"] == tmp_path / "reward" / "r-sft"
    assert folders["grpo"] == tmp_path / "grpo" / "g0" and folders["sft"] == tmp_path / "sft" / "s0"


def test_update_rewrites_only_the_named_block(tmp_path, capsys):
    one = _saved(tmp_path / "s1", 1, 0.6, 0.5)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- quality:begin -->\nkept\n<!-- quality:end -->\n<!-- quality-sort:begin -->\nold\n"
                   "<!-- quality-sort:end -->\n")
    quality.main(["--table", str(one), "--update", str(doc), "--block", "quality-sort"])
    text = doc.read_text()
    assert "kept" in text and "old" not in text
    assert text.index("quality-sort:begin") < text.index("| sft | posttrain | 0.600 |") < text.index("quality-sort:end")


def test_differences_name_only_the_compared_stages():
    """A DPO output's config has no `grpo` section: comparing SFT and DPO alone must not read it."""
    dpo_output = {"dpo": {"chosen_nll_weight": 1.0}}
    assert quality.differences(dpo_output, ["sft", "dpo"]) == [
        "the chosen-NLL term: posttrain averages it per sequence, TRL's `sft` loss per token of the batch"]
    grpo_output = {**dpo_output, "grpo": {"dynamic_sampling": True, "max_resamples": 3, "advantage": "rloo"}}
    found = quality.differences(grpo_output, ["sft", "dpo", "grpo"])
    assert len(found) == 3 and found[0].startswith("grpo.dynamic_sampling") and "rloo" in found[1]


def _stage_output(results: Path, key: str, grpo: dict, upstream: dict, accuracy: float) -> Path:
    """A GRPO output and its evaluation, as the workflow lays them out (`evaluation_of` finds it by upstream)."""
    from posttrain.utils.provenance import write_provenance

    folder = results / "grpo" / key
    folder.mkdir(parents=True)
    write_provenance(folder, {"key": key, "upstream": upstream, "seed": 1, "grpo": grpo}, "grpo", time.time() - 60, {})
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    evaluation = results / "eval" / f"e{key}"
    evaluation.mkdir(parents=True)
    (results / "eval" / f"e{key}.config.json").write_text(json.dumps({"upstream": {"grpo": key}}))
    (evaluation / "metrics.json").write_text(json.dumps({"accuracy": accuracy, "pass@1": accuracy, "nll": 0.3}))
    return folder


def test_a_control_joins_the_comparison_as_a_side_named_by_its_own_settings(tmp_path, capsys):
    upstream = {"prepare_data": "d", "dpo": "p", "reward": "r"}
    run = _stage_output(tmp_path / "results", "run", {"dynamic_sampling": True, "lr": 1e-5}, upstream, 0.6)
    control = _stage_output(tmp_path / "results", "ctl", {"dynamic_sampling": False, "lr": 1e-5}, upstream, 0.55)
    saved = _saved(tmp_path / "s1", 1, 0.6, 0.5)
    result = json.loads((saved / "quality.json").read_text())
    result["stages"]["grpo"]["posttrain"]["folder"] = str(run)
    (saved / "quality.json").write_text(json.dumps(result))
    quality.main(["--control", str(control), "--out", str(saved)])
    side = json.loads((saved / "quality.json").read_text())["stages"]["grpo"]["controls"]
    assert list(side) == ["posttrain, grpo.dynamic_sampling=false"]  # lr is the same: not in the name
    assert side["posttrain, grpo.dynamic_sampling=false"]["metrics"]["accuracy"] == 0.55
    capsys.readouterr()
    quality.main(["--table", str(saved)])
    assert "| grpo | posttrain, grpo.dynamic_sampling=false | 0.550 | 0.550 | – | 0.300 | – | 1.0 |" in capsys.readouterr().out
    # A run that starts elsewhere (another DPO model) is no control of this one.
    other = _stage_output(tmp_path / "results", "oth", {"dynamic_sampling": False}, {**upstream, "dpo": "q"}, 0.5)
    with pytest.raises(SystemExit, match="a control must differ only in its own stage's settings"):
        quality.main(["--control", str(other), "--out", str(saved)])
