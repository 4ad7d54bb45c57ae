"""Attention kernels (`posttrain.models.attention`) against the dense document mask.

FlexAttention (a block mask) and variable-length FlashAttention (document offsets) must give
what SDPA with `document_mask` gives, on packed rows (several documents of varying lengths and
a padding tail) and on padded rows (one document and its padding, an id of its own), as
`posttrain.data.packing` lays them out. Tolerances: float32 hidden states to atol 1e-5 (measured
on CPU: flex vs dense 1.4e-6; float32 vs float64 2e-6); float32 weight gradients, which reach
~5e3 here, to 1e-5 of their largest entry (float32 vs float64: 5e-7); bf16 (varlen vs dense) in
relative norm, 2e-2 for hidden states and 5e-2 for gradients (bf16 vs float64: 2.3e-2). The
CPU default stays the dense mask, bitwise. Each kernel test also runs a model whose layers 1 and 2
attend within a sliding window of WINDOW tokens (Qwen3 with use_sliding_window), shorter than many
documents, so the window's mask_mod / window_size is checked against the dense band. torch 2.13 has no FlexAttention backward on CPU: the
gradient test skips there with that reason. The varlen kernel needs CUDA; on CPU a reference
kernel (SDPA per document) stands in for it to check the flattening around it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.data.packing import pack_or_pad
from posttrain.models import Transformer, document_positions
from posttrain.models import attention
from posttrain.models.attention import VarlenMask, attention_backend, attention_mask, document_varlen

# As tests/models/test_models.py builds its models: GQA (4 query heads over 2), q/k norms, head_dim 32.
CFG = dict(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
SEQ = 160  # over one 128-token flex block: documents cross block boundaries
WINDOW = 24
WINDOWS = pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
FWD_ATOL = 1e-5  # float32 hidden states, flex vs dense
GRAD_RTOL = 1e-5  # float32 gradients: max error over the largest entry
BF16_RTOL = (2e-2, 5e-2)  # varlen vs dense in bf16: relative norm of the error, hidden states and gradients
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the varlen/flash kernels)")


def model(device: str = "cpu", dtype: torch.dtype = torch.float32, window: int | None = None) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(CFG if window is None else {**CFG, "use_sliding_window": True, "sliding_window": window,
                                                 "max_window_layers": 1})
    with torch.no_grad():  # non-trivial norms so a misrouted head or document shows
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m.to(device=device, dtype=dtype)


def rows(packing: bool, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, document_ids) [B, SEQ] from pack_or_pad: packed, or one padded document per row."""
    g = torch.Generator().manual_seed(1)
    lengths = [70, 9, 33, 150, 1, 58, 41, 17, 120, 26] if packing else [70, 150, 1, 120]
    docs = [torch.randint(1, 101, (n,), generator=g).tolist() for n in lengths]
    out = pack_or_pad(docs, docs, SEQ, pad_id=0, packing=packing)
    ids, doc_ids = (torch.from_numpy(out[k]).long().to(device) for k in ("input_ids", "document_ids"))
    if packing:
        assert (doc_ids.amax(1) >= 2).all(), "every packed row should hold several documents"
    return ids, doc_ids


def forward(m: Transformer, ids: torch.Tensor, doc_ids: torch.Tensor, backend: str, grad: bool = False):
    """Hidden states and, with `grad`, the gradients of every weight (embeddings included)."""
    with attention_backend(backend), torch.set_grad_enabled(grad):
        hidden = m(ids, document_ids=doc_ids)
    if not grad:
        return hidden, []
    probe = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2)).to(hidden)
    return hidden, torch.autograd.grad((hidden.float() * probe.float()).sum(), list(m.parameters()))


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference over the largest entry of `b` (gradients are sums: their scale varies)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def norm_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def flex_backward_supported(device: str) -> bool:
    q = torch.zeros(1, 1, 128, 16, device=device, requires_grad=True)
    try:
        attention._flex()(q, q, q)
    except NotImplementedError:  # torch 2.13: "FlexAttention does not support backward on CPU"
        return False
    return True


@WINDOWS
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_flex_forward_matches_dense(packing, window):
    m = model(window=window).eval()
    ids, doc_ids = rows(packing)
    flex, _ = forward(m, ids, doc_ids, "flex")
    dense, _ = forward(m, ids, doc_ids, "dense")
    torch.testing.assert_close(flex, dense, atol=FWD_ATOL, rtol=0)


@WINDOWS
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_flex_gradients_match_dense(device, packing, window):
    if not flex_backward_supported(device):
        pytest.skip(f"FlexAttention has no backward on {device} in torch {torch.__version__}")
    m = model(device, window=window)
    ids, doc_ids = rows(packing, device)
    flex, flex_grads = forward(m, ids, doc_ids, "flex", grad=True)
    dense, dense_grads = forward(m, ids, doc_ids, "dense", grad=True)
    torch.testing.assert_close(flex, dense, atol=FWD_ATOL, rtol=0)
    for (name, _), a, b in zip(m.named_parameters(), flex_grads, dense_grads):
        assert max_error(a, b) <= GRAD_RTOL, name


