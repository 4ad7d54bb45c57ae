"""Optimizers: in-backward equals the ordinary step bitwise, refusals, LR schedule, clipping, low-bit."""

import copy
import math
import time

import pytest
import torch

from posttrain.losses.ce import linear_cross_entropy
from posttrain.models import Transformer
from posttrain.optim import (
    OptimizerInBackward,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    load_optimizer_state_dict,
    optimizer_state_dict,
    lr_factor,
)

TINY = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.02,
}


def make_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TINY)


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 128, (2, 12), generator=g), torch.randint(0, 128, (2, 12), generator=g)) for _ in range(n)]


def train(model, optimizer, scheduler, data, max_grad_norm=None) -> list[float]:
    losses = []
    for x, y in data:
        loss = linear_cross_entropy(model(x), model.lm_head, y, num_chunks=2)
        loss.backward()
        if max_grad_norm is not None:
            clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_optimizer_in_backward_is_bitwise_equal_to_adamw():
    plain, inbwd = make_model(), make_model()
    data = batches(1) * 5  # one batch repeated: the loss must fall
    opt_a = build_optimizer(plain, 1e-2, 0.01, {}, foreach=False)
    opt_b = build_optimizer(inbwd, 1e-2, 0.01, {"optimizer_in_backward": True}, foreach=False)
    assert isinstance(opt_b, OptimizerInBackward)
    losses_a = train(plain, opt_a, build_lr_scheduler(opt_a, 2, 5, 0.1), data)
    losses_b = train(inbwd, opt_b, build_lr_scheduler(opt_b, 2, 5, 0.1), data)
    assert losses_a == losses_b
    assert losses_a[-1] < losses_a[0]
    for (name, p), q in zip(plain.named_parameters(), inbwd.parameters()):
        assert torch.equal(p, q), name
    assert all(p.grad is None for p in inbwd.parameters())  # the hooks free every gradient


def test_optimizer_in_backward_state_dict_resumes_exactly():
    data = batches(4)
    straight = make_model()
    opt = build_optimizer(straight, 1e-2, 0.0, {"optimizer_in_backward": True}, foreach=False)
    train(straight, opt, build_lr_scheduler(opt, 1, 4, 0.1), data)

    first = make_model()
    opt1 = build_optimizer(first, 1e-2, 0.0, {"optimizer_in_backward": True}, foreach=False)
    sched1 = build_lr_scheduler(opt1, 1, 4, 0.1)
    train(first, opt1, sched1, data[:2])
    saved_wrapper, saved_dcp = copy.deepcopy(opt1.state_dict()), copy.deepcopy(optimizer_state_dict(first, opt1))
    assert "model.layers.0.mlp.up_proj.weight" in saved_wrapper["per_param"]

    for load in ("wrapper", "dcp"):
        resumed = copy.deepcopy(first)  # same weights, fresh optimizer
        opt2 = build_optimizer(resumed, 1e-2, 0.0, {"optimizer_in_backward": True}, foreach=False)
        sched2 = build_lr_scheduler(opt2, 1, 4, 0.1)
        if load == "wrapper":
            opt2.load_state_dict(copy.deepcopy(saved_wrapper))
        else:
            load_optimizer_state_dict(resumed, opt2, copy.deepcopy(saved_dcp))
        sched2.load_state_dict(sched1.state_dict())
        train(resumed, opt2, sched2, data[2:])
        for p, q in zip(straight.parameters(), resumed.parameters()):
            assert torch.equal(p, q), load


def test_optimizer_in_backward_refuses_accumulation_and_clipping():
    model = make_model()
    with pytest.raises(ValueError, match="grad_accum"):
        build_optimizer(model, 1e-3, 0.0, {"optimizer_in_backward": True}, grad_accum=4)
    with pytest.raises(ValueError, match="max_grad_norm"):
        build_optimizer(model, 1e-3, 0.0, {"optimizer_in_backward": True}, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="low_bit_optimizer"):
        build_optimizer(model, 1e-3, 0.0, {"low_bit_optimizer": "adamw2bit"})


def test_only_trainable_parameters_are_optimized():
    model = make_model()
    for p in model.model.parameters():
        p.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer(model, 1e-3, 0.0, {})


