"""The attention kernel, chosen by the inputs and the device (never by the stage).

`Transformer.forward` turns its inputs into one `AttentionMask` per forward (`attention_mask`):
the same object reaches every layer, so a block mask or cumulative lengths are built once, and
activation checkpointing recomputes a layer with the kernel its forward used. `attend` then runs:

- no document ids, no mask: SDPA with `is_causal` (flash kernels on a GPU);
- packed rows (`document_ids`) on CUDA, bf16/fp16: variable-length FlashAttention
  (`torch.nn.attention.varlen`), rows flattened, one sequence per document; in float32 (or
  without varlen, or before sm80): FlexAttention with a document-causal `BlockMask`. No kernel
  there takes a dense `[B, 1, S, S]` mask, and none is built;
- packed rows on CPU: the dense document mask and SDPA, bitwise what the model always computed
  (pipeline results are compared byte for byte across commits; FlexAttention has no CPU backward);
- an explicit `attn_mask` or a KV cache (generation): SDPA with that mask, as before;
- a `GatheredKV` mask (context parallelism, `posttrain.parallel.context_parallel`): this rank's
  queries over every rank's keys and values, gathered along the sequence, with the mask of the
  queries' global positions.

Sliding-window layers (Mistral, Gemma 3's local layers, ...) get their own mask from
`sliding_window_mask`: key k is visible to query q when 0 <= q - k < window (transformers' rule),
on top of the document-causal rule. Rows without document ids count as one document each, so the
window takes the packed-row kernels above (dense on CPU, flex's mask_mod, varlen's `window_size`);
with a KV cache the window is a dense band over cache indices (left padding keeps every row's real
tokens contiguous, so index distance is token distance). Models without a window never build one:
their path is unchanged.

`attention_backend` forces a packed-row kernel for tests and benchmarks. Heads are taken from
the tensors (tensor parallelism shards them), and grouped-query attention is passed to each kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

Backend: TypeAlias = Literal["auto", "dense", "flex", "varlen"]
BACKENDS: tuple[Backend, ...] = ("auto", "dense", "flex", "varlen")
HALF_DTYPES = (torch.bfloat16, torch.float16)

_forced: Backend = "auto"  # a plain global, not a ContextVar: torch.compile reads it without a graph break


@contextlib.contextmanager
def attention_backend(name: Backend) -> Iterator[None]:
    """Force the kernel for packed rows inside the block ("auto": by device and dtype).

    For tests and benchmarks; it is read when a forward starts, so a checkpointed layer's
    backward recompute uses the forward's kernel even outside the block.
    """
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    saved, _forced = _forced, name
    try:
        yield
    finally:
        _forced = saved


@dataclass(frozen=True)
class VarlenMask:
    """Packed rows flattened into one sequence per document, for variable-length FlashAttention.

    `cu_seqlens` ([documents + 1] int32) are the documents' offsets into the flattened
    `B * S` tokens; `max_seqlen` is the longest document (a Python int, as the kernel wants).
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    window: int | None = None  # sliding window: each query sees its last `window` positions


@dataclass(frozen=True)
class GatheredKV:
    """Keys and values to gather from a sequence-sharded process group before attending.

    `gather(t)` turns this rank's `[B, H, S_local, D]` into the whole sequence `[B, H, S, D]` in
    position order (differentiably: the backward returns each rank its rows' gradients);
    `mask` (`[B, 1, S_local, S]` boolean) is what the local queries may see of it.
    """

    mask: torch.Tensor
    gather: Callable[[torch.Tensor], torch.Tensor]


AttentionMask: TypeAlias = torch.Tensor | BlockMask | VarlenMask | GatheredKV | None
"""What every layer gets: a boolean mask for SDPA, a FlexAttention block mask, varlen offsets,
gathered keys and values (context parallelism), or None (causal)."""


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] boolean: causal and inside one document (packed rows never attend across)."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_doc & causal)[:, None]


