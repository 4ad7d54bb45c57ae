"""Rollout collection: sample a group of completions per prompt, score them, tag the policy version.

A `RolloutWorker` owns a `Sampler` (a native or vLLM backend, the tokenizer, the environment if any) and
a `RewardFunction`, both from `posttrain.rollouts`, the home every sampler and scorer shares. The same object runs inside the stage process (sync GRPO) and inside a Ray
generator actor (async GRPO), so the collection code has one implementation that tests can
run without Ray. Scoring happens where the samples are made: the trainer receives groups that
are ready to train on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.envs.episodes import EpisodeSettings, episode_metrics
from posttrain.generation.backend import GenerationBackend, Weights, build_backend
from posttrain.generation.sampler import SamplingParams
from posttrain.rl.weights import verify_push
from posttrain.rollouts import RewardFunction, Sampler
from posttrain.tokenizer import Tokenizer


@dataclass
class RolloutGroup:
    """`group_size` completions of one prompt, scored, with the policy version that sampled them."""

    prompt_ids: list[int]
    example: dict[str, Any]
    completions: list[list[int]]  # generated ids, up to and including the stop token
    logprobs: list[list[float]]  # the generator's log-prob of each generated id (logits / temperature)
    finish_reasons: list[str]
    rewards: list[float]
    correct: list[bool]  # full credit from the first verifier
    version: int  # policy version of the generator's weights
    index: int = -1  # row of the prompt in its prompt set
    components: list[dict[str, float]] = field(default_factory=list)  # per completion: each function's own value
    # Multi-turn episodes (`environment.fn`): per completion, which tokens the model sampled (the others are the
    # environment's, never trained on) and the episode's turns, tool calls and malformed tool calls.
    masks: list[list[bool]] = field(default_factory=list)
    episodes: list[dict[str, float]] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return len(self.completions)


@dataclass
class PromptBatch:
    """Prompts handed to a worker: token ids, verifier rows and their rows in the prompt set."""

    prompt_ids: list[list[int]]
    examples: list[dict[str, Any]]
    index: list[int] = field(default_factory=list)

    @classmethod
    def from_loader(cls, batch: Mapping[str, Any]) -> PromptBatch:
        """From a `posttrain.data.loader.prompt_batches` batch."""
        return cls(list(batch["prompt_ids"]), list(batch["examples"]), [int(i) for i in batch["index"]])

    def __len__(self) -> int:
        return len(self.prompt_ids)


class RolloutWorker:
    """Samples and scores rollout groups with one `Sampler` (`posttrain.rollouts`); the unit a generator actor
    wraps. With an environment, a completion is a multi-turn episode."""

    def __init__(self, sampler: Sampler, params: SamplingParams, group_size: int, reward_fn: RewardFunction):
        self.sampler, self.params = sampler, params
        self.group_size, self.reward_fn = group_size, reward_fn

    @property
    def backend(self) -> GenerationBackend:
        return self.sampler.backend

    @property
    def version(self) -> int:
        return self.backend.version

    def start_at(self, weights: Weights, version: int, sent: Mapping[str, int] | None = None) -> int:
        """Load the trainer's weights as `version` before any update (a resumed run starts past version 0)."""
        self.backend.update_weights(weights, version)
        self._verify(weights, sent, version)
        return version

    def update_weights(self, weights: Weights, version: int, sent: Mapping[str, int] | None = None) -> int:
        """Load policy `version`; refuses a version that skips one (an update was lost) or goes back. With `sent`
        (the trainer's digests of the weights), checks the generator then samples with exactly them."""
        if version != self.backend.version + 1:
            raise ValueError(
                f"generator holds policy version {self.backend.version} and was sent version {version}; "
                "weight updates must arrive one version at a time, in order"
            )
        self.backend.update_weights(weights, version)
        self._verify(weights, sent, version)
        return version

    def _verify(self, weights: Weights, sent: Mapping[str, int] | None, version: int) -> None:
        if sent is None:
            return
        if isinstance(weights, (str, os.PathLike)):
            raise TypeError("a push checked against the trainer's digests must be a state dict, not a folder")
        held = self.backend.held_digests({name: tuple(t.shape) for name, t in weights.items()})
        verify_push(sent, weights, held, version)

    def collect(self, batch: PromptBatch, seed: int) -> list[RolloutGroup]:
        """`group_size` samples for each prompt of `batch`, scored; deterministic for (weights, batch, seed)."""
        k, version = self.group_size, self.backend.version
        examples = [e for e in batch.examples for _ in range(k)]
        samples = self.sampler.sample([p for p in batch.prompt_ids for _ in range(k)], examples, self.params, seed)
        index = batch.index or [-1] * len(batch)
        rewards, correct, components = self.reward_fn.scores(samples, examples, k, batch.index or None)
        groups = []
        for g in range(len(batch)):
            part = samples[g * k : (g + 1) * k]
            groups.append(RolloutGroup(
                prompt_ids=part[0].prompt_ids, example=dict(batch.examples[g]), completions=[s.tokens for s in part],
                logprobs=[s.logprobs for s in part], finish_reasons=[s.finish_reason for s in part],
                rewards=rewards[g * k : (g + 1) * k], correct=correct[g * k : (g + 1) * k], version=version,
                index=int(index[g]), components=components[g * k : (g + 1) * k],
                masks=[s.mask for s in part if s.mask is not None],
                episodes=[s.counts for s in part if s.counts is not None]))
        return groups