def test_warmup_cosine_schedule_shape():
    model = make_model()
    opt = build_optimizer(model, 1.0, 0.0, {})
    sched = build_lr_scheduler(opt, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    lrs = []
    for _ in range(25):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # monotone decay after warmup
    assert lrs[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert lrs[20:] == pytest.approx([0.1] * 5)  # floor at min_lr_ratio
    assert lr_factor(0, 0, 10, 0.0) == 1.0
    with pytest.raises(ValueError, match="min_lr_ratio"):
        build_lr_scheduler(opt, 1, 10, 1.5)


def test_clip_grad_norm_matches_torch():
    a, b = make_model(), make_model()
    x, y = batches(1)[0]
    for m in (a, b):
        linear_cross_entropy(m(x), m.lm_head, y).backward()
    expected = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.01)
    got = clip_grad_norm_(b.parameters(), 0.01)
    assert got == pytest.approx(float(expected), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert clip_grad_norm_(b.parameters(), None) == pytest.approx(0.01, rel=1e-4)  # measures without clipping


@pytest.mark.parametrize("kind", ["adamw8bit", "adamw4bit"])
def test_low_bit_optimizers_construct(kind):
    model = torch.nn.Linear(256, 256)
    opt = build_optimizer(model, 1e-2, 0.1, {"low_bit_optimizer": kind})
    assert type(opt).__name__ == {"adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}[kind]
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.slow
def test_low_bit_optimizer_steps():
    """torchao AdamW4bit: quantized states, and a step moves the weights.

    The first step compiles torchao's update (90 s on an idle 2-core CPU). AdamW8bit shares the
    code path but compiled for 5+ minutes here, so only its construction is tested on CPU.
    """
    torch.manual_seed(0)
    # Low-bit states are only used for tensors of >= 4096 elements (blocks of 128 for 4-bit).
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    before = [p.detach().clone() for p in model.parameters()]
    opt = build_optimizer(model, 1e-2, 0.0, {"low_bit_optimizer": "adamw4bit"})
    start = time.time()
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    print(f"adamw4bit: first step {time.time() - start:.1f} s")
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    state = opt.state[model[0].weight]
    moments = [v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == (256, 256)]
    assert len(moments) == 2 and all(type(v).__name__ == "OptimState4bit" for v in moments)


@pytest.mark.parametrize("schedule", ["linear", "constant", "wsd"])
def test_each_schedule_warms_up_then_takes_its_shape(schedule):
    """After 2 warmup steps, 10 more to the end at min_lr_ratio 0.2 (wsd decays over the last 30%)."""
    model = make_model()
    opt = build_optimizer(model, 1.0, 0.0, {})
    sched = build_lr_scheduler(opt, warmup_steps=2, total_steps=12, min_lr_ratio=0.2, schedule=schedule,
                               decay_ratio=0.3)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    after = [(step - 2) / 10 for step in range(2, 14)]  # progress through the steps after warmup
    expected = {
        "linear": [1 - 0.8 * min(p, 1) for p in after],
        "constant": [1.0] * 12,
        "wsd": [1.0 if p <= 0.7 else 1 - 0.8 * (min(p, 1) - 0.7) / 0.3 for p in after],
    }[schedule]
    assert lrs[2:] == pytest.approx(expected)
    assert lrs[-1] == pytest.approx(1.0 if schedule == "constant" else 0.2)  # where it ended, past the last step
    if schedule == "wsd":
        assert lrs[2:9] == pytest.approx([1.0] * 7) and lrs[10] < 1.0  # stable for 70% of the steps, then decays
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        build_lr_scheduler(opt, 1, 10, 0.1, schedule="step")


def test_a_stage_section_names_its_schedule_and_the_schema_refuses_others():
    from posttrain.training.setup import build_optimizer_and_scheduler
    from posttrain.workflow.schema import ConfigError, load_config

    cfg = load_config(overrides={"sft": {"schedule": "wsd", "decay_ratio": 0.5}})
    assert all(cfg[s]["schedule"] == "cosine" for s in ("dpo", "grpo", "distill", "reward_model"))
    sft = {**cfg["sft"], "steps": 10, "warmup_steps": 0, "min_lr_ratio": 0.0}
    opt, sched = build_optimizer_and_scheduler(make_model(), sft, {})
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"] / sft["lr"])
        opt.step()
        sched.step()
    assert lrs[:6] == pytest.approx([1.0] * 6) and lrs[6:] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    with pytest.raises(ConfigError, match=r"dpo\.schedule"):
        load_config(overrides={"dpo": {"schedule": "step"}})

