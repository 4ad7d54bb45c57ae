"""Rollout groups -> padded training tensors, cut into micro-batches.

Each completion becomes one right-padded row `prompt + completion`, with targets aligned to the
hidden states as every loss in `posttrain.losses` expects: position t predicts `targets[t]`, and
only completion tokens count (prompt and padding are -100). The generator's log-probs sit at the
same positions, so the trainer's token log-probs, the generator's and the mask line up one to one.
Right padding needs no attention mask: causal attention keeps padding out of real tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.grpo import batch_normalize, group_advantages
from posttrain.rl.rollout import RolloutGroup


@dataclass
class MicroBatch:
    input_ids: Tensor  # [b, L] prompt + completion, right-padded
    targets: Tensor  # [b, L] next completion token, IGNORE_INDEX elsewhere
    generator_logprobs: Tensor  # [b, L] float32, 0 where targets are ignored
    advantages: Tensor  # [b]

    @property
    def mask(self) -> Tensor:
        return self.targets != IGNORE_INDEX

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(*(t.to(device, non_blocking=True) for t in
                            (self.input_ids, self.targets, self.generator_logprobs, self.advantages)))


def advantages(groups: Sequence[RolloutGroup], std_normalize: bool, estimator: str = "grpo",
               batch_sums: Callable[[list[Tensor]], list[float]] | None = None) -> Tensor:
    """Advantages of every completion, group after group (float32), by `estimator` (`posttrain.losses.grpo`).

    `reinforce_pp` normalizes over the whole step: `batch_sums` sums a list of values over every
    data-parallel rank (`posttrain.training.stats.data_parallel_sum`); None: this rank's groups are
    the whole step.
    """
    sizes = {g.group_size for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"rollout groups have different sizes {sorted(sizes)}; advantages need one group size")
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32)
    adv = group_advantages(rewards, sizes.pop(), std_normalize=std_normalize, estimator=estimator)
    if estimator != "reinforce_pp":
        return adv
    sums = [adv.double().sum(), adv.double().square().sum(), adv.numel()]
    total, total_sq, count = batch_sums(sums) if batch_sums is not None else [float(v) for v in sums]
    return batch_normalize(adv, total, total_sq, count)


def micro_batches(groups: Sequence[RolloutGroup], advantage: Tensor, size: int, pad_id: int,
                  length_multiple: int = 1) -> list[MicroBatch]:
    """Rows of `size` completions each (the last may be shorter), each padded to its own longest row.

    `length_multiple` rounds that length up (sequence parallelism splits the sequence over the
    tensor-parallel ranks, so it must divide evenly).
    """
    if size < 1:
        raise ValueError(f"grpo.micro_batch_size must be >= 1, got {size}")
    rows = [(g.prompt_ids, c, lp, g.masks[j] if g.masks else None)
            for g in groups for j, (c, lp) in enumerate(zip(g.completions, g.logprobs))]
    if len(rows) != advantage.numel():
        raise ValueError(f"{len(rows)} completions but {advantage.numel()} advantages")
    out = []
    for start in range(0, len(rows), size):
        part = rows[start : start + size]
        length = max(len(p) + len(c) for p, c, _, _ in part)
        length = -(-length // length_multiple) * length_multiple
        ids = torch.full((len(part), length), pad_id, dtype=torch.long)
        targets = torch.full((len(part), length), IGNORE_INDEX, dtype=torch.long)
        gen = torch.zeros(len(part), length, dtype=torch.float32)
        for i, (prompt, completion, logprobs, mask) in enumerate(part):
            if len(logprobs) != len(completion) or (mask is not None and len(mask) != len(completion)):
                raise ValueError(f"completion {start + i} has {len(completion)} tokens but {len(logprobs)} log-probs"
                                 + ("" if mask is None else f" and {len(mask)} mask entries"))
            n, m = len(prompt), len(completion)
            ids[i, : n + m] = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
            # Position n - 1 (the last prompt token) predicts the first completion token; an episode's environment
            # tokens (mask False) are context, never targets.
            target = torch.tensor(completion, dtype=torch.long)
            if mask is not None:
                target = target.masked_fill(~torch.tensor(mask, dtype=torch.bool), IGNORE_INDEX)
            targets[i, n - 1 : n + m - 1] = target
            gen[i, n - 1 : n + m - 1] = torch.tensor(logprobs, dtype=torch.float32)
        out.append(MicroBatch(ids, targets, gen, advantage[start : start + size].clone()))
    return out
