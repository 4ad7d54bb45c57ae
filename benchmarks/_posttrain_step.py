"""One sync GRPO step for benchmarks, from the pieces the stage uses.

The SFT and DPO steps live next to their memory benchmarks (`sft_memory.train_step`,
`dpo_memory.train_step`) and use the stage's loss from the library (`posttrain.losses.head`).

The GRPO step is the stage's step with one inner epoch,
no KL reference and one micro-batch per step (the stage's settings for an optimizer-in-backward
run): the rollout worker samples `group_size` completions per prompt with the current weights and
scores them, group-relative advantages weigh a PPO-clipped token-level loss, the optimizer steps,
and the new weights go to the worker, as the stage's sync mode does. The pieces are the stage's:
`RolloutWorker.collect`, `advantages`, `micro_batches`, `OutputHead.token_logprobs_and_entropy`,
`grpo_loss`, `policy_weights`.
"""

from __future__ import annotations

from typing import Any

import torch


def grpo_step(state: dict[str, Any], prompts: Any, seed: int) -> dict[str, float]:
    """One step on `prompts` (a `PromptBatch`); `state` holds model, optimizer, worker, head, cfg, clip, pad_id, version.

    Returns the loss, the mean reward and the useful tokens (prompt + completion of every sample).
    """
    from posttrain.losses.grpo import grpo_loss
    from posttrain.optim import OptimizerInBackward, clip_grad_norm_
    from posttrain.rl.batch import advantages, micro_batches
    from posttrain.rl.weights import policy_weights

    model, optimizer, worker, grpo = state["model"], state["optimizer"], state["worker"], state["cfg"]["grpo"]
    groups = worker.collect(prompts, seed)
    adv = advantages(groups, grpo["std_normalize"], grpo.get("advantage", "grpo"))
    rows = sum(g.group_size for g in groups)
    (batch,) = micro_batches(groups, adv, rows, state["pad_id"])
    logp, _ = state["head"].token_logprobs_and_entropy(model(batch.input_ids), batch.targets, batch.mask,
                                                       float(grpo["temperature"]))
    loss, _ = grpo_loss(
        logp, logp.detach(), batch.advantages, batch.mask, clip_eps=float(grpo["clip_eps"]), token_level=True,
        denominator=float(batch.mask.sum()), generator_logprobs=batch.generator_logprobs, tis_cap=float(grpo["tis_cap"]),
    )
    loss.backward()
    if not isinstance(optimizer, OptimizerInBackward):
        clip_grad_norm_(model.parameters(), state["clip"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state["version"] += 1
    worker.update_weights(policy_weights(model, every_rank=True), state["version"])
    useful = sum(len(g.prompt_ids) * g.group_size + sum(len(c) for c in g.completions) for g in groups)
    rewards = torch.tensor([r for g in groups for r in g.rewards])
    return {"loss": float(loss), "reward_mean": float(rewards.mean()), "useful_tokens": useful}
