"""The natively ported families, one row each: what transformers calls their classes and fills into their configs.

A family's Hugging Face class names are what a folder we write declares in `architectures`, so that
transformers and vLLM load it: the causal LM for a model stage's output, the sequence classifier for a
reward model's. `defaults` are what the family's transformers config class fills in when config.json
leaves a key out (`ModelArgs.from_hf` falls back to Llama's values for the rest). Plain data, no
imports: the dry run reads it without torch (`posttrain.workflow.model_names`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    causal_lm: str  # transformers' `*ForCausalLM` class name
    sequence_classification: str  # transformers' `*ForSequenceClassification` class name (a reward model)
    defaults: dict[str, Any] = field(default_factory=dict)  # config keys the family's config class fills in
    rope_theta: float = 10_000.0  # when neither rope_theta nor rope_parameters names one


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification"),
    "mistral": Family("MistralForCausalLM", "MistralForSequenceClassification", {"sliding_window": 4096}),
    "olmo2": Family("Olmo2ForCausalLM", "Olmo2ForSequenceClassification", {"rms_norm_eps": 1e-5}),
    "smollm3": Family("SmolLM3ForCausalLM", "SmolLM3ForSequenceClassification", {"tie_word_embeddings": True},
                      rope_theta=2_000_000.0),
    "gemma3_text": Family("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification",
                          {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                           "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh"},
                          rope_theta=1_000_000.0),
    "phi3": Family("Phi3ForCausalLM", "Phi3ForSequenceClassification", {"rms_norm_eps": 1e-5}),
}
