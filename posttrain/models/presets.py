"""Named model shapes for tests and the embedded default pipeline, expressed as HF configs.

The vocabulary size is left to the tokenizer trained for the preset (`with_vocab`).
"""

from __future__ import annotations

import copy
from typing import Any

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    # ~3.3M parameters at vocab 512: the default policy.
    "tiny": {
        **_QWEN3,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "vocab_size": 512,
    },
    # ~0.63M parameters: about a fifth of `tiny`, the default distillation student.
    "tiny-student": {
        **_QWEN3,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "vocab_size": 512,
    },
    # ~5.5M parameters at vocab 512, ~2.0M of them active per token: `tiny`'s attention, 8 experts of a
    # quarter of its MLP each, two per token (a mixture-of-experts policy to try the stages with).
    "tiny-moe": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 192,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "vocab_size": 512,
    },
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, vocab_size: int | None = None, **token_ids: int | list[int] | None) -> dict[str, Any]:
    """A copy of a preset's HF config, with the tokenizer's vocabulary size and special token ids."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    cfg = copy.deepcopy(PRESETS[name])
    if vocab_size is not None:
        cfg["vocab_size"] = int(vocab_size)
    cfg.update({k: v for k, v in token_ids.items() if v is not None})
    return cfg