def rollout_stats(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """Reward mean/std, pass rate, response length, truncation, the share of groups with no signal, and the
    mean of each reward function's own value (`reward/<name>`; `reward_mean` is their weighted sum).

    A group whose rewards are all equal has zero advantage everywhere: it costs a training pass
    and teaches nothing (`zero_signal_frac`).
    """
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    lengths = torch.tensor([len(c) for g in groups for c in g.completions], dtype=torch.float64)
    correct = [c for g in groups for c in g.correct]
    truncated = [f == "length" for g in groups for f in g.finish_reasons]
    flat = [len(set(g.rewards)) == 1 for g in groups]
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "pass_rate": sum(correct) / len(correct),
        "response_len": float(lengths.mean()),
        "truncated_frac": sum(truncated) / len(truncated),
        "zero_signal_frac": sum(flat) / len(flat),
    }
    episodes = [e for g in groups for e in g.episodes]
    if episodes:  # multi-turn: turns per episode, tool calls per episode, the share of them malformed
        stats.update(episode_metrics(episodes))
    if all(len(g.components) == g.group_size for g in groups):
        values = [c for g in groups for c in g.components]
        for name in values[0]:
            stats[f"reward/{name}"] = float(torch.tensor([c[name] for c in values], dtype=torch.float64).mean())
    return stats


@dataclass(frozen=True)
class WorkerSpec:
    """Plain values from which any process (the stage, a Ray actor) builds the same `RolloutWorker`."""

    backend: str  # native | vllm
    model_dir: str  # HF folder of the starting policy (version 0)
    model_backend: str  # model.backend: the model code the native sampler runs (the trainer's)
    tokenizer_dir: str
    group_size: int
    temperature: float
    max_new_tokens: int
    verifiers: tuple[Any, ...]  # reward.verifiers entries
    reward_model_dir: str | None = None  # the reward_model stage's folder (the policy's tokenizer)
    rm_weight: float = 0.0
    pretrained_reward_model: str | None = None  # reward_model.source: a folder or hub id (its own tokenizer)
    rm_normalize: str = "group"  # reward_model.normalize
    workdir: str | None = None  # what `path/file.py:function` verifiers are relative to (the stage's working directory)
    max_batch_size: int = 256  # sequences per native generate() call
    max_model_len: int | None = None  # vLLM: prompt + completion budget
    seed: int = 0
    device: str = "cpu"
    episodes: EpisodeSettings | None = None  # the `environment` section: multi-turn episodes


def build_worker(spec: WorkerSpec) -> RolloutWorker:
    """The backend named by `spec.backend` over the starting policy, with its tokenizer and reward function."""
    tokenizer = Tokenizer(spec.tokenizer_dir)
    backend = build_backend(spec.backend, spec.model_dir, model_backend=spec.model_backend, pad_id=tokenizer.pad_id,
                            decode=tokenizer.decode, device=spec.device, seed=spec.seed, max_model_len=spec.max_model_len,
                            max_batch_size=spec.max_batch_size, setting="grpo.backend")
    params = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                            stop_token_ids=tokenizer.eos_ids)
    reward_fn = RewardFunction(spec.verifiers, spec.reward_model_dir, spec.rm_weight, tokenizer.pad_id,
                               pretrained=spec.pretrained_reward_model, normalize=spec.rm_normalize,
                               workdir=spec.workdir, device=spec.device, model_backend=spec.model_backend)
    return RolloutWorker(Sampler(backend, tokenizer, spec.episodes), params, spec.group_size, reward_fn)
