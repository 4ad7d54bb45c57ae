"""Chunked KD divergences equal naive full-logit computations, are >= 0 and vanish for P == Q."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.kd import kd_loss, token_divergence

B, S, V = 2, 13, 97
STUDENT_D, TEACHER_D = 12, 20


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    student, teacher = nn.Linear(STUDENT_D, V, bias=False), nn.Linear(TEACHER_D, V, bias=False)
    with torch.no_grad():
        student.weight.copy_(torch.randn(V, STUDENT_D, generator=g) * 0.4)
        teacher.weight.copy_(torch.randn(V, TEACHER_D, generator=g) * 0.4)
    teacher.requires_grad_(False)
    student_h = torch.randn(B, S, STUDENT_D, generator=g, requires_grad=True)
    teacher_h = torch.randn(B, S, TEACHER_D, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    return student, teacher, student_h, teacher_h, labels


def naive_divergence(student_logits, teacher_logits, kind, beta, temperature):
    """Full-logit divergences through torch's kl_div, summed over the vocabulary."""
    q = torch.log_softmax(student_logits / temperature, -1)
    p = torch.log_softmax(teacher_logits / temperature, -1)

    def kl(a, b):  # KL(A || B) from log-probs
        return F.kl_div(b, a, log_target=True, reduction="none").sum(-1)

    if kind == "forward_kl":
        div = kl(p, q)
    elif kind == "reverse_kl":
        div = kl(q, p)
    else:
        m = torch.log(beta * p.exp() + (1 - beta) * q.exp())
        div = beta * kl(p, m) + (1 - beta) * kl(q, m)
    return div * temperature**2


def naive_kd(student, teacher, student_h, teacher_h, labels, kind, beta, temperature, ce_weight):
    s_logits, t_logits = student(student_h), teacher(teacher_h)  # the full [B, S, V] tensors
    mask = labels != IGNORE_INDEX
    div = naive_divergence(s_logits, t_logits, kind, beta, temperature)[mask].mean()
    ce = F.cross_entropy(s_logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    return (1 - ce_weight) * div + ce_weight * ce


CASES = [
    ("forward_kl", 0.5, 1.0, 0.0),
    ("reverse_kl", 0.5, 1.0, 0.0),
    ("jsd", 0.5, 1.0, 0.0),
    ("jsd", 0.1, 2.0, 0.3),
    ("forward_kl", 0.5, 0.7, 0.5),
    ("reverse_kl", 0.5, 1.5, 1.0),
]


@pytest.mark.parametrize("kind,beta,temperature,ce_weight", CASES)
@pytest.mark.parametrize("num_chunks", [1, 3, 64])
def test_chunked_kd_matches_full_logits(kind, beta, temperature, ce_weight, num_chunks):
    student, teacher, student_h, teacher_h, labels = setup(CASES.index((kind, beta, temperature, ce_weight)))
    got, metrics = kd_loss(
        student_h, student, teacher_h, teacher, labels,
        kind=kind, beta=beta, temperature=temperature, ce_weight=ce_weight, num_chunks=num_chunks,
    )
    ref = naive_kd(student, teacher, student_h, teacher_h, labels, kind, beta, temperature, ce_weight)
    assert rel_err(got, ref) <= 1e-5
    assert metrics["kd/divergence"].item() >= 0
    got_grads = torch.autograd.grad(got, (student_h, student.weight))
    for g, r in zip(got_grads, torch.autograd.grad(ref, (student_h, student.weight))):
        assert rel_err(g, r) <= 1e-5
    assert torch.all(got_grads[0][labels == IGNORE_INDEX] == 0)
    assert teacher.weight.grad is None


def test_sum_reduction_and_unchunked_path():
    student, teacher, student_h, teacher_h, labels = setup(20)
    mean, _ = kd_loss(student_h, student, teacher_h, teacher, labels, kind="jsd", num_chunks=4)
    total, _ = kd_loss(
        student_h, student, teacher_h, teacher, labels,
        kind="jsd", num_chunks=4, checkpoint_chunks=False, reduction="sum",
    )
    assert rel_err(total / (labels != IGNORE_INDEX).sum(), mean) <= 1e-6


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_divergences_nonnegative_and_zero_for_identical(kind):
    g = torch.Generator().manual_seed(30)
    a, b = torch.randn(50, V, generator=g) * 3, torch.randn(50, V, generator=g) * 3
    assert torch.all(token_divergence(a, b, kind, temperature=1.3) >= 0)
    assert torch.all(token_divergence(a, b, kind) > 1e-3)
    same = token_divergence(a, a + 5.0, kind)  # a shift of the logits is the same distribution
    assert same.abs().max().item() <= 1e-5


def test_identical_models_give_zero_divergence_and_gradient():
    student, _, student_h, _, labels = setup(40)
    loss, _ = kd_loss(student_h, student, student_h.detach(), student, labels, kind="reverse_kl", num_chunks=3)
    (grad,) = torch.autograd.grad(loss, student_h)
    assert abs(loss.item()) <= 1e-6 and grad.abs().max().item() <= 1e-6


def test_bad_inputs_raise():
    student, teacher, student_h, teacher_h, labels = setup(50)
    with pytest.raises(ValueError, match="distill.loss"):
        kd_loss(student_h, student, teacher_h, teacher, labels, kind="tvd")
    with pytest.raises(ValueError, match="beta"):
        kd_loss(student_h, student, teacher_h, teacher, labels, kind="jsd", beta=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        kd_loss(student_h, student, teacher_h, nn.Linear(TEACHER_D, V + 1, bias=False), labels)
    with pytest.raises(ValueError, match="different positions"):
        kd_loss(student_h, student, teacher_h[:, :-1], teacher, labels)
