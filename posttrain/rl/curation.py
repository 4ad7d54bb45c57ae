"""What the reward stage keeps of its scored samples: the rollout table, per-prompt pass rates, the prompts GRPO can learn from
(pass rate inside the band), and on-policy pairs (best vs worst sample of a prompt)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from posttrain.tokenizer import Tokenizer


def rollout_table(rows: list[dict[str, Any]], prompt_ids: list[list[int]], tokens: list[list[int]],
                  logprobs: list[list[float]], reasons: list[str], completions: list[str],
                  components: list[dict[str, float]], totals: list[float], correct: list[bool], k: int, tok: Tokenizer,
                  key: str | None) -> pd.DataFrame:
    """`rollouts.parquet`: one row per sample (sample i is sample i % k of prompt i // k)."""
    rendered = tok.decode_batch(prompt_ids, skip_special_tokens=False)
    return pd.DataFrame({
        "prompt_index": [i // k for i in range(len(tokens))],
        "prompt_id": [rows[i // k]["id"] for i in range(len(tokens))],
        "sample": [i % k for i in range(len(tokens))],
        "prompt": [rendered[i // k] for i in range(len(tokens))],
        "completion": completions,
        "prompt_ids": [prompt_ids[i // k] for i in range(len(tokens))],
        "completion_ids": tokens,
        "logprobs": logprobs,
        "finish_reason": reasons,
        **{f"reward/{name}": [c[name] for c in components] for name in components[0]},
        "reward": totals,
        "correct": correct,
        "policy_key": [key] * len(tokens),
    })


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


def best_vs_worst(rollouts: pd.DataFrame, prompts: dict[int, Any]) -> pd.DataFrame:
    """Per prompt whose rewards differ: its best sample (chosen) and worst (rejected), earliest on ties."""
    rows = []
    for index, group in rollouts.groupby("prompt_index", sort=True):
        rewards = group["reward"].to_numpy()
        if rewards.max() == rewards.min():
            continue
        best, worst = group.iloc[int(rewards.argmax())], group.iloc[int(rewards.argmin())]
        rows.append({
            "prompt_index": int(index),
            "prompt_id": best["prompt_id"],
            "prompt": prompts[int(index)],
            "chosen": best["completion"],
            "rejected": worst["completion"],
            "chosen_reward": float(best["reward"]),
            "rejected_reward": float(worst["reward"]),
        })
    columns = ["prompt_index", "prompt_id", "prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"]
    return pd.DataFrame(rows, columns=columns)


def as_messages(prompt: Any) -> list[dict[str, str]]:
    """A prompts-split prompt (one user string or a message list) as a message list."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
