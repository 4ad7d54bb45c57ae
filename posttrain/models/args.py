"""Read the architecture hyper-parameters we need out of a Hugging Face `config.json` dict.

One decoder covers Llama 3.x, Qwen2.5, Qwen3, Qwen3-MoE and Qwen2-MoE; the family only changes a few
switches (q/k/v bias, q/k RMSNorm, rope scaling, which layers route tokens to experts, a gated shared
expert), so the config is normalized here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")


class ModelConfigError(ValueError):
    """A config.json the decoder cannot represent."""


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    initializer_range: float
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE); 0 experts: every layer dense.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelArgs":
        """Normalize an HF config dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        if hf.get("auto_map"):
            raise ModelConfigError(
                f"{source}: the model needs remote code (auto_map={sorted(hf['auto_map'])}); "
                "posttrain never runs trust_remote_code models"
            )
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window is not supported (every layer attends to the "
                                   "whole causal context)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            args = dict(
                vocab_size=int(hf["vocab_size"]),
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
            )
        except KeyError as e:
            raise ModelConfigError(f"{source}: missing key {e.args[0]!r}") from None
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(hf.get("rope_theta", rope.pop("rope_theta", 10000.0)))
        rope.pop("rope_theta", None)
        scaling = hf.get("rope_scaling") or rope or None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ModelConfigError(f"{source}: rope scaling type {kind!r} is not supported (default, llama3, linear)")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            # Qwen2 always biases q/k/v (Qwen2-MoE: its qkv_bias) and never o; Llama and Qwen3 follow
            # attention_bias for all four.
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
            or attention_bias,
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **_moe_args(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            **args,
        )


def _moe_args(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's and Qwen2-MoE's routing settings; which layers are sparse follows transformers' rule."""
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    if experts == 0:
        return {}
    step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
    layers = int(hf["num_hidden_layers"])
    return {
        "num_experts": experts,
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "sparse_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0)),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size", 0) or 0),
    }
