"""Losses on hidden states: chunked cross-entropy, token log-probs, DPO/IPO/SimPO, GRPO, KD; and the
Bradley-Terry loss on reward-model scores.

The hidden-state losses take the model's final hidden states and its output projection (``model.lm_head``)
rather than logits, with labels aligned to the hidden states (see ``posttrain.losses.logprobs``).
"""

from posttrain.losses.bradley_terry import bradley_terry_loss
from posttrain.losses.ce import full_cross_entropy, linear_cross_entropy, num_loss_tokens
from posttrain.losses.chunked import IGNORE_INDEX, map_row_chunks
from posttrain.losses.dpo import dpo_loss, ipo_loss, preference_loss, simpo_loss
from posttrain.losses.grpo import group_advantages, grpo_loss
from posttrain.losses.kd import kd_loss, token_divergence
from posttrain.losses.logprobs import (
    kept_token_logprobs,
    sequence_logprobs,
    token_logprobs,
    token_logprobs_and_entropy,
)

__all__ = [
    "IGNORE_INDEX",
    "bradley_terry_loss",
    "dpo_loss",
    "full_cross_entropy",
    "group_advantages",
    "grpo_loss",
    "ipo_loss",
    "kd_loss",
    "kept_token_logprobs",
    "linear_cross_entropy",
    "map_row_chunks",
    "num_loss_tokens",
    "preference_loss",
    "sequence_logprobs",
    "simpo_loss",
    "token_divergence",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
