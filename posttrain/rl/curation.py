"""What the reward stage keeps of its scored samples: the rollout table, per-prompt pass rates, the prompts GRPO can learn from
(pass rate inside the band), and on-policy pairs (best vs worst sample of a prompt); episodes with an environment."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from posttrain.rollouts import Sample
from posttrain.tokenizer import Tokenizer


def rollout_table(rows: list[dict[str, Any]], samples: list[Sample], components: list[dict[str, float]],
                  totals: list[float], correct: list[bool], k: int, tok: Tokenizer, key: str | None) -> pd.DataFrame:
    """`rollouts.parquet`: one row per sample (sample i is sample i % k of prompt i // k). An episode's prompt is
    the one its environment opened with, its completion the model's last message; `episode` is every token after
    the prompt rendered, `mask` which of them the model sampled, `messages` the conversation (JSON)."""
    table = pd.DataFrame({
        "prompt_index": [i // k for i in range(len(samples))],
        "prompt_id": [rows[i // k]["id"] for i in range(len(samples))],
        "sample": [i % k for i in range(len(samples))],
        "prompt": tok.decode_batch([s.prompt_ids for s in samples], skip_special_tokens=False),
        "completion": [s.text for s in samples],
        "prompt_ids": [s.prompt_ids for s in samples],
        "completion_ids": [s.tokens for s in samples],
        "logprobs": [s.logprobs for s in samples],
        "finish_reason": [s.finish_reason for s in samples],
        **{f"reward/{name}": [c[name] for c in components] for name in components[0]},
        "reward": totals,
        "correct": correct,
        "policy_key": [key] * len(samples),
    })
    if samples and samples[0].is_episode:
        table["episode"] = tok.decode_batch([s.tokens for s in samples], skip_special_tokens=False)
        table["mask"] = [s.mask for s in samples]
        table["messages"] = [json.dumps(s.messages, ensure_ascii=False) for s in samples]
    return table


def pass_rates(rollouts: pd.DataFrame, rows: list[dict[str, Any]], k: int) -> pd.DataFrame:
    """`pass_rates.parquet`: one row per prompt."""
    grouped = rollouts.groupby("prompt_index", sort=True)
    return pd.DataFrame({
        "prompt_index": range(len(rows)),
        "prompt_id": [r["id"] for r in rows],
        "task": [r["task"] for r in rows],
        "samples": k,
        "correct": grouped["correct"].sum().astype(int).to_numpy(),
        "pass_rate": grouped["correct"].mean().to_numpy(),
        "reward_mean": grouped["reward"].mean().to_numpy(),
        "reward_std": grouped["reward"].std(ddof=0).to_numpy(),
    })


def grpo_prompts(rates: pd.DataFrame, band: tuple[float, float]) -> tuple[pd.Series, str | None]:
    """(mask of prompts with low < pass rate < high, None); every prompt and the reason when none is inside."""
    low, high = band
    keep = (rates["pass_rate"] > low) & (rates["pass_rate"] < high)
    if keep.any():
        return keep, None
    never, always = int((rates["pass_rate"] == 0).sum()), int((rates["pass_rate"] == 1).sum())
    reason = (
        f"no prompt has a pass rate strictly inside reward.pass_rate_band {[low, high]} ({len(rates)} prompts: "
        f"{never} never solved, {always} always solved), so all {len(rates)} are kept for GRPO, which gets no "
        "group-relative signal from them; widen the band, raise reward.samples_per_prompt or "
        "reward.temperature, or train the policy further"
    )
    return pd.Series(True, index=rates.index), reason


def best_vs_worst(rollouts: pd.DataFrame, samples: list[Sample], prompts: dict[int, Any]) -> list[dict[str, Any]]:
    """Per prompt whose rewards differ: its best sample (chosen) and worst (rejected), earliest on ties; rows of
    the `preference` source format. An episode pair is the environment's opening as the prompt and, on each side,
    every message after it (the model's turns and the environment's replies), with the episode's tools."""
    pairs = []
    for index, group in rollouts.groupby("prompt_index", sort=True):
        rewards = group["reward"].to_numpy()
        if rewards.max() == rewards.min():
            continue
        best, worst = group.index[int(rewards.argmax())], group.index[int(rewards.argmin())]
        chosen, rejected = samples[best], samples[worst]
        pair: dict[str, Any] = {"prompt_index": int(index), "prompt_id": rollouts.at[best, "prompt_id"]}
        if chosen.is_episode:
            pair.update(prompt=chosen.messages[: chosen.opening], chosen=chosen.messages[chosen.opening :],
                        rejected=rejected.messages[rejected.opening :])
            if chosen.tools is not None:
                pair["tools"] = chosen.tools
        else:
            pair.update(prompt=prompts[int(index)], chosen=chosen.text, rejected=rejected.text)
        pair.update(chosen_reward=float(rewards.max()), rejected_reward=float(rewards.min()))
        pairs.append(pair)
    return pairs


def write_pairs(pairs: list[dict[str, Any]], path: Path) -> None:
    """`pairs.jsonl`: JSON keeps messages and tool schemas exactly as they are (no columnar schema to fill)."""
    with path.open("w", encoding="utf-8") as f:
        for pair in pairs:
            f.write(json.dumps(pair, ensure_ascii=False) + "\n")


def as_messages(prompt: Any) -> list[dict[str, str]]:
    """A prompts-split prompt (one user string or a message list) as a message list."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
