"""Evaluation: pass@k against enumeration, exact metrics on a known answer table, NLL and
preference accuracy against full-logit references, lm-eval plumbing and its skip reasons."""

import importlib.util
import itertools
import json
from collections import Counter
from fractions import Fraction
from math import comb

import pytest
import torch
import torch.nn.functional as F
from eval_fixtures import DATA_KEY, DPO_CFG, make_data, make_model, run_stage, write_config

from posttrain.model_files import load_hf_model
from posttrain.data.loader import length_multiple, sft_batches
from posttrain.data.store import load_split
from posttrain.evaluation import PromptResult, eval_pairs, heldout_nll, mean_pass_at_k, pass_at_k, task_metrics
from posttrain.evaluation.lm_eval import LmEvalError, run_lm_eval
from posttrain.generation import GenerationOutput
from posttrain.generation.backend import NativeBackend
from posttrain.workflow.schema import ConfigError, load_config
from posttrain.tokenizer import Tokenizer
from posttrain.training.setup import initial_model, model_config

SFT_KEY, DPO_KEY = "5f75f75f75f7", "d90d90d90d90"


# ----- pass@k -----

def test_pass_at_k_equals_enumeration_of_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                expected = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)
    assert mean_pass_at_k([0, 4], 4, 2) == 0.5


def test_task_metrics_on_a_controlled_table():
    table = [  # task, greedy correct, samples correct (of 4), length, truncated
        ("a", True, 4, 3, False), ("a", False, 1, 5, True), ("b", False, 0, 8, True), ("b", True, 2, 4, False),
    ]
    results = [PromptResult(t, ok, {"task": float(ok), "format": 1.0}, n, tr, c) for t, ok, c, n, tr in table]
    m = task_metrics(results, [1, 2], samples=4)
    assert m["accuracy"] == 0.5
    assert m["pass@1"] == (4 + 1 + 0 + 2) / 16
    assert m["pass@2"] == pytest.approx((1 + (1 - 3 / 6) + 0 + (1 - 1 / 6)) / 4)
    assert m["reward"] == 1.5 and m["reward_by_verifier"] == {"task": 0.5, "format": 1.0}
    assert m["response_len"] == 5.0 and m["truncated"] == 0.5
    assert m["per_task"]["a"]["accuracy"] == 0.5 and m["per_task"]["b"]["pass@1"] == 2 / 8
    with pytest.raises(ValueError, match="k <= n"):
        task_metrics(results, [5], samples=4)


# ----- the stage -----

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("results")
    data = make_data(root, mp)
    tok = Tokenizer(data / "tokenizer")
    make_model(root, tok, "sft", SFT_KEY, {"prepare_data": DATA_KEY}, seed=1)
    make_model(root, tok, "dpo", DPO_KEY, {"prepare_data": DATA_KEY, "sft": SFT_KEY}, seed=2, extra={"dpo": DPO_CFG})
    mp.undo()
    return root


def eval_config(root, name, model_stage, model_key, **eval_overrides):
    ev = {"n_prompts": 8, "max_new_tokens": 6, "pass_k": [1, 2], "samples": 3, "temperature": 1.0,
          "lm_eval_tasks": [], "lm_eval_optional": False, **eval_overrides}
    upstream = {"prepare_data": DATA_KEY, **({model_stage: model_key} if model_stage else {})}
    cfg = {"stage": "evaluate", "key": name, "upstream": upstream, "seed": 0, "loggers": [],
           "model": {"policy": "tiny", "backend": "auto"}, "data": {"max_seq_len": 64}, "reward": {"verifiers": ["task", "format"]}, "eval": ev,
           "environment": {"fn": None, "max_turns": 4, "max_tokens": 256, "args": {}}}
    return write_config(root / "eval" / f"{name}.config.json", cfg)


def run_eval(root, monkeypatch, name, stage, key, **eval_overrides):
    out = root / "eval" / name
    run_stage("evaluate", ["--config", eval_config(root, name, stage, key, **eval_overrides),
                           "--data", root / "data" / DATA_KEY, "--model", root / stage / key, "--out", out], monkeypatch)
    return out, json.loads((out / "metrics.json").read_text())


