"""One home for every sample a stage draws and scores: GRPO's rollouts and held-out accuracy, the reward stage,
on-policy DPO pairs, evaluation and distillation's greedy accuracy all call it.

- `sampler`: `Sampler.sample` turns prompts into `Sample`s on any backend (native or vLLM), one completion each,
  or with an `environment` one multi-turn episode each (`posttrain.envs.episodes`); `sample_in_calls` does it in
  seeded calls with a progress bar and a resumable log.
- `scoring`: `RewardFunction` scores samples: the verifiers (weighted), a reward model (normalized per prompt),
  each function's own value, correctness by the first verifier; a failing verifier names the prompt.
"""

from posttrain.rollouts.sampler import GENERATION_BATCH, Sample, Sampler, sample_in_calls
from posttrain.rollouts.scoring import RewardFunction, verifier_values

__all__ = ["GENERATION_BATCH", "RewardFunction", "Sample", "Sampler", "sample_in_calls", "verifier_values"]
