"""A pretrained reward model (`reward_model.source`: a folder with a sequence-classification head and a tokenizer
of its own), made here: the reward stage scores samples with it as transformers does on the conversation its own
chat template renders, the score normalized per prompt; GRPO takes its signal; the plan keys its content and
trains none; the dry run refuses what is no reward model."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from eval_fixtures import make_data, make_model, run_stage, write_config
from grpo_testing import GRPO_SCRIPT, grpo_config, step_records
from posttrain.data.store import load_split
from posttrain.rewards.reward_model import PretrainedRewardModel, normalize_scores
from posttrain.rollouts import RewardFunction, Sample
from posttrain.tokenizer import Tokenizer, train_bpe_tokenizer
from posttrain.workflow.plan import build_plan
from posttrain.workflow.schema import ConfigError, load_config, validate_config
from sft_testing import ROOT, env_for

transformers = pytest.importorskip("transformers")

K = 2  # samples per prompt
# The reward model's own template: ChatML behind a header, so that a policy-side rendering would not match.
TEMPLATE = ("Rate this conversation.\n{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}")


def make_reward_model(folder: Path, seed: int = 0, **config) -> Path:
    """A tiny Qwen3ForSequenceClassification written by transformers, with a BPE tokenizer trained on other text."""
    texts = [f"Question {i}: what is {i} plus {2 * i}? The reply is {3 * i}." for i in range(200)]
    tok = train_bpe_tokenizer(texts, 280, folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}))
    hf = transformers.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=tok.pad_id,
                                  eos_token_id=tok.eos_id, **{"num_labels": 1, **config})
    torch.manual_seed(seed)
    transformers.Qwen3ForSequenceClassification(hf).save_pretrained(folder)
    return folder


def transformers_scores(folder: Path, prompts: list[str], completions: list[str]) -> torch.Tensor:
    """What transformers gives for the same conversations: its tokenizer's template, its model's logits."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False)
             for p, c in zip(prompts, completions)]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return model(**batch).logits[:, 0].double()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrained-rm")
    with pytest.MonkeyPatch.context() as mp:
        data = make_data(tmp / "results", mp)
    policy = make_model(tmp / "results", Tokenizer(data / "tokenizer"), "dpo", "policy-key", {}, seed=1)
    rm = make_reward_model(tmp / "rm")
    return {"tmp": tmp, "data": data, "policy": policy, "rm": rm}


def test_the_reward_stage_scores_with_a_pretrained_model_as_transformers_does(setup, tmp_path, monkeypatch):
    policy_tok, rm_tok = Tokenizer(setup["data"] / "tokenizer"), Tokenizer(setup["rm"])
    assert policy_tok.vocab_size != rm_tok.vocab_size  # its own tokenizer: the policy's ids would be wrong
    cfg = load_config(ROOT / "config" / "config.yaml")
    cfg["reward"].update(n_prompts=4, samples_per_prompt=K, max_new_tokens=6, verifiers=["format"])
    cfg["reward_model"]["source"] = str(setup["rm"])
    cfg.update(stage="reward", key="reward-pretrained", upstream={})
    out = tmp_path / "reward"
    run_stage("reward", ["--config", write_config(tmp_path / "reward.json", cfg), "--data", setup["data"], "--model",
                         setup["policy"], "--out", out], monkeypatch)
    rollouts = pd.read_parquet(out / "rollouts.parquet")
    prompts = [json.loads(r["example"])["prompt"] for r in load_split(setup["data"], "prompts").to_list()]
    expected = transformers_scores(setup["rm"], [prompts[i] for i in rollouts["prompt_index"]], list(rollouts["completion"]))
    assert (expected - torch.tensor(rollouts["reward/rm"].to_numpy())).abs().max().item() <= 1e-5
    # normalized within each prompt's samples, then added (weight 1 in the reward stage) to the verifier's value
    norm = normalize_scores(list(rollouts["reward/rm"]), K, "group")
    assert rollouts["reward/rm_norm"].tolist() == norm and {round(abs(v), 9) for v in norm} <= {0.0, 1.0}
    assert (rollouts["reward"] - rollouts["reward/format"] - rollouts["reward/rm_norm"]).abs().max() < 1e-12
    assert json.loads((out / "stats.json").read_text())["reward_mean_by_component"]["rm"] == pytest.approx(
        float(expected.mean()), abs=1e-5)


