"""Rewards of samples: the one weighting of verifiers and reward model that GRPO, the reward stage and on-policy
DPO pairs share, and the verifiers' values that evaluation and held-out accuracy count correct by."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.rewards.reward_model import PretrainedRewardModel, load_reward_model, normalize_scores, score_sequences
from posttrain.rewards.verifiers import Rewards, VerifierError
from posttrain.rollouts.sampler import Sample


def verifier_values(rewards: Rewards, samples: Sequence[Sample], examples: Sequence[Mapping[str, Any]],
                    group_size: int = 1, prompt_index: Sequence[int] | None = None) -> list[dict[str, float]]:
    """Each verifier's own value per sample (`examples[i]` is sample i's row; runs of `group_size` samples are one
    prompt's). A verifier that fails names the prompt (`prompt_index[g]` for group g: its row in the prompt set)
    and, in a group, the sample."""
    try:
        return rewards.score([s.text for s in samples], [s.scored_row(e) for s, e in zip(samples, examples, strict=True)])
    except VerifierError as e:
        if e.index is None or (group_size == 1 and prompt_index is None):  # a batched function failed on the batch
            raise
        group, member = divmod(e.index, group_size)
        prompt = prompt_index[group] if prompt_index is not None else group
        prefix = str(VerifierError(e.verifier, e.index, examples[e.index], "\0")).partition("\0")[0]
        cause = str(e).removeprefix(prefix)  # the cause, as `score` worded it after naming the sample's index
        if group_size > 1:
            cause = f"sample {member}: {cause}"
        raise VerifierError(e.verifier, prompt, examples[e.index], cause) from e.__cause__


class RewardFunction:
    """Reward of a sample: the weighted sum of the configured verifiers, plus `rm_weight` x a reward model's
    score, normalized per prompt (`reward_model.normalize`, `posttrain.rewards.reward_model.normalize_scores`).

    `verifier_specs` are `reward.verifiers` entries (built-in names, `module:function`, `path/file.py:function`
    relative to `workdir`, or `{fn, weight, batched}`); the first one decides correctness (pass rate, eval
    accuracy), as in the evaluate stage. The reward model is the reward_model stage's folder
    (`reward_model_dir`, scored on the policy's token ids: it shares the policy's tokenizer) or a pretrained one
    (`pretrained`: a folder or hub id, scored on the conversation its own chat template renders); it is loaded
    only when `rm_weight` is not 0, on the code `model_backend` (`model.backend`) picks, as it was trained.
    """

    def __init__(self, verifier_specs: Sequence[Any], reward_model_dir: str | Path | None = None,
                 rm_weight: float = 0.0, pad_id: int = 0, pretrained: str | None = None, normalize: str = "group",
                 workdir: str | None = None, device: str = "cpu", model_backend: str = "auto"):
        if not verifier_specs:
            raise ValueError("reward.verifiers is empty: scoring needs at least one verifier")
        self.rewards = Rewards(verifier_specs, workdir)
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
                self.reward_model = load_reward_model(reward_model_dir, device, backend=model_backend).eval()

    def scores(self, samples: Sequence[Sample], examples: Sequence[Mapping[str, Any]], group_size: int = 1,
               prompt_index: Sequence[int] | None = None) -> tuple[list[float], list[bool], list[dict[str, float]]]:
        """(rewards, correct, components) of `samples`, consecutive runs of `group_size` being one prompt's
        (`prompt_index`: their rows in the prompt set, which a failing verifier is named by). `components`: per
        sample, each function's own value, and with a reward model its raw score (`rm`) and the normalized one
        that is weighed (`rm_norm`). The reward model scores the prompt and every token after it."""
        values = verifier_values(self.rewards, samples, examples, group_size, prompt_index)
        rewards = [self.rewards.total(v) for v in values]
        correct = [self.rewards.correct(v) for v in values]
        raw = None
        if self.reward_model is not None:
            raw = score_sequences(self.reward_model, [s.prompt_ids + s.tokens for s in samples], self.pad_id)
        elif self.pretrained is not None:
            raw = self.pretrained.score([e["prompt"] for e in examples], [s.text for s in samples])
        if raw is not None:
            norm = normalize_scores(raw, group_size, self.normalize)
            rewards = [r + self.rm_weight * m for r, m in zip(rewards, norm)]
            values = [{**v, "rm": r, "rm_norm": m} for v, r, m in zip(values, raw, norm)]
        return rewards, correct, values

    def correct(self, samples: Sequence[Sample], examples: Sequence[Mapping[str, Any]]) -> list[bool]:
        """Which samples the first verifier gives full credit (the verifiers only: no reward model is run)."""
        return [self.rewards.correct(v) for v in verifier_values(self.rewards, samples, examples)]
