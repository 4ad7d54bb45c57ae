"""A decoder-only transformer for the families of `posttrain.models.args`, in plain PyTorch.

Parameter names are the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...) so a
state dict maps one-to-one onto safetensors files. The module knows nothing of parallelism:
`posttrain.parallel` shards it. `forward` returns final hidden states; the output projection is
`lm_head`, applied by the losses chunk by chunk so `[batch, seq, vocab]` logits need not exist.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.models.args import ModelArgs
from posttrain.models.attention import AttentionMask, attend, attention_mask, sliding_window_mask
from posttrain.models.moe import SparseMoE, load_balancing_loss


class RMSNorm(nn.Module):
    """Normalizes in float32; where the weight applies follows the family (`ModelArgs.norm_style`).

    cast_then_scale (Llama, Qwen, ...): cast back, then times the weight; scale_then_cast (OLMo 2):
    times the weight in float32, then cast; one_plus_weight (Gemma 3): times (1 + weight) in
    float32, then cast, the weight starting at zero.
    """

    def __init__(self, dim: int, eps: float, style: str = "cast_then_scale"):
        super().__init__()
        self.eps = eps
        self.style = style
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "cast_then_scale":
            return self.weight * x.to(dtype)
        if self.style == "scale_then_cast":
            return (self.weight * x).to(dtype)
        return (x * (1.0 + self.weight.float())).to(dtype)

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.style == "one_plus_weight" else nn.init.ones_)(self.weight)


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of `dim` rotated dims, with Llama-3 (`llama3`) or `linear` scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed from position ids on the fly: packed rows restart positions per document.

    `theta`/`scaling` default to the model's; Gemma 3's sliding layers have a theta of their own.
    """

    def __init__(self, args: ModelArgs, theta: float | None = None, scaling: dict[str, Any] | None = None):
        super().__init__()
        self.dim = args.rotary_dim
        self.theta = args.rope_theta if theta is None else theta
        self.scaling = args.rope_scaling if theta is None else scaling
        self.register_buffer("inv_freq", torch.empty(self.dim // 2), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_inv_freq(self.dim, self.theta, self.scaling).to(self.inv_freq.device))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; cos/sin: [B, S, R] (rotate-half convention of the HF checkpoints).

    R < D (partial rotary, Phi-3): the first R dims turn, the rest pass through.
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """Preallocated keys/values for every layer; `length` is how many positions are filled."""

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype):
        shape = (args.num_layers, batch_size, args.num_kv_heads, max_len, args.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        if end > self.k.shape[3]:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.k.shape[3]}")
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = args.head_dim
        self.scale = args.attn_scale
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        if args.fused_projections:  # Phi-3: one weight, rows q, then k, then v
            self.qkv_proj = nn.Linear(args.hidden_size, q_size + 2 * kv_size, bias=args.qkv_bias)
            self.split = (q_size, kv_size, kv_size)
        else:
            self.q_proj = nn.Linear(args.hidden_size, q_size, bias=args.qkv_bias)
            self.k_proj = nn.Linear(args.hidden_size, kv_size, bias=args.qkv_bias)
            self.v_proj = nn.Linear(args.hidden_size, kv_size, bias=args.qkv_bias)
        self.o_proj = nn.Linear(q_size, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            # Per head (Qwen3, Gemma 3) or over the whole projection, all heads at once (OLMo 2).
            per_head = args.qk_norm_per_head
            self.q_norm = RMSNorm(args.head_dim if per_head else q_size, args.rms_norm_eps, args.norm_style)
            self.k_norm = RMSNorm(args.head_dim if per_head else kv_size, args.rms_norm_eps, args.norm_style)
            self.norm_per_head = per_head

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: AttentionMask,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """`rope` None: this layer takes no rotary embedding (SmolLM3's no-rope layers)."""
        bsz, seq, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm") and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        # view(..., -1, head_dim): under tensor parallelism the local head count is a fraction.
        q, k, v = (t.view(bsz, seq, -1, self.head_dim) for t in (q, k, v))
        if hasattr(self, "q_norm") and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = attend(q, k, v, mask, causal=kv_cache is None, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.act = ACTIVATIONS[args.hidden_act]
        if args.fused_projections:  # Phi-3: rows gate, then up
            self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        else:
            self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
            self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """One block; its norms by `ModelArgs.norm_placement`, under the HF names of each family.

    pre (Llama, ...): x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x));
    post (OLMo 2): x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x));
    sandwich (Gemma 3): both, the MLP's pre-norm named pre_feedforward_layernorm.
    """

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.placement = args.norm_placement

        def norm() -> RMSNorm:
            return RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)

        if self.placement != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = norm()
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm()
        self.mlp = (SparseMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.experts_per_token,
                              args.norm_topk_prob, args.shared_expert_intermediate_size)
                    if layer_idx in args.sparse_layers else MLP(args))

    def forward(self, x, rope, mask, kv_cache=None):
        if self.placement == "pre":
            x = x + self.self_attn(self.input_layernorm(x), rope, mask, kv_cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        if self.placement == "post":
            x = x + self.post_attention_layernorm(self.self_attn(x, rope, mask, kv_cache))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderBody(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # ModuleDict keyed "0".."N-1" keeps HF names and lets parallelize() swap blocks by name.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i) for i in range(args.num_layers)})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_style)
        self.rotary_emb = RotaryEmbedding(args)
        if args.local_rope_theta is not None and args.sliding_layers:
            self.local_rotary_emb = RotaryEmbedding(args, theta=args.local_rope_theta)  # Gemma 3's sliding layers


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 at every document boundary of a packed row."""
    seq = document_ids.shape[1]
    idx = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start_idx


@contextlib.contextmanager
def _skip_module_init() -> Iterator[None]:
    """Skip nn.Linear/nn.Embedding's own random init while building.

    `init_weights` sets every tensor anyway, and on the meta device those inits go through
    torch._refs, which imports torch._dynamo: ~10 s of start-up in every stage process.
    """
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class Transformer(nn.Module):
    backend = "native"  # the model code, as `HFCausalLM.backend` says "transformers"; stages record it

    def __init__(self, hf_config: dict[str, Any]):
        super().__init__()
        self.hf_config = dict(hf_config)
        self.args = ModelArgs.from_hf(hf_config)
        # Each layer's rotary table: "global", "local" (Gemma 3's sliding layers), None (no rope).
        self.layer_rope = [
            None if i in self.args.no_rope_layers
            else "local" if self.args.local_rope_theta is not None and i in self.args.sliding_layers else "global"
            for i in range(self.args.num_layers)
        ]
        with _skip_module_init():
            self.model = DecoderBody(self.args)
            self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.aux_loss: torch.Tensor | None = None  # MoE: the last training forward's load-balancing loss
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    @property
    def tied_head(self) -> bool:
        """Whether the output projection is the input embedding (its `lm_head.weight` is then not written)."""
        return self.args.tie_word_embeddings

    def tie_weights(self) -> None:
        """Re-tie after `to_empty`/sharding, which can replace parameter objects."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, buffers_only: bool = False) -> None:
        """Random init (normal(0, initializer_range)) and rope tables; call after `to_empty` for meta-built models."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters()
            elif buffers_only:
                continue
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.args.initializer_range)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, S, D].

        `document_ids` ([B, S]) selects per-document causal attention for packed rows and derives
        position ids when none are given. `attn_mask` (boolean, broadcastable to [B, 1, S, T])
        is for generation with padding and a KV cache. The kernel follows from these and the
        device (`posttrain.models.attention`); its mask is built here once, for all layers.
        """
        if document_ids is not None and position_ids is None:
            position_ids = document_positions(document_ids)
        if position_ids is None:
            start = kv_cache.length if kv_cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        if self.args.embed_scale is not None:  # Gemma 3: the scale rounded to the embeddings' dtype
            x = x * torch.tensor(self.args.embed_scale, dtype=x.dtype, device=x.device)
        masks = self._masks(input_ids, document_ids, attn_mask, kv_cache, x.dtype)
        positions = position_ids.expand(x.shape[0], -1)
        ropes = {None: None, "global": self.model.rotary_emb(positions, x.dtype)}
        if hasattr(self.model, "local_rotary_emb"):
            ropes["local"] = self.model.local_rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers.values()):
            x = layer(x, ropes[self.layer_rope[i]], masks[self.args.window(i)], kv_cache)
        if kv_cache is not None:
            kv_cache.length += input_ids.shape[1]
        if self.args.num_experts:  # dense models set nothing here (no side effect for torch.compile)
            self._record_router_loss()
        return self.model.norm(x)

    def _masks(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None, attn_mask: torch.Tensor | None,
               kv_cache: KVCache | None, dtype: torch.dtype) -> dict[int | None, AttentionMask]:
        """One mask per distinct window of the layers (None: the full causal context), built once."""
        cached = kv_cache is not None
        masks = {None: attention_mask(document_ids, attn_mask, cached=cached, dtype=dtype)}
        if self.args.sliding_layers:
            past = kv_cache.length if cached else None
            masks[self.args.sliding_window] = sliding_window_mask(
                self.args.sliding_window, tuple(input_ids.shape), document_ids, attn_mask, past, input_ids.device, dtype)
        return masks

    def _record_router_loss(self) -> None:
        """`aux_loss`: the load-balancing loss of this forward's routing when it trains, else None."""
        self.aux_loss = None
        if self.training and torch.is_grad_enabled():
            logits = [layer.mlp.router_logits for layer in self.model.layers.values() if isinstance(layer.mlp, SparseMoE)]
            self.aux_loss = load_balancing_loss(logits, self.args.num_experts, self.args.experts_per_token)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits; only for short sequences (generation, tests). Training uses chunked losses."""
        return self.lm_head(hidden)

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
