"""Task metrics from scored completions: greedy accuracy, sampled pass@k, verifier reward, length.

A completion is *correct* when the first configured verifier (``reward.verifiers[0]``, by default
``task``: the built-in task's exact-answer check) gives it full credit (>= 1, its own value, whatever
its weight). The *reward* is the weighted sum of every configured verifier's score (each entry's
``weight``, 1 for a plain name), as a policy would be rewarded for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from posttrain.evaluation.passk import mean_pass_at_k
from posttrain.rewards.verifiers import verifier_name


@dataclass(frozen=True)
class PromptResult:
    """One eval prompt: its greedy completion's scores and how many of its samples were correct."""

    task: str
    correct: bool
    rewards: Mapping[str, float]  # verifier name -> score of the greedy completion
    length: int  # generated tokens of the greedy completion
    truncated: bool  # the greedy completion hit max_new_tokens without a stop token
    sample_correct: int  # correct samples out of `samples`


def is_correct(scores: Mapping[str, float], verifier: str | Mapping[str, Any]) -> bool:
    """Full credit from `verifier` (a `reward.verifiers` entry: a name or ``{fn: ...}``)."""
    return scores[verifier if isinstance(verifier, str) else verifier_name(verifier)] >= 1.0


def _reward(rewards: Mapping[str, float], weights: Mapping[str, float] | None) -> float:
    return sum(rewards.values()) if weights is None else sum(weights[v] * rewards[v] for v in weights)


def _metrics(results: Sequence[PromptResult], ks: Sequence[int], samples: int,
             weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    verifiers = list(results[0].rewards)
    metrics: dict[str, Any] = {
        "n_prompts": len(results),
        "accuracy": fmean(r.correct for r in results),
    }
    counts = [r.sample_correct for r in results]
    for k in ks:
        metrics[f"pass@{k}"] = mean_pass_at_k(counts, samples, k)
    metrics["reward"] = fmean(_reward(r.rewards, weights) for r in results)
    metrics["reward_by_verifier"] = {v: fmean(r.rewards[v] for r in results) for v in verifiers}
    metrics["response_len"] = fmean(r.length for r in results)
    metrics["truncated"] = fmean(r.truncated for r in results)
    return metrics


def task_metrics(results: Sequence[PromptResult], ks: Sequence[int], samples: int,
                 weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Metrics over all prompts, plus the same under ``per_task`` for each task (sorted by name).

    `weights`: verifier name -> weight of its score in ``reward`` (None: every weight 1, a plain sum)."""
    if not results:
        raise ValueError("task_metrics: no eval prompts")
    overall = _metrics(results, ks, samples, weights)
    by_task: dict[str, list[PromptResult]] = {}
    for r in results:
        by_task.setdefault(r.task, []).append(r)
    overall["per_task"] = {task: _metrics(rows, ks, samples, weights) for task, rows in sorted(by_task.items())}
    return overall