def test_known_answer_table_gives_exact_metrics(results, monkeypatch):
    """Generation replaced by a table: greedy right on rows {0, 2, 3, 5}, row i has i % 4 of its 3 samples right."""
    data = results / "data" / DATA_KEY
    tok = Tokenizer(data / "tokenizer")
    rows = load_split(data, "eval").select(range(8))
    index = {tuple(ids.tolist()): i for i, ids in enumerate(rows["prompt_ids"])}
    answers, tasks = rows["answer"], rows["task"]
    greedy_right, samples_right = {0, 2, 3, 5}, [i % 4 for i in range(8)]  # 0..3 of 3 samples right
    lengths = {}

    def table_generate(backend, prompts, params, seed):
        seen, tokens = Counter(), []
        for p in prompts:
            i = index[tuple(p)]
            right = i in greedy_right if params.temperature == 0 else seen[i] < samples_right[i]
            seen[i] += 1
            ids = tok.encode(f"#### {answers[i]}" if right else "no idea") + [tok.eos_id]
            if params.temperature == 0:
                lengths[i] = len(ids)
            tokens.append(ids)
        return GenerationOutput(tokens, [[0.0] * len(t) for t in tokens], ["stop"] * len(tokens))

    monkeypatch.setattr(NativeBackend, "generate", table_generate)
    out, m = run_eval(results, monkeypatch, "table00000000", "dpo", DPO_KEY)
    assert m["n_prompts"] == 8
    assert m["accuracy"] == 4 / 8
    assert m["pass@1"] == (0 + 1 + 2 + 3) * 2 / 24  # mean of c / n
    assert m["pass@2"] == pytest.approx((0 + (1 - comb(2, 2) / comb(3, 2)) + 1 + 1) / 4)
    assert m["reward"] == 2 * 4 / 8 and m["reward_by_verifier"] == {"task": 0.5, "format": 0.5}
    assert m["response_len"] == sum(lengths.values()) / 8 and m["truncated"] == 0.0
    for task in set(tasks):
        mine = [i for i in range(8) if tasks[i] == task]
        assert m["per_task"][task]["accuracy"] == sum(i in greedy_right for i in mine) / len(mine)
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(logged) == 8 and all(len(r["samples"]) == 3 for r in logged)
    assert [r["correct"] for r in logged] == [i in greedy_right for i in range(8)]
    assert m["lm_eval"] == {"skipped": "eval.lm_eval_tasks is empty"}
    provenance = json.loads((out / "posttrain.json").read_text())
    assert provenance["stage"] == "evaluate" and provenance["metrics"]["accuracy"] == 0.5

    # Held-out NLL against a full-logit cross-entropy over the same split.
    model = load_hf_model(results / "dpo" / DPO_KEY)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in sft_batches(data, 4, seed=0, split="sft_eval", shuffle=False, loop=False):
            logits = model.logits(model(batch["input_ids"], document_ids=batch["document_ids"]))
            labels = batch["labels"]
            total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    assert m["nll_tokens"] == count
    assert m["nll"] == pytest.approx(total / count, rel=1e-5)

    # Implicit preference accuracy against per-sequence full-logit log-probs of policy and reference.
    reference = load_hf_model(results / "sft" / SFT_KEY)
    pairs = eval_pairs([json.loads(e) for e in rows["example"]], tok, 64)

    def logp(net, ids, labels):
        with torch.no_grad():
            lp = net.logits(net(torch.tensor([ids])))[0].log_softmax(-1)
        return sum(lp[t, y].item() for t, y in enumerate(labels) if y != -100)

    wins = 0
    for i in range(len(pairs["chosen_input_ids"])):
        margin = 0.0
        for side, sign in (("chosen", 1), ("rejected", -1)):
            ids, labels = pairs[f"{side}_input_ids"][i], pairs[f"{side}_labels"][i]
            margin += sign * (logp(model, ids, labels) - logp(reference, ids, labels))
        wins += margin > 0
    assert m["pref_pairs"] == 8
    assert m["pref_acc"] == wins / 8
    assert m["pref_reference"].endswith(f"sft/{SFT_KEY}")


def test_real_generation_on_an_sft_model(results, monkeypatch):
    out, m = run_eval(results, monkeypatch, "sftev0000000", "sft", SFT_KEY)
    assert m["stage"] == "sft" and m["model_key"] == SFT_KEY
    for key in ("accuracy", "pass@1", "pass@2", "reward", "response_len", "nll", "ppl"):
        assert isinstance(m[key], float), key
    assert 1 <= m["response_len"] <= 6
    assert m["pref_acc"] is None and "dpo only" in m["pref_acc_note"]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 8