def test_cpu_default_is_bitwise_the_dense_mask(monkeypatch):
    """Packed rows on CPU: SDPA with the mask `document_mask` always built, and causal SDPA without ids."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    m = model()
    ids, doc_ids = rows(packing=True)
    seq = doc_ids.shape[1]
    old_mask = ((doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[:, None]
    hidden, grads = forward(m, ids, doc_ids, "auto", grad=True)
    with torch.no_grad():  # the explicit-mask path, which is what packed rows always ran
        ref = m(ids, position_ids=document_positions(doc_ids), attn_mask=old_mask)
    assert torch.equal(hidden, ref)
    _, dense_grads = forward(m, ids, doc_ids, "dense", grad=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, dense_grads))

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        m(ids, document_ids=doc_ids)
        m(ids)
    packed, causal = calls[: CFG["num_hidden_layers"]], calls[CFG["num_hidden_layers"] :]
    assert len(causal) == CFG["num_hidden_layers"]
    assert all(torch.equal(c["attn_mask"], old_mask) and c["is_causal"] is False and c["enable_gqa"] for c in packed)
    assert all(c["attn_mask"] is None and c["is_causal"] is True for c in causal)


def test_block_mask_is_built_once_per_forward(monkeypatch):
    built, kernels = [], []
    create, flex = attention.create_block_mask, attention._flex()

    def counting_create(*args, **kwargs):
        built.append(args[1:5])  # B, H, Q_LEN, KV_LEN
        return create(*args, **kwargs)

    monkeypatch.setattr(attention, "create_block_mask", counting_create)
    monkeypatch.setattr(attention, "_flex", lambda: lambda *a, **k: kernels.append(k["block_mask"]) or flex(*a, **k))
    m = model().eval()
    ids, doc_ids = rows(packing=True)
    forward(m, ids, doc_ids, "flex")
    assert built == [(doc_ids.shape[0], None, SEQ, SEQ)]  # H=None: any number of (local) heads
    assert len(kernels) == CFG["num_hidden_layers"] and all(k is kernels[0] for k in kernels)


def test_varlen_offsets_are_the_documents_of_the_flattened_rows():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    spans = document_varlen(doc_ids)
    assert spans.cu_seqlens.dtype == torch.int32
    assert spans.cu_seqlens.tolist() == [0, 3, 5, 6, 7, 12]
    assert spans.max_seqlen == 5


def test_cpu_defaults_and_forced_backends():
    doc_ids = torch.zeros(2, 8, dtype=torch.long)
    assert isinstance(attention_mask(doc_ids, None, cached=False, dtype=torch.bfloat16), torch.Tensor)
    assert attention_mask(None, None, cached=False, dtype=torch.float32) is None
    with attention_backend("varlen"), pytest.raises(ValueError, match="CUDA"):
        attention_mask(doc_ids, None, cached=False, dtype=torch.bfloat16)
    with attention_backend("flex"), pytest.raises(ValueError, match="KV cache"):
        attention_mask(doc_ids, None, cached=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="one of"):
        with attention_backend("flash"):  # type: ignore[arg-type]
            pass


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """varlen_attn's contract in plain SDPA, one document at a time: [T, H, D] in and out.

    window_size (left, 0): query i sees keys i - left .. i (left -1: all before it).
    """
    left, right = window_size
    assert right == 0 and torch.equal(cu_q, cu_k) and max_q == max_k
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        pos = torch.arange(b - a)
        seen = (pos[:, None] >= pos[None]) & ((pos[:, None] - pos[None] <= left) if left >= 0 else True)
        outs.append(F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), attn_mask=seen,
                                                   scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(outs)


@WINDOWS
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_varlen_flattening_on_cpu_with_a_reference_kernel(monkeypatch, packing, window):
    """The rows -> documents plumbing of the varlen path, forward and gradients, without a GPU."""
    import torch.nn.attention.varlen

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", reference_varlen_attn)
    monkeypatch.setattr(attention, "varlen_available", lambda device: True)
    m = model(dtype=torch.bfloat16, window=window)
    ids, doc_ids = rows(packing)
    assert isinstance(attention_mask(doc_ids, None, cached=False, dtype=torch.bfloat16), torch.Tensor)  # CPU: dense
    varlen, varlen_grads = forward(m, ids, doc_ids, "varlen", grad=True)
    dense, dense_grads = forward(m, ids, doc_ids, "dense", grad=True)
    assert norm_error(varlen, dense) <= BF16_RTOL[0]
    for (name, _), a, b in zip(m.named_parameters(), varlen_grads, dense_grads):
        assert norm_error(a, b) <= BF16_RTOL[1], name


@CUDA
@WINDOWS
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_varlen_matches_dense_on_cuda(packing, window):
    if not attention.varlen_available(torch.device("cuda")):
        pytest.skip("variable-length FlashAttention needs sm80+ and torch.nn.attention.varlen")
    m = model("cuda", torch.bfloat16, window)
    ids, doc_ids = rows(packing, "cuda")
    assert isinstance(attention_mask(doc_ids, None, cached=False, dtype=torch.bfloat16), VarlenMask)  # the default
    varlen, varlen_grads = forward(m, ids, doc_ids, "varlen", grad=True)
    dense, dense_grads = forward(m, ids, doc_ids, "dense", grad=True)
    assert norm_error(varlen, dense) <= BF16_RTOL[0]
    for (name, _), a, b in zip(m.named_parameters(), varlen_grads, dense_grads):
        assert norm_error(a, b) <= BF16_RTOL[1], name
