"""Stage pieces for benchmarks: the SFT loss where `stages/sft.py` cannot load, and one sync GRPO step.

The SFT and DPO steps live next to their memory benchmarks (`sft_memory.train_step`,
`dpo_memory.train_step`) and call the stage's own loss. `stages/sft.py` imports the data loader,
which needs `pyarrow`; a GPU image without it still runs the SFT step with `sft_loss_module`,
which falls back to the loss's one-process path built from the library.

The GRPO step is the stage's step with one inner epoch,
no KL reference and one micro-batch per step (the stage's settings for an optimizer-in-backward
run): the rollout worker samples `group_size` completions per prompt with the current weights and
scores them, group-relative advantages weigh a PPO-clipped token-level loss, the optimizer steps,
and the new weights go to the worker, as the stage's sync mode does. The pieces are the stage's:
`RolloutWorker.collect`, `advantages`, `micro_batches`, `stages/grpo.py: policy_logprobs`,
`grpo_loss`, `policy_weights`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


class LibrarySFTLoss:
    """`stages/sft.py: summed_loss` without tensor parallelism and with chunked cross-entropy (no data-loader import)."""

    reason = ""

    @staticmethod
    def summed_loss(model, batch: dict[str, torch.Tensor], mesh, memory: dict[str, Any]) -> torch.Tensor:
        from posttrain.losses.ce import linear_cross_entropy
        from posttrain.parallel import uses_tensor_parallel

        if uses_tensor_parallel(mesh) or not memory["chunked_ce"]:
            raise ValueError("the library SFT loss covers chunked cross-entropy without tensor parallelism only")
        hidden = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
        return linear_cross_entropy(hidden, model.lm_head, batch["labels"], num_chunks=memory["ce_chunks"],
                                    reduction="sum")


def sft_loss_module():
    """The module holding `summed_loss`: `stages/sft.py`, or `LibrarySFTLoss` (with `.reason`) if it cannot load."""
    from sft_memory import stage_module

    try:
        return stage_module()
    except ImportError as e:
        fallback = LibrarySFTLoss()
        fallback.reason = f"stages/sft.py not importable ({e}); loss from posttrain.losses.linear_cross_entropy"
        return fallback


def grpo_stage_module():
    spec = importlib.util.spec_from_file_location("grpo_stage", ROOT / "stages" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grpo_step(state: dict[str, Any], prompts: Any, seed: int) -> dict[str, float]:
    """One step on `prompts` (a `PromptBatch`); `state` holds model, optimizer, worker, stage, cfg, clip, pad_id, version.

    Returns the loss, the mean reward and the useful tokens (prompt + completion of every sample).
    """
    from posttrain.losses.grpo import grpo_loss
    from posttrain.optim import OptimizerInBackward, clip_grad_norm_
    from posttrain.rl.batch import advantages, micro_batches
    from posttrain.rl.weights import policy_weights

    model, optimizer, worker, grpo = state["model"], state["optimizer"], state["worker"], state["cfg"]["grpo"]
    memory = state["cfg"]["memory"]
    groups = worker.collect(prompts, seed)
    adv = advantages(groups, grpo["std_normalize"])
    rows = sum(g.group_size for g in groups)
    (batch,) = micro_batches(groups, adv, rows, state["pad_id"])
    logp, _ = state["stage"].policy_logprobs(model, batch, None, memory, float(grpo["temperature"]))
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
