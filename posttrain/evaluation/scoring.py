"""Task metrics from scored completions: greedy accuracy, sampled pass@k, verifier reward, length.

A completion is *correct* when the first configured verifier (``reward.verifiers[0]``, by default
``task``: the built-in task's exact-answer check) gives it full credit (>= 1). The *reward* is the
sum of every configured verifier's score, as a policy would be rewarded for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from posttrain.evaluation.passk import mean_pass_at_k


@dataclass(frozen=True)
class PromptResult:
    """One eval prompt: its greedy completion's scores and how many of its samples were correct."""

    task: str
    correct: bool
    rewards: Mapping[str, float]  # verifier name -> score of the greedy completion
    length: int  # generated tokens of the greedy completion
    truncated: bool  # the greedy completion hit max_new_tokens without a stop token
    sample_correct: int  # correct samples out of `samples`


def is_correct(scores: Mapping[str, float], verifier: str) -> bool:
    return scores[verifier] >= 1.0


def _metrics(results: Sequence[PromptResult], ks: Sequence[int], samples: int) -> dict[str, Any]:
    verifiers = list(results[0].rewards)
    metrics: dict[str, Any] = {
        "n_prompts": len(results),
        "accuracy": fmean(r.correct for r in results),
    }
    counts = [r.sample_correct for r in results]
    for k in ks:
        metrics[f"pass@{k}"] = mean_pass_at_k(counts, samples, k)
    metrics["reward"] = fmean(sum(r.rewards.values()) for r in results)
    metrics["reward_by_verifier"] = {v: fmean(r.rewards[v] for r in results) for v in verifiers}
    metrics["response_len"] = fmean(r.length for r in results)
    metrics["truncated"] = fmean(r.truncated for r in results)
    return metrics


def task_metrics(results: Sequence[PromptResult], ks: Sequence[int], samples: int) -> dict[str, Any]:
    """Metrics over all prompts, plus the same under ``per_task`` for each task (sorted by name)."""
    if not results:
        raise ValueError("task_metrics: no eval prompts")
    overall = _metrics(results, ks, samples)
    by_task: dict[str, list[PromptResult]] = {}
    for r in results:
        by_task.setdefault(r.task, []).append(r)
    overall["per_task"] = {task: _metrics(rows, ks, samples) for task, rows in sorted(by_task.items())}
    return overall
