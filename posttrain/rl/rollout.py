"""Rollout collection: sample a group of completions per prompt, score them, tag the policy version.

A `RolloutWorker` owns a generation backend (native sampler or vLLM), the tokenizer and the
reward function. The same object runs inside the stage process (sync GRPO) and inside a Ray
generator actor (async GRPO), so the collection code has one implementation that tests can
run without Ray. Scoring happens where the samples are made: the trainer receives groups that
are ready to train on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.envs.episodes import EpisodeSettings, Trajectory, episode_metrics, scored_rows
from posttrain.generation.backend import GenerationBackend, Weights, build_backend
from posttrain.generation.sampler import SamplingParams
from posttrain.rewards.reward_model import PretrainedRewardModel, load_reward_model, normalize_scores, score_sequences
from posttrain.rewards.verifiers import Rewards
from posttrain.rl.weights import verify_push
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


class RewardFunction:
    """Reward of a completion: the weighted sum of the configured verifiers, plus `rm_weight` x a reward model's
    score, normalized per prompt (`reward_model.normalize`, `posttrain.rewards.reward_model.normalize_scores`).

    `verifier_specs` are `reward.verifiers` entries (built-in names, `module:function`, `path/file.py:function`
    relative to `workdir`, or `{fn, weight, batched}`); the first one decides correctness (pass rate, eval
    accuracy), as in the evaluate stage. The reward model is the reward_model stage's folder
    (`reward_model_dir`, scored on the policy's token ids: it shares the policy's tokenizer) or a pretrained one
    (`pretrained`: a folder or hub id, scored on the conversation its own chat template renders); it is loaded
    only when `rm_weight` is not 0.
    """

    def __init__(self, verifier_specs: Sequence[Any], reward_model_dir: str | Path | None = None,
                 rm_weight: float = 0.0, pad_id: int = 0, pretrained: str | None = None, normalize: str = "group",
                 workdir: str | None = None, device: str = "cpu"):
        if not verifier_specs:
            raise ValueError("reward.verifiers is empty: GRPO needs at least one verifier")
        self.rewards = Rewards(verifier_specs, workdir)
        self.specs = list(verifier_specs)
        self.rm_weight = float(rm_weight)
        self.pad_id = pad_id
        self.normalize = normalize
        self.reward_model = None
        self.pretrained: PretrainedRewardModel | None = None
        if self.rm_weight:
            if pretrained is not None:
                self.pretrained = PretrainedRewardModel(pretrained, device)
            elif reward_model_dir is None or not Path(reward_model_dir).is_dir():
                raise FileNotFoundError(
                    f"grpo.rm_weight is {self.rm_weight} but there is no reward model at {reward_model_dir} "
                    "(set reward_model.source: train or a pretrained model, or grpo.rm_weight: 0)"
                )
            else:
                self.reward_model = load_reward_model(reward_model_dir, device).eval()

    def scores(self, texts: Sequence[str], sequences: Sequence[Sequence[int]], examples: Sequence[Mapping[str, Any]],
               group_size: int = 1) -> tuple[list[float], list[bool], list[dict[str, float]]]:
        """(rewards, correct, components) of completions `texts`, consecutive runs of `group_size` being one
        prompt's samples; `sequences` are prompt + completion ids (for the reward_model stage's model).
        `components`: per completion, each function's own value, and with a reward model its raw score (`rm`)
        and the normalized one that is weighed (`rm_norm`)."""
        values = self.rewards.score(texts, examples)
        rewards = [self.rewards.total(v) for v in values]
        correct = [self.rewards.correct(v) for v in values]
        raw = None
        if self.reward_model is not None:
            raw = score_sequences(self.reward_model, sequences, self.pad_id)
        elif self.pretrained is not None:
            raw = self.pretrained.score([e["prompt"] for e in examples], texts)
        if raw is not None:
            norm = normalize_scores(raw, group_size, self.normalize)
            rewards = [r + self.rm_weight * m for r, m in zip(rewards, norm)]
            values = [{**v, "rm": r, "rm_norm": m} for v, r, m in zip(values, raw, norm)]
        return rewards, correct, values

    def __call__(self, texts: Sequence[str], sequences: Sequence[Sequence[int]],
                 examples: Sequence[Mapping[str, Any]], group_size: int = 1) -> tuple[list[float], list[bool]]:
        """(rewards, correct) of completions `texts` (see `scores`)."""
        rewards, correct, _ = self.scores(texts, sequences, examples, group_size)
        return rewards, correct


class RolloutWorker:
    """Samples and scores rollout groups with one backend; the unit a generator actor wraps. With `episodes`, a
    completion is a multi-turn episode (`posttrain.envs`): the verifiers score its last model message, with the
    environment's reward in the row as `env_reward` (the `environment` verifier)."""

    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer, params: SamplingParams,
                 group_size: int, reward_fn: RewardFunction, episodes: EpisodeSettings | None = None):
        self.backend, self.tokenizer, self.params = backend, tokenizer, params
        self.group_size, self.reward_fn = group_size, reward_fn
        self.episodes = episodes
        self.environment = episodes.load() if episodes else None

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

    def run_episodes(self, examples: Sequence[Mapping[str, Any]], params: SamplingParams, seed: int) -> list[Trajectory]:
        """One episode per row of `examples`, each in a fresh environment."""
        assert self.episodes is not None
        return self.episodes.run(self.backend, self.tokenizer, params, examples, seed, self.environment)

    def episode_rewards(self, trajectories: Sequence[Trajectory], examples: Sequence[Mapping[str, Any]],
                        group_size: int = 1) -> tuple[list[float], list[bool], list[dict[str, float]]]:
        """The verifiers' scores of each episode's last model message, its environment reward in the row."""
        rows = scored_rows(trajectories, examples)
        return self.reward_fn.scores([t.final_text for t in trajectories],
                                     [t.prompt_ids + t.tokens for t in trajectories], rows, group_size=group_size)

    def collect(self, batch: PromptBatch, seed: int) -> list[RolloutGroup]:
        """`group_size` completions for each prompt of `batch`, scored; deterministic for (weights, batch, seed)."""
        if self.environment is not None:
            return self._collect_episodes(batch, seed)
        k = self.group_size
        version = self.backend.version
        prompts = [p for p in batch.prompt_ids for _ in range(k)]
        out = self.backend.generate(prompts, self.params, seed)
        texts = self.tokenizer.decode_batch(out.tokens)
        examples = [e for e in batch.examples for _ in range(k)]
        rewards, correct, components = self.reward_fn.scores(texts, [p + c for p, c in zip(prompts, out.tokens)],
                                                             examples, group_size=k)
        index = batch.index or [-1] * len(batch)
        return [
            RolloutGroup(
                prompt_ids=list(batch.prompt_ids[g]), example=dict(batch.examples[g]),
                completions=out.tokens[g * k : (g + 1) * k], logprobs=out.logprobs[g * k : (g + 1) * k],
                finish_reasons=out.finish_reasons[g * k : (g + 1) * k], rewards=rewards[g * k : (g + 1) * k],
                correct=correct[g * k : (g + 1) * k], version=version, index=int(index[g]),
                components=components[g * k : (g + 1) * k],
            )
            for g in range(len(batch))
        ]


    def _collect_episodes(self, batch: PromptBatch, seed: int) -> list[RolloutGroup]:
        k, version = self.group_size, self.backend.version
        examples = [e for e in batch.examples for _ in range(k)]
        trajectories = self.run_episodes(examples, self.params, seed)
        rewards, correct, components = self.episode_rewards(trajectories, examples, group_size=k)
        index = batch.index or [-1] * len(batch)
        groups = []
        for g in range(len(batch)):
            part = trajectories[g * k : (g + 1) * k]
            groups.append(RolloutGroup(
                prompt_ids=part[0].prompt_ids, example=dict(batch.examples[g]), completions=[t.tokens for t in part],
                logprobs=[t.logprobs for t in part], finish_reasons=[t.finish_reason for t in part],
                rewards=rewards[g * k : (g + 1) * k], correct=correct[g * k : (g + 1) * k], version=version,
                index=int(index[g]), components=components[g * k : (g + 1) * k], masks=[t.mask for t in part],
                episodes=[t.counts() for t in part]))
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
                               workdir=spec.workdir, device=spec.device)
    return RolloutWorker(backend, tokenizer, params, spec.group_size, reward_fn, spec.episodes)
