"""Rewards of sampled completions, k per prompt (sample i of prompt i // k): verifiers and the reward model.

The reward stage scores its samples with these; a failure names the prompt, not the flat sample index.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.rewards.reward_model import PretrainedRewardModel, load_reward_model, normalize_scores, score_sequences
from posttrain.rewards.verifiers import Rewards, VerifierError


def verifier_rewards(completions: list[str], examples: list[dict[str, Any]], k: int,
                     rewards: Rewards) -> list[dict[str, float]]:
    """One {verifier: reward} per sample (sample i of prompt i // k); a failure names the prompt's index."""
    try:
        return rewards.score(completions, [examples[i // k] for i in range(len(completions))])
    except VerifierError as e:
        if e.index is None:  # a batched function failed on the whole batch
            raise
        i = e.index // k
        # The cause, as `score` worded it after naming the (sample) index.
        prefix = str(VerifierError(e.verifier, e.index, examples[i], "\0")).partition("\0")[0]
        cause = str(e).removeprefix(prefix)
        raise VerifierError(e.verifier, i, examples[i], f"sample {e.index % k}: {cause}") from e.__cause__


def add_reward_model_scores(components: list[dict[str, float]], prompt_ids: list[list[int]], tokens: list[list[int]],
                            completions: list[str], examples: list[dict[str, Any]], k: int, trained: str | None,
                            pretrained: str | None, normalize: str, pad_id: int, device: torch.device) -> None:
    """Add the reward model's raw score (`rm`) and its normalized one (`rm_norm`, `reward_model.normalize`) to each
    sample's components: the reward_model stage's folder `trained` (on the policy's ids) or a `pretrained` one."""
    if trained:
        rm = load_reward_model(trained, device=device).eval()
        raw = score_sequences(rm, [prompt_ids[i // k] + t for i, t in enumerate(tokens)], pad_id)
    elif pretrained is not None:
        raw = PretrainedRewardModel(pretrained, device=device).score(
            [examples[i // k]["prompt"] for i in range(len(tokens))], completions)
    else:
        return
    for c, value, norm in zip(components, raw, normalize_scores(raw, k, normalize)):
        c["rm"], c["rm_norm"] = value, norm