def window_band(q_len: int, kv_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] boolean: query i (at index kv_len - q_len + i) sees keys 0 <= q - k < window."""
    q = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    distance = q - torch.arange(kv_len, device=device)[None]
    return (distance >= 0) & (distance < window)


def document_block_mask(document_ids: torch.Tensor, window: int | None = None) -> BlockMask:
    """FlexAttention block mask with `document_mask`'s pattern (within `window`); on CUDA without a dense mask.

    Heads are broadcast (H=None), so it serves any number of local heads.
    """
    docs = document_ids

    def document_causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (docs[b, q] == docs[b, kv]) & (q >= kv)

    def document_window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (docs[b, q] == docs[b, kv]) & (q >= kv) & (q - kv < window)

    batch, seq = docs.shape
    # Eager create_block_mask evaluates the mask densely; compiled, it never stores it.
    compiled = docs.is_cuda and not torch.compiler.is_compiling()
    build = _compiled_create_block_mask() if compiled else create_block_mask
    return build(document_causal if window is None else document_window, batch, None, seq, seq, device=docs.device)


def document_varlen(document_ids: torch.Tensor) -> VarlenMask:
    """Offsets of the documents of all rows flattened; a document is a run of equal ids.

    (The loader's ids are runs: documents 0, 1, ... and the padding tail as one more.)
    Two host syncs (the start positions and the longest document), once per forward.
    """
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([document_ids.numel()])]).to(torch.int32)
    return VarlenMask(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


@functools.cache
def varlen_available(device: torch.device) -> bool:
    """Variable-length FlashAttention: CUDA sm80+ and torch.nn.attention.varlen importable.

    `posttrain.parallel.apply_compile` marks it `torch.compiler.assume_constant_result` (traced as its value: no
    graph break); marking it here would import torch._dynamo, ~2 s, in every process that imports the model."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        import torch.nn.attention.varlen  # noqa: F401  (imports torch._dynamo: only on CUDA)
    except ImportError:
        return False
    return True


def packed_backend(device: torch.device, dtype: torch.dtype) -> Backend:
    """The kernel for packed rows: the forced one, else by device and dtype (see the module doc)."""
    if _forced != "auto":
        return _forced
    if device.type != "cuda":
        return "dense"
    return "varlen" if dtype in HALF_DTYPES and varlen_available(device) else "flex"


def attention_mask(
    document_ids: torch.Tensor | None, attn_mask: torch.Tensor | None, cached: bool, dtype: torch.dtype
) -> AttentionMask:
    """The one mask object of a forward, for all layers (`dtype`: the activations').

    `document_ids` ([B, S]) win over `attn_mask`, as they always did; with a KV cache (`cached`)
    they give the dense mask, the only one a cache can extend.
    """
    if document_ids is None:
        return attn_mask
    backend = "dense" if cached and _forced == "auto" else packed_backend(document_ids.device, dtype)
    if backend == "dense":
        return document_mask(document_ids)
    if cached:
        raise ValueError(f"attention backend {backend!r} does not take a KV cache: use 'dense'")
    if backend == "flex":
        return document_block_mask(document_ids)
    if dtype not in HALF_DTYPES or not varlen_available(document_ids.device):
        raise ValueError(f"the varlen backend needs CUDA sm80+ and bf16/fp16, got {document_ids.device} {dtype}")
    return document_varlen(document_ids)


def sliding_window_mask(
    window: int,
    input_shape: tuple[int, int],
    document_ids: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    past: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> AttentionMask:
    """`attention_mask`'s mask for a layer attending within `window` (see the module doc).

    `input_shape` is the forward's [B, S]; `past` the KV cache's filled length (None: no cache).
    """
    if document_ids is None and attn_mask is None and past is None:
        document_ids = torch.zeros(input_shape, dtype=torch.long, device=device)  # each row one document
    if document_ids is not None:
        backend = "dense" if past is not None and _forced == "auto" else packed_backend(device, dtype)
        if backend == "dense":
            return document_mask(document_ids) & window_band(input_shape[1], input_shape[1], window, device)
        if past is not None:
            raise ValueError(f"attention backend {backend!r} does not take a KV cache: use 'dense'")
        if backend == "flex":
            return document_block_mask(document_ids, window)
        if dtype not in HALF_DTYPES or not varlen_available(device):
            raise ValueError(f"the varlen backend needs CUDA sm80+ and bf16/fp16, got {device} {dtype}")
        return dataclasses.replace(document_varlen(document_ids), window=window)
    if isinstance(attn_mask, GatheredKV):
        raise ValueError("parallel.cp does not support sliding-window attention layers: set parallel.cp=1")
    kv_len = attn_mask.shape[-1] if attn_mask is not None else past + input_shape[1]
    band = window_band(input_shape[1], kv_len, window, device)
    return band if attn_mask is None else attn_mask & band


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, causal: bool,
           scale: float | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, S, D] over k, v [B, Hkv, T, D] -> [B, Hq, S, D].

    `causal` applies when `mask` is None (SDPA's `is_causal`); decoding from a KV cache passes False.
    `scale` multiplies q.k (None: head_dim ** -0.5).
    """
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, GatheredKV):
        k, v, mask = mask.gather(k), mask.gather(v), mask.mask
    if isinstance(mask, BlockMask):
        return _flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    if isinstance(mask, VarlenMask):
        return _varlen(q, k, v, mask, gqa, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and causal, scale=scale, enable_gqa=gqa
    )


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: VarlenMask, gqa: bool,
            scale: float | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    bsz, heads, seq, head_dim = q.shape
    # [B, H, S, D] views of [B, S, H, D] projections: flattening the rows is free.
    flat = [t.transpose(1, 2).reshape(bsz * seq, -1, head_dim) for t in (q, k, v)]
    cu, longest = mask.cu_seqlens, mask.max_seqlen
    # FlashAttention's window (left, right) lets query i see keys i - left .. i + right.
    left = -1 if mask.window is None else mask.window - 1
    out = varlen_attn(*flat, cu, cu, longest, longest, scale=scale, window_size=(left, 0), enable_gqa=gqa)
    return out.view(bsz, seq, heads, head_dim).transpose(1, 2)


def _flex() -> Callable[..., torch.Tensor]:
    """Compiled FlexAttention; the plain function inside an already compiled region.

    Eager flex_attention materializes the scores: on CPU (B=4, S=256, 4 heads, fp32, one thread)
    it takes ~12x the compiled kernel, which matches dense SDPA.
    """
    return flex_attention if torch.compiler.is_compiling() else _compiled_flex()


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention)


@functools.cache
def _compiled_create_block_mask() -> Callable[..., BlockMask]:
    return torch.compile(create_block_mask)
