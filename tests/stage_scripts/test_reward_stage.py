"""The reward_model and reward stages end to end on a small sort task: reward model accuracy and its
folder scored as transformers does, determinism, the pass-rate band, on-policy pairs, and verifier errors
naming the prompt."""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from eval_fixtures import run_stage as run_script

import posttrain.generation.backend
from posttrain.model_files import save_hf_model
from posttrain.data.sources import canonical_rows, load_source
from posttrain.data.store import load_split
from posttrain.generation import GenerationOutput, SamplingParams
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import Tokenizer
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.schema import load_config

ROOT = Path(__file__).resolve().parents[2]
K = 4
OUTPUTS = ("rollouts.parquet", "pass_rates.parquet", "grpo_prompts.parquet", "pairs.jsonl", "stats.json")
# Sorting 4 single digits: the reward model only has to notice an out-of-order pair.
DATA = {"tasks": [{"name": "sort", "length": 4, "max_value": 9}], "n_sft": 20, "n_preference": 600,
        "n_prompts": 16, "n_eval": 8, "vocab_size": 300, "max_seq_len": 48}
# A small decoder: it learns the task's preferences in ~250 steps (20-50 s on one core).
SMALL = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}
# A user verifier whose pass rates are mixed on a random policy; and one that fails on one prompt.
VERIFIERS = textwrap.dedent('''
    def even_length(completion, example):
        return float(len(completion) % 2 == 0)

    def raise_on_third(completion, example):
        if example["id"] == FAILING_ID:
            raise KeyError("no such field")
        return 1.0

    def nan_on_third(completion, example):
        return float("nan") if example["id"] == FAILING_ID else 1.0
''')


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and OpenMP spin-waits on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(stage: str, key: str, **sections: dict[str, Any]) -> dict[str, Any]:
    cfg = load_config(ROOT / "config" / "config.yaml")
    for name, values in sections.items():
        cfg[name].update(values)
    cfg.update(stage=stage, key=key, upstream={})
    return copy.deepcopy(cfg)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Prepared data, a random small policy folder with provenance, a verifier module."""
    tmp = tmp_path_factory.mktemp("reward")
    config = tmp / "data.json"
    config.write_text(json.dumps(_config("prepare_data", "data-key", data=DATA)))
    with pytest.MonkeyPatch.context() as mp:
        run_script("prepare_data", ["--config", config, "--out", tmp / "data"], mp)
    tok = Tokenizer(tmp / "data" / "tokenizer")
    hf = {**preset_config("tiny", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id), **SMALL}
    torch.manual_seed(0)
    policy = tmp / "policy"
    save_hf_model(Transformer(hf).state_dict(), hf, policy)
    tok.save(policy)
    write_provenance(policy, {"key": "policy-key"}, "dpo", 0.0, {})
    rows = load_split(tmp / "data", "prompts").to_list()
    (tmp / "user_verifiers.py").write_text(f"FAILING_ID = {rows[2]['id']!r}\n" + VERIFIERS)
    return {"tmp": tmp, "data": tmp / "data", "policy": policy, "tok": tok, "rows": rows}


def run_stage(setup: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch, seed: int = 1234,
              reward_model: Path | None = None, rm_section: dict[str, Any] | None = None, **reward: Any) -> Path:
    """The reward stage in this process, as `python stages/reward.py` runs it (through `run_main`)."""
    settings = {"n_prompts": 8, "samples_per_prompt": K, "max_new_tokens": 8, "verifiers": ["user_verifiers:even_length"],
                **reward}
    cfg = _config("reward", f"reward-{out.name}", data=DATA, reward=settings, reward_model=rm_section or {})
    cfg["seed"] = seed
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(cfg))
    monkeypatch.syspath_prepend(str(setup["tmp"]))
    rm = ["--reward_model", reward_model] if reward_model else []
    run_script("reward", ["--config", config, "--data", setup["data"], "--model", setup["policy"], *rm, "--out", out],
               monkeypatch)
    return out


def train_reward_model(setup: dict[str, Any], out: Path, monkeypatch: pytest.MonkeyPatch, **section: Any) -> Path:
    cfg = _config("reward_model", f"rm-{out.name}", data=DATA, reward_model={"source": "train", **section})
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(cfg))
    run_script("reward_model", ["--config", config, "--data", setup["data"], "--model", setup["policy"], "--out", out],
               monkeypatch)
    return out


@pytest.mark.slow
def test_reward_model_accuracy_and_transformers_parity(setup, tmp_path, monkeypatch):
    """The reward_model stage learns the task's preferences; the reward stage scores samples with it, as
    transformers' sequence classifier does."""
    transformers = pytest.importorskip("transformers")
    rm = train_reward_model(setup, tmp_path / "rm", monkeypatch, steps=250, lr=3e-3, warmup_steps=25)
    stats = json.loads((rm / "posttrain.json").read_text())["metrics"]
    assert stats["held_out_pairs"] == 60 and stats["train_pairs"] == 540
    assert stats["held_out_accuracy_before"] < 0.75
    assert stats["held_out_accuracy"] >= 0.9, stats
    records = [json.loads(line) for line in (rm / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 251))
    assert [r["step"] for r in records if "held_out_accuracy" in r] == list(range(0, 251, 25))  # eval_every: 25
    assert records[-1] == {"step": 250, "held_out_accuracy": stats["held_out_accuracy"]}
    assert not (tmp_path / "rm.resume").exists()

    # The folder is a sequence classifier that transformers scores exactly as the reward stage did.
    out = run_stage(setup, tmp_path / "scored", monkeypatch, reward_model=rm)
    config = json.loads((rm / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and config["num_labels"] == 1
    rollouts = pd.read_parquet(out / "rollouts.parquet")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm).eval()
    pad = setup["tok"].pad_id
    sequences = [list(p) + list(c) for p, c in zip(rollouts["prompt_ids"], rollouts["completion_ids"])]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        expected = hf(ids, attention_mask=(ids != pad).long()).logits.squeeze(-1)
    assert (expected - torch.tensor(rollouts["reward/rm"].to_numpy())).abs().max().item() <= 1e-4
    # The reward adds the score standardized within each prompt's samples (reward_model.normalize: group).
    for _, group in rollouts.groupby("prompt_index"):
        raw = torch.tensor(group["reward/rm"].to_numpy(), dtype=torch.float64)
        z = (raw - raw.mean()) / raw.std(unbiased=False)
        assert torch.allclose(torch.tensor(group["reward/rm_norm"].to_numpy()), z, atol=1e-9)
    assert (rollouts["reward"] - rollouts["reward/rm_norm"] - rollouts["reward/user_verifiers:even_length"]).abs().max() < 1e-9


def test_scoring_is_deterministic_for_a_seed(setup, tmp_path, monkeypatch):
    a = run_stage(setup, tmp_path / "a", monkeypatch)
    b = run_stage(setup, tmp_path / "b", monkeypatch)
    c = run_stage(setup, tmp_path / "c", monkeypatch, seed=99)
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "rollouts.parquet").read_bytes() != (c / "rollouts.parquet").read_bytes()

    rollouts = pd.read_parquet(a / "rollouts.parquet")
    assert len(rollouts) == 8 * K and rollouts["policy_key"].eq("policy-key").all()
    assert rollouts["sample"].tolist() == list(range(K)) * 8
    tok = setup["tok"]
    for row in rollouts.itertuples():
        assert len(row.logprobs) == len(row.completion_ids) and max(row.logprobs) <= 0
        assert row.completion == tok.decode(row.completion_ids)
        stopped = row.completion_ids[-1] in tok.eos_ids
        assert row.finish_reason == ("stop" if stopped else "length")
        assert row.correct == (len(row.completion) % 2 == 0) == (row.reward == 1.0)
    provenance = json.loads((a / "posttrain.json").read_text())
    assert provenance["stage"] == "reward" and provenance["metrics"]["rollouts_per_s"] > 0