def test_without_a_model_the_base_model_is_evaluated_as_sft_starts_from_it(results, monkeypatch):
    """Stage zero: model.policy's seeded init (a preset here), the weights SFT's build begins with."""
    out = results / "eval" / "base00000000"
    run_stage("evaluate", ["--config", eval_config(results, "base00000000", None, None),
                           "--data", results / "data" / DATA_KEY, "--out", out], monkeypatch)
    m = json.loads((out / "metrics.json").read_text())
    assert m["stage"] == "base" and m["model_key"] is None and m["source"] == "tiny"
    assert m["pref_acc"] is None and "a base model has no implicit preference reward" in m["pref_acc_note"]
    assert "preset" in m["lm_eval"]["skipped"]
    data = results / "data" / DATA_KEY
    tok = Tokenizer(data / "tokenizer")

    def nll(seed: int) -> float:
        batches = sft_batches(data, 16, seed=0, split="sft_eval", shuffle=False, loop=False, multiple=length_multiple(False))
        return heldout_nll(initial_model("tiny", model_config("tiny", tok), seed), batches, total=len(batches))["nll"]

    assert m["nll"] == nll(0) != nll(1)  # the run's seed (0) decides the init


@pytest.mark.parametrize("change, error, message", [
    (lambda cfg: cfg["reward"].pop("verifiers"), KeyError, "config key 'reward.verifiers' is missing from"),
])
def test_config_errors_name_the_key(results, monkeypatch, change, error, message):
    """A stage trusts what the schema and the dry run checked (eval.pass_k <= eval.samples is theirs:
    tests/workflow/test_workflow.py); what it reads must be there."""
    path = eval_config(results, "bad000000000", "sft", SFT_KEY)
    cfg = json.loads(path.read_text())
    change(cfg)
    write_config(path, cfg)
    with pytest.raises(error, match=message):
        run_stage("evaluate", ["--config", path, "--data", results / "data" / DATA_KEY,
                               "--model", results / "sft" / SFT_KEY, "--out", results / "eval" / "bad"], monkeypatch)


# ----- lm-evaluation-harness -----

FAKE_MAIN = """
import json, sys
from pathlib import Path
args = sys.argv[1:]
if "fail" in args[args.index("--tasks") + 1]:
    print("ConnectionError: cannot reach the hub for task data")
    sys.exit(1)
out = Path(args[args.index("--output_path") + 1]) / "model"
out.mkdir(parents=True)
(out / "results_2026.json").write_text(json.dumps({"results": {"toy": {"acc,none": 0.25}}}))
"""


def test_lm_eval_results_and_skip_reasons(tmp_path, monkeypatch):
    if importlib.util.find_spec("lm_eval") is None:
        assert "not installed" in run_lm_eval(tmp_path, ["toy"], tmp_path, "cpu")["skipped"]
    fake = tmp_path / "site" / "lm_eval"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_MAIN)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    assert run_lm_eval(tmp_path, ["toy"], tmp_path, "cpu") == {"tasks": ["toy"], "results": {"toy": {"acc,none": 0.25}}}
    failed = run_lm_eval(tmp_path, ["fail"], tmp_path, "cpu")
    assert "status 1" in failed["skipped"] and "ConnectionError" in failed["skipped"]
    assert "ConnectionError" in (tmp_path / "lm_eval.log").read_text()
    assert run_lm_eval(tmp_path, [], tmp_path, "cpu") == {"skipped": "eval.lm_eval_tasks is empty"}
    # Not optional (the default): the same failure stops the stage with one line naming the key.
    with pytest.raises(LmEvalError, match=r"eval\.lm_eval_tasks \['fail'\]: lm-eval exited with status 1.*lm_eval_optional"):
        run_lm_eval(tmp_path, ["fail"], tmp_path, "cpu", optional=False)
    assert run_lm_eval(tmp_path, ["toy"], tmp_path, "cpu", optional=False)["results"] == {"toy": {"acc,none": 0.25}}


def test_lm_eval_tasks_without_the_harness_stop_the_dry_run_unless_optional(monkeypatch):
    """Requested tasks where lm-eval is not installed: the dry run names the key; lm_eval_optional lets them skip."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"eval\.lm_eval_tasks: \['hellaswag'\]: lm-evaluation-harness is not installed"):
        load_config(overrides={"eval": {"lm_eval_tasks": ["hellaswag"]}})
    assert load_config(overrides={"eval": {"lm_eval_tasks": ["hellaswag"], "lm_eval_optional": True}})["eval"]["lm_eval_optional"]
    with pytest.raises(LmEvalError, match="not installed"):
        run_lm_eval(".", ["hellaswag"], ".", "cpu", optional=False)
    assert "not installed" in run_lm_eval(".", ["hellaswag"], ".", "cpu", optional=True)["skipped"]
