"""One CUDA device: bf16 mixed precision under FSDP2, optimizer-in-backward, torchao low-bit AdamW,
checkpointing + compile, and QLoRA in bf16. Skipped (with the reason) where there is no GPU."""

import pytest
import torch

from posttrain.losses.ce import linear_cross_entropy
from posttrain.models import Transformer
from posttrain.models.lora import apply_lora, merged_state_dict
from posttrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from posttrain.parallel import (
    build_mesh,
    destroy,
    gather_full_state_dict,
    init_distributed,
    load_full_state_dict,
    materialize,
    parallelize,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16, NCCL, torchao CUDA kernels)"),
]

CFG = {
    "model_type": "qwen3", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.02,
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def mesh():
    """A one-process NCCL group (created by `init_distributed` on CUDA), torn down after the module."""
    info = init_distributed()
    yield info, build_mesh(info)
    destroy()


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Transformer(CFG).state_dict()


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    return x, x.roll(-1, 1)


def sharded_model(mesh, weights, memory):
    info, device_mesh = mesh
    with torch.device("meta"):
        model = Transformer(CFG)
    parallelize(model, device_mesh, memory, {})
    materialize(model, info.device, init=False)
    load_full_state_dict(model, weights)
    return model


def train(model, memory, batch, steps=6, foreach=None, clip=True) -> list[float]:
    """Steps of AdamW with warmup-cosine; clipping at 1.0 unless off or optimizer-in-backward."""
    clip = clip and not memory.get("optimizer_in_backward", False)
    opt = build_optimizer(model, 1e-3, 0.0, memory, max_grad_norm=1.0 if clip else None, foreach=foreach)
    sched = build_lr_scheduler(opt, 2, steps, 0.1)
    x, y = batch
    losses = []
    for _ in range(steps):
        loss = linear_cross_entropy(model(x), model.lm_head, y, num_chunks=4)
        loss.backward()
        if clip:
            clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_init_distributed_on_cuda_makes_a_one_rank_fsdp_mesh(mesh):
    info, device_mesh = mesh
    assert info.device.type == "cuda" and torch.distributed.get_backend() == "nccl"
    assert device_mesh is not None and device_mesh.size() == 1


def test_bf16_mixed_precision_follows_float32(mesh, weights, batch):
    fp32 = train(sharded_model(mesh, weights, {}), {}, batch)
    model = sharded_model(mesh, weights, {"mixed_precision": True})
    bf16 = train(model, {"mixed_precision": True}, batch)
    assert bf16[-1] < bf16[0] - 0.1
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 master weights


def test_checkpointing_and_compiled_blocks_match_mixed_precision(mesh, weights, batch):
    plain = train(sharded_model(mesh, weights, {"mixed_precision": True}), {}, batch, steps=3)
    memory = {"mixed_precision": True, "activation_checkpointing": 1, "compile": "blocks"}
    compiled = train(sharded_model(mesh, weights, memory), memory, batch, steps=3)
    assert compiled == pytest.approx(plain, rel=1e-2)


def test_optimizer_in_backward_is_bitwise_equal_on_cuda(mesh, weights, batch):
    plain, in_backward = sharded_model(mesh, weights, {}), sharded_model(mesh, weights, {"optimizer_in_backward": True})
    losses = train(plain, {}, batch, steps=5, foreach=False, clip=False)
    assert train(in_backward, {"optimizer_in_backward": True}, batch, steps=5, foreach=False) == losses
    assert losses[-1] < losses[0]
    sa, sb = gather_full_state_dict(plain), gather_full_state_dict(in_backward)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["adamw8bit", "adamw4bit"])
def test_low_bit_optimizers_train_on_cuda(mesh, weights, batch, kind):
    memory = {"mixed_precision": True, "low_bit_optimizer": kind}
    losses = train(sharded_model(mesh, weights, memory), memory, batch)
    assert losses[-1] < losses[0] - 0.1


def test_qlora_bf16_trains_and_merges(mesh, weights, batch):
    info, device_mesh = mesh
    model = Transformer(CFG)
    model.load_state_dict(weights)
    model = model.to(info.device, torch.bfloat16)
    apply_lora(model, 16, 32, targets=TARGETS, quantize_base=True)
    parallelize(model, device_mesh, {}, {})
    losses = train(model, {}, batch)
    assert losses[-1] < losses[0] - 0.05
    merged = merged_state_dict(model, gather_full_state_dict(model))
    plain = Transformer(CFG).to(info.device, torch.bfloat16)
    load_full_state_dict(plain, merged)
    x, _ = batch
    with torch.no_grad():
        torch.testing.assert_close(plain(x[:1]).float(), model(x[:1]).float(), rtol=0.05, atol=0.05)