class KnownPassRates:
    """A backend whose sample s of prompt i is right when s < i % (K + 1): pass rate (i % 5) / 4."""

    version = 0

    def __init__(self, tok: Tokenizer, rows: Any):
        self.tok = tok
        self.index = {tuple(r["prompt_ids"]): (i, r["answer"]) for i, r in enumerate(rows)}

    def generate(self, prompts, params: SamplingParams, seed: int) -> GenerationOutput:
        seen: dict[int, int] = {}
        tokens = []
        for p in prompts:
            i, answer = self.index[tuple(p)]
            s = seen[i] = seen.get(i, -1) + 1
            text = f"#### {answer}" if s < i % (K + 1) else "#### 0, 0, 0"
            tokens.append(self.tok.encode(text) + [self.tok.eos_id])
        return GenerationOutput(tokens, [[-1.0] * len(t) for t in tokens], ["stop"] * len(tokens))

    def update_weights(self, weights, version):
        raise NotImplementedError


def known_pass_rates(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The reward stage samples from `KnownPassRates`: patched where the stage imports `build_backend` from
    (`from posttrain.generation.backend import build_backend` runs when the stage does)."""
    monkeypatch.setattr(posttrain.generation.backend, "build_backend",
                        lambda *args, **kwargs: KnownPassRates(setup["tok"], setup["rows"]))


@pytest.mark.parametrize(
    "band, kept",
    [([0.0, 1.0], [i for i in range(10) if i % 5 not in (0, 4)]),  # drops never (0) and always (4/4) solved
     ([0.25, 0.75], [i for i in range(10) if i % 5 == 2]),  # both ends exclusive: only 2/4
     ([0.5, 1.0], [i for i in range(10) if i % 5 == 3])],
)
def test_filtered_prompts_match_the_pass_rate_band(setup, tmp_path, monkeypatch, band, kept):
    known_pass_rates(setup, monkeypatch)
    out = run_stage(setup, tmp_path / "band", monkeypatch, n_prompts=10, verifiers=["task"], pass_rate_band=band)
    rates = pd.read_parquet(out / "pass_rates.parquet")
    assert rates["pass_rate"].tolist() == [(i % 5) / 4 for i in range(10)]
    assert rates["correct"].tolist() == [i % 5 for i in range(10)]
    prompts = pd.read_parquet(out / "grpo_prompts.parquet")
    assert prompts["prompt_index"].tolist() == kept
    assert prompts["id"].tolist() == [setup["rows"][i]["id"] for i in kept]
    assert [list(p) for p in prompts["prompt_ids"]] == [setup["rows"][i]["prompt_ids"] for i in kept]
    assert json.loads((out / "stats.json").read_text())["grpo_prompts_fallback"] is None

    # Pairs: every prompt with mixed results, the right answer chosen over the wrong one.
    pairs = pd.read_json(out / "pairs.jsonl", lines=True)
    assert pairs["prompt_index"].tolist() == [i for i in range(10) if i % 5 not in (0, 4)]
    for row in pairs.itertuples():
        assert row.chosen == f"#### {setup['rows'][row.prompt_index]['answer']}" and row.rejected == "#### 0, 0, 0"
        user = json.loads(setup["rows"][row.prompt_index]["example"])["prompt"]
        assert list(row.prompt) == [{"role": "user", "content": user}]
        assert (row.chosen_reward, row.rejected_reward) == (1.0, 0.0)
    # ... in the preference-source format that DPO's on-policy mode reads.
    as_source, _ = canonical_rows(load_source(str(out / "pairs.jsonl")), "preference", "pairs.jsonl")
    assert [r["chosen"][0]["content"] for r in as_source] == pairs["chosen"].tolist()


def test_band_with_no_prompt_inside_keeps_all_and_says_why(setup, tmp_path, monkeypatch, capsys):
    known_pass_rates(setup, monkeypatch)
    out = run_stage(setup, tmp_path / "none", monkeypatch, n_prompts=10, verifiers=["task"], pass_rate_band=[0.8, 0.9])
    assert pd.read_parquet(out / "grpo_prompts.parquet")["prompt_index"].tolist() == list(range(10))
    reason = json.loads((out / "stats.json").read_text())["grpo_prompts_fallback"]
    assert "2 never solved, 2 always solved" in reason and reason in capsys.readouterr().err


@pytest.mark.parametrize("verifier, cause", [("raise_on_third", "KeyError: 'no such field'"),
                                             ("nan_on_third", "returned nan, not a finite number")])
def test_verifier_error_names_the_prompt_index(setup, tmp_path, monkeypatch, capsys, verifier, cause):
    spec = f"user_verifiers:{verifier}"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # a verifier's error is a known one for this stage: one line, exit 1
        run_stage(setup, tmp_path / "err", monkeypatch, verifiers=["user_verifiers:even_length", spec])
    assert exited.value.code == 1
    row = setup["rows"][2]
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"reward: error: verifier {spec!r} failed on prompt index 2 (id {row['id']!r}, task 'sort'): sample 0: {cause}")
    assert not (tmp_path / "err").exists()
