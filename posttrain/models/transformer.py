"""A decoder-only transformer for the Llama 3.x, Qwen2.5 and Qwen3 families, in plain PyTorch.

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
from posttrain.models.attention import AttentionMask, attend, attention_mask
from posttrain.models.moe import SparseMoE, load_balancing_loss


class RMSNorm(nn.Module):
    """Normalizes in float32 and casts back before the weight, as the reference implementations do."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 (`llama3`) or `linear` scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
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
    """cos/sin tables computed from position ids on the fly: packed rows restart positions per document."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.register_buffer("inv_freq", torch.empty(args.head_dim // 2), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_inv_freq(self.args).to(self.inv_freq.device))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; cos/sin: [B, S, D] (rotate-half convention of the HF checkpoints)."""
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
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # view(..., -1, head_dim): under tensor parallelism the local head count is a fraction.
        q = self.q_proj(x).view(bsz, seq, -1, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, -1, self.head_dim)
        v = self.v_proj(x).view(bsz, seq, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = attend(q, k, v, mask, causal=kv_cache is None)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = (SparseMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.experts_per_token,
                              args.norm_topk_prob, args.shared_expert_intermediate_size)
                    if layer_idx in args.sparse_layers else MLP(args))

    def forward(self, x, rope, mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBody(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # ModuleDict keyed "0".."N-1" keeps HF names and lets parallelize() swap blocks by name.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i) for i in range(args.num_layers)})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args)


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
    def __init__(self, hf_config: dict[str, Any]):
        super().__init__()
        self.hf_config = dict(hf_config)
        self.args = ModelArgs.from_hf(hf_config)
        with _skip_module_init():
            self.model = DecoderBody(self.args)
            self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.aux_loss: torch.Tensor | None = None  # MoE: the last training forward's load-balancing loss
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

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
        mask = attention_mask(document_ids, attn_mask, cached=kv_cache is not None, dtype=x.dtype)
        rope = self.model.rotary_emb(position_ids.expand(x.shape[0], -1), x.dtype)
        for layer in self.model.layers.values():
            x = layer(x, rope, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.length += input_ids.shape[1]
        if self.args.num_experts:  # dense models set nothing here (no side effect for torch.compile)
            self._record_router_loss()
        return self.model.norm(x)

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
