"""Losses on hidden states: chunked cross-entropy, token log-probs, DPO/IPO/SimPO, GRPO, KD; and the
Bradley-Terry loss on reward-model scores.

The hidden-state losses take the model's final hidden states and its output projection (``model.lm_head``)
rather than logits, with labels aligned to the hidden states (see ``posttrain.losses.logprobs``).

Import from the concrete modules (``chunked``, ``ce``, ``logprobs``, ``dpo``, ``grpo``, ``kd``,
``bradley_terry``): this file re-exports nothing, so a stage's code fingerprint
(``posttrain.workflow.fingerprint``) covers the loss modules it uses and not the others.
"""