def test_grpo_weighs_the_normalized_score(setup, tmp_path):
    """In-process: GRPO's reward function adds rm_weight x the per-group z-score of the model's score; in a run, a
    verifier that scores every sample alike leaves only the reward model's signal."""
    fn = RewardFunction(["format"], rm_weight=0.5, pretrained=str(setup["rm"]))
    texts = ["#### 12", "so 12", "#### 7", "#### 7"]
    examples = [{"prompt": "What is 5 + 7?", "answer": "12", "task": ""}] * 2 + [{"prompt": "2 + 5?", "answer": "7"}] * 2
    samples = [Sample([0], [], [], "stop", text) for text in texts]
    rewards, correct, components = fn.scores(samples, examples, group_size=2)
    raw = transformers_scores(setup["rm"], [e["prompt"] for e in examples], texts)
    assert [c["rm"] for c in components] == pytest.approx(raw.tolist(), abs=1e-5)
    z = normalize_scores([c["rm"] for c in components], 2, "group")
    assert rewards == pytest.approx([f + 0.5 * m for f, m in zip([1.0, 0.0, 1.0, 1.0], z)], abs=1e-12)
    assert z[2:] == [0.0, 0.0] and correct == [True, False, True, True]  # identical completions: one score, no spread
    assert PretrainedRewardModel(setup["rm"]).texts(["hi"], ["yo"]) == [
        "Rate this conversation.\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"]

    cfg = grpo_config("rm", data={"n_prompts": 4}, reward={"verifiers": ["format"]}, steps=2, checkpoint_every=2,
                      prompts_per_step=4, group_size=2, max_new_tokens=6, eval_prompts=2, rm_weight=1.0)
    cfg["reward_model"]["source"] = str(setup["rm"])
    out = tmp_path / "grpo"
    proc = subprocess.run([sys.executable, str(GRPO_SCRIPT), "--config", str(write_config(tmp_path / "grpo.json", cfg)),
                           "--data", str(setup["data"]), "--model", str(setup["policy"]), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=env_for(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for record in step_records(out):
        assert record["reward/format"] == 0.0 and "reward/rm" in record  # the verifier gives no signal ...
        assert record["reward/rm_norm"] == pytest.approx(0.0, abs=1e-9)  # ... the z-scores do, mean 0 per group
        assert record["reward_std"] > 0 and record["zero_signal_frac"] < 1


def test_the_plan_keys_the_folder_and_trains_no_reward_model(setup, tmp_path):
    rm = make_reward_model(tmp_path / "rm")
    cfg = load_config(ROOT / "config" / "config.yaml", overrides={
        "ablations": None, "results": str(tmp_path / "results"), "reward_model": {"source": str(rm)},
        "grpo": {"rm_weight": 0.5}})
    plan = build_plan(cfg)
    assert "reward_model" not in plan.jobs
    keys = {stage: next(iter(plan.jobs[stage].values())) for stage in ("reward", "grpo", "sft")}
    for stage in ("reward", "grpo"):
        assert keys[stage].resolved["files"]["reward_model.source"]["sha256"]
    assert "reward_model.source" not in keys["sft"].resolved["files"]
    weights = rm / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\1")  # a changed weight
    again = build_plan(cfg)
    for stage in ("reward", "grpo"):
        assert next(iter(again.jobs[stage])) != keys[stage].key
    assert next(iter(again.jobs["sft"])) == keys["sft"].key


def test_the_dry_run_refuses_what_is_no_reward_model(setup, tmp_path):
    base = load_config(ROOT / "config" / "config.yaml")

    def problem(source: str, **grpo) -> str:
        cfg = copy.deepcopy(base)
        cfg["reward_model"]["source"] = source
        cfg["grpo"].update(grpo)
        with pytest.raises(ConfigError) as err:
            validate_config(cfg, where="test.yaml")
        return str(err.value)

    ok = copy.deepcopy(base)
    ok["reward_model"]["source"] = str(setup["rm"])
    validate_config(ok)
    causal = setup["policy"]  # a causal LM: no score head
    assert f"reward_model.source: {causal}/config.json: architectures ['Qwen3ForCausalLM'] declare no " \
           "sequence-classification head" in problem(str(causal))
    two = make_reward_model(tmp_path / "two", num_labels=2)
    assert f"reward_model.source: {two}/config.json: num_labels is 2; a reward model has 1" in problem(str(two))
    assert f"reward_model.source: {tmp_path / 'none'}: no such folder" in problem(str(tmp_path / "none"))
    assert "grpo.critic_init: reward_model: the critic values the policy's tokens, and the pretrained reward model" in \
        problem(str(setup["rm"]), advantage="gae", critic_init="reward_model")
