"""The chunked losses on a CUDA device: same values as the full computation, and the memory saving
measured exactly with the CUDA caching allocator's statistics. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain.losses.ce import full_cross_entropy, linear_cross_entropy
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.kd import kd_loss, token_divergence

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def inputs(tokens: int, dim: int, vocab: int, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    project = nn.Linear(dim, vocab, bias=False, device="cuda", dtype=dtype)
    hidden = torch.randn(2, tokens // 2, dim, device="cuda", dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (2, tokens // 2), device="cuda")
    labels[:, : tokens // 8] = IGNORE_INDEX
    return hidden, project, labels


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_linear_cross_entropy_matches_full_on_cuda(dtype, tol):
    hidden, project, labels = inputs(1024, 256, 32_000, dtype)
    got = linear_cross_entropy(hidden, project, labels, num_chunks=8)
    ref = full_cross_entropy(hidden, project, labels)
    assert got.dtype == torch.float32
    assert rel_err(got, ref) <= tol
    for g, r in zip(
        torch.autograd.grad(got, (hidden, project.weight)), torch.autograd.grad(ref, (hidden, project.weight))
    ):
        assert rel_err(g.float(), r.float()) <= tol


def test_kd_matches_full_on_cuda():
    hidden, student, labels = inputs(1024, 256, 32_000, seed=1)
    teacher = nn.Linear(384, 32_000, bias=False, device="cuda").requires_grad_(False)
    teacher_hidden = torch.randn(*hidden.shape[:-1], 384, device="cuda")
    got, _ = kd_loss(hidden, student, teacher_hidden, teacher, labels, kind="jsd", ce_weight=0.5, num_chunks=8)
    mask = (labels != IGNORE_INDEX).flatten()
    div = token_divergence(student(hidden).flatten(0, 1), teacher(teacher_hidden).flatten(0, 1), "jsd")
    ce = F.cross_entropy(student(hidden).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    ref = 0.5 * (div * mask).sum() / mask.sum() + 0.5 * ce
    assert rel_err(got, ref) <= 1e-5
    assert rel_err(torch.autograd.grad(got, hidden)[0], torch.autograd.grad(ref, hidden)[0]) <= 1e-5


def peak_cuda_bytes(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_chunked_cross_entropy_peak_memory_at_qwen3_vocab():
    """Qwen3's vocabulary, 8k tokens: the chunked loss's forward+backward peak is <= 0.25x the full one."""
    hidden, project, labels = inputs(8192, 512, 151_936, seed=2)

    def step(loss_fn):
        def run():
            loss_fn().backward()
            hidden.grad = project.weight.grad = None

        return run

    full = peak_cuda_bytes(step(lambda: full_cross_entropy(hidden, project, labels)))
    chunked = peak_cuda_bytes(step(lambda: linear_cross_entropy(hidden, project, labels, num_chunks=8)))
    print(f"peak above baseline: full {full / 2**20:.0f} MiB, chunked {chunked / 2**20:.0f} MiB")
    assert chunked <= 0.25 * full
