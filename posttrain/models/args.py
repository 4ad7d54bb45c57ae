"""Read the architecture hyper-parameters we need out of a Hugging Face `config.json` dict.

One decoder covers Llama 3.x, Qwen2.5, Qwen3, Qwen3-MoE, Qwen2-MoE, Mistral, OLMo 2, SmolLM3, Gemma 3
(text) and Phi-3; the family only changes a few switches (q/k/v bias, q/k RMSNorm, rope scaling, which
layers route tokens to experts, a gated shared expert, sliding-window layers, layers without rope,
where the norms sit, fused projections), so the config is normalized here once. docs/models.md has
the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Relative: `posttrain.workflow.model_names` loads this file and its sibling outside the package (no torch).
from .families import FAMILIES

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
NORM_STYLES = ("cast_then_scale", "scale_then_cast", "one_plus_weight")


class ModelConfigError(ValueError):
    """A config.json the decoder cannot represent."""


BACKENDS = ("auto", "native", "transformers")


def model_backend(hf_config: dict[str, Any], backend: str, source: str = "config.json") -> str:
    """Which model code runs `hf_config` under `model.backend`: "native" or "transformers".

    auto: the native port where one exists, else transformers' own model class for the model_type.
    Refused: remote code (`auto_map`), a model_type transformers has no causal LM for, `native` for a
    family without a port. transformers is imported only for an unported type, so the default dry run stays light.
    """
    if backend not in BACKENDS:
        raise ModelConfigError(f"model.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if hf_config.get("auto_map"):
        raise ModelConfigError(f"{source}: the model needs remote code (auto_map={sorted(hf_config['auto_map'])}); "
                               "posttrain never runs trust_remote_code models")
    model_type = hf_config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES and backend != "transformers":
        return "native"
    if backend == "native":
        raise ModelConfigError(f"{source}: model_type {model_type!r} has no native port (ported: "
                               f"{', '.join(SUPPORTED_MODEL_TYPES)}); set model.backend: auto or transformers "
                               "to run it on transformers' own model code")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelConfigError(f"{source}: model_type {model_type!r} is neither ported nor a causal LM transformers "
                               f"builds (model.backend: {backend})")
    return "transformers"


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
    # Sliding-window attention: in `sliding_layers` query q sees key k when 0 <= q - k < sliding_window.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    no_rope_layers: tuple[int, ...] = ()  # SmolLM3: layers whose q/k take no rotary embedding
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own theta (no scaling)
    partial_rotary_factor: float = 1.0  # Phi-3: rope turns the first head_dim * factor dims only
    qk_norm_per_head: bool = True  # OLMo 2: False, one RMSNorm over the whole q (k) projection
    norm_placement: str = "pre"  # "post": OLMo 2, x + norm(f(x)); "sandwich": Gemma 3, x + norm(f(norm(x)))
    norm_style: str = "cast_then_scale"  # OLMo 2: scale_then_cast; Gemma 3: one_plus_weight
    hidden_act: str = "silu"
    embed_scale: float | None = None  # Gemma 3: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5; Gemma 3: query_pre_attn_scalar ** -0.5
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (None: the whole causal context)."""
        return self.sliding_window if layer in self.sliding_layers else None

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
        hf = {**FAMILIES[model_type].defaults, **hf}
        _refuse_unported(hf, model_type, source)
        act_key = "hidden_activation" if model_type == "gemma3_text" else "hidden_act"
        hidden_act = hf.get(act_key) or "silu"
        if hidden_act not in ACTIVATIONS:
            raise ModelConfigError(f"{source}: {act_key} {hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
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
        head_dim = int(hf.get("head_dim") or hidden // heads)
        attention_bias = bool(hf.get("attention_bias", False)) and model_type not in ("mistral", "phi3")
        gemma = model_type == "gemma3_text"
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            **_rope_args(hf, model_type, source),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            # Qwen2 always biases q/k/v (Qwen2-MoE: its qkv_bias) and never o; Mistral and Phi-3 never
            # bias; the others follow attention_bias for all four.
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
            or attention_bias,
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=model_type in ("llama", "smollm3") and bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text"),
            qk_norm_per_head=model_type != "olmo2",
            **_moe_args(hf),
            **_window_args(hf, model_type, args["num_layers"], source),
            no_rope_layers=_no_rope_layers(hf, model_type, args["num_layers"], source),
            norm_placement={"olmo2": "post", "gemma3_text": "sandwich"}.get(model_type, "pre"),
            norm_style={"olmo2": "scale_then_cast", "gemma3_text": "one_plus_weight"}.get(model_type, "cast_then_scale"),
            hidden_act=hidden_act,
            embed_scale=hidden**0.5 if gemma else None,
            attn_scale=float(hf["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            fused_projections=model_type == "phi3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            **args,
        )


def _refuse_unported(hf: dict[str, Any], model_type: str, source: str) -> None:
    """Settings of a supported family that the decoder does not compute: refused, never approximated."""
    if hf.get("use_sliding_window") and model_type in ("qwen2_moe", "qwen3_moe"):
        raise ModelConfigError(f"{source}: use_sliding_window is not supported for {model_type} (every layer attends "
                               "to the whole causal context)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ModelConfigError(f"{source}: {key}={hf[key]} is not supported (the losses and generation apply "
                                   "lm_head without soft-capping; Gemma 3 checkpoints set it to null)")
    if hf.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{source}: use_bidirectional_attention is not supported (a causal decoder only)")


def _rope_args(hf: dict[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, Gemma 3's local theta and Phi-3's partial rotary factor, from the 4.x
    keys (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) or 5.x `rope_parameters` (per layer
    type for Gemma 3)."""
    params = dict(hf.get("rope_parameters") or {})
    out: dict[str, Any] = {}
    if model_type == "gemma3_text":
        local = dict(params.get("sliding_attention") or {})
        params = dict(params.get("full_attention") or {})
        out["local_rope_theta"] = float(local.pop("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
        if _rope_scaling(local, source) is not None:
            raise ModelConfigError(f"{source}: rope scaling of the sliding layers (rope_parameters.sliding_attention) "
                                   "is not supported")
    factor = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if model_type == "phi3":
        out["partial_rotary_factor"] = float(factor)
    out["rope_theta"] = float(hf.get("rope_theta", params.pop("rope_theta", FAMILIES[model_type].rope_theta)))
    params.pop("rope_theta", None)
    out["rope_scaling"] = _rope_scaling(hf.get("rope_scaling") or params or None, source)
    return out


def _rope_scaling(scaling: dict[str, Any] | None, source: str) -> dict[str, Any] | None:
    """The scaling dict with its `rope_type` named, or None for plain rope; unported kinds refused."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("longrope", "su"):
        raise ModelConfigError(f"{source}: rope scaling type {kind!r} (Phi-3 long-context rope) is not supported: "
                               "its frequencies switch with the longest position of each forward; use a checkpoint "
                               "without rope_scaling (e.g. a 4k-context Phi-3)")
    if kind not in ("default", "llama3", "linear"):
        raise ModelConfigError(f"{source}: rope scaling type {kind!r} is not supported (default, llama3, linear)")
    return None if kind == "default" else {**scaling, "rope_type": kind}


def _window_args(hf: dict[str, Any], model_type: str, layers: int, source: str) -> dict[str, Any]:
    """Which layers attend within `sliding_window`, by transformers' rule for each family."""
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window"):
        window = None
    if model_type in ("llama", "olmo2", "qwen2_moe", "qwen3_moe") or window is None:
        return {}
    if model_type in ("mistral", "phi3"):  # their attention windows every layer (layer_types unread)
        return {"sliding_window": int(window), "sliding_layers": tuple(range(layers))}
    types = hf.get("layer_types")
    if types is None:
        if model_type == "smollm3":  # transformers windows the layers without rope
            types = ["sliding_attention" if i in _no_rope_layers(hf, model_type, layers, source) else "full_attention"
                     for i in range(layers)]
        elif model_type == "gemma3_text":
            pattern = int(hf.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:  # qwen2, qwen3
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelConfigError(f"{source}: layer_types must list 'sliding_attention' or 'full_attention' for each of "
                               f"the {layers} layers, got {types!r}")
    return {"sliding_window": int(window), "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention")}


def _no_rope_layers(hf: dict[str, Any], model_type: str, layers: int, source: str) -> tuple[int, ...]:
    """SmolLM3's layers without rope: `no_rope_layers` flags each layer 1 (rope) or 0, else every
    `no_rope_layer_interval`-th layer goes without."""
    if model_type != "smollm3":
        return ()
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ModelConfigError(f"{source}: no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(i for i, has_rope in enumerate(flags) if not has_rope)


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
