"""Two gloo processes on loopback: FSDP2, HSDP, TP=2 (loss parallel) and QLoRA under FSDP2
follow the one-process run.

All layouts run in one spawned job (start-up dominates the cost). The full-weight layouts build
the model on the meta device, parallelize it, materialize it and receive rank 0's weights by
broadcast -- the path the stages use. QLoRA quantizes real weights, so it shards a built model.
Each trains 5 steps on the same global batch with grad-norm clipping and a warmup-cosine
schedule. Losses and grad norms must match the single-process reference within 1e-5 relative,
and the gathered final weights (merged, for QLoRA) within float32 noise.
"""

import json
import os

import pytest
import torch

from spawn_testing import assert_same_weights, join_loopback_group, spawn

from posttrain.losses.ce import full_cross_entropy, linear_cross_entropy
from posttrain.models import Transformer
from posttrain.models.lora import apply_lora, merged_state_dict
from posttrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_

TINY = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.02,
}
# NF4 shards along its scaler groups (16384 elements each): every projection needs >= 2 of them.
QLORA_TINY = {**TINY, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64}
STEPS, BATCH, SEQ, LR = 5, 4, 16, 3e-3
LAYOUTS = {
    "fsdp": ({"activation_checkpointing": 1}, {"tp": 1, "dp_replicate": 1}),
    "hsdp": ({}, {"tp": 1, "dp_replicate": 2}),
    "tp": ({}, {"tp": 2, "dp_replicate": 1}),
    "fsdp_qlora": ({}, {"tp": 1, "dp_replicate": 1}),
}


def reference_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Transformer(TINY).state_dict()


def qlora_model() -> Transformer:
    """Same on every process: seeded base weights, NF4 quantization and adapter init are deterministic."""
    torch.manual_seed(0)
    model = Transformer(QLORA_TINY)
    return apply_lora(model, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), quantize_base=True)


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch repeated, so the loss must fall."""
    g = torch.Generator().manual_seed(3)
    batch = (torch.randint(0, 128, (BATCH, SEQ), generator=g), torch.randint(0, 128, (BATCH, SEQ), generator=g))
    return [batch] * STEPS


def train_single_process(qlora: bool) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    if qlora:
        model = qlora_model()
    else:
        model = Transformer(TINY)
        model.load_state_dict(reference_weights())
    opt = build_optimizer(model, LR, 0.0, {}, foreach=False)
    sched = build_lr_scheduler(opt, 2, STEPS, 0.1)
    losses, norms = [], []
    for x, y in global_batches():
        loss = linear_cross_entropy(model(x), model.lm_head, y, num_chunks=2)
        loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, norms, merged_state_dict(model) if qlora else model.state_dict()


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_loopback_group(rank, world_size, port)
    from posttrain.parallel import (
        all_reduce_mean, build_mesh, data_parallel_rank, destroy, gather_full_state_dict,
        init_distributed, load_full_state_dict, loss_context, materialize, parallelize, uses_tensor_parallel,
    )

    info = init_distributed()
    results = {}
    for name, (memory_cfg, parallel_cfg) in LAYOUTS.items():
        mesh = build_mesh(info, parallel_cfg["tp"], parallel_cfg["dp_replicate"])
        if name == "fsdp_qlora":
            model = parallelize(qlora_model(), mesh, memory_cfg, parallel_cfg)
        else:
            with torch.device("meta"):
                model = Transformer(TINY)
            parallelize(model, mesh, memory_cfg, parallel_cfg)
            materialize(model, info.device, init=False)
            full = reference_weights() if info.is_main else {}
            load_full_state_dict(model, full, broadcast_from_rank0=True)
            assert all(type(v) is torch.Tensor for v in full.values())  # the caller's dict is left alone
        opt = build_optimizer(model, LR, 0.0, memory_cfg, foreach=False)
        sched = build_lr_scheduler(opt, 2, STEPS, 0.1)
        dp_rank, dp_size = data_parallel_rank(mesh)
        losses, norms = [], []
        for x, y in global_batches():
            rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
            with loss_context(mesh):
                hidden = model(x[rows])
                if uses_tensor_parallel(mesh):
                    loss = full_cross_entropy(hidden, model.lm_head, y[rows])
                else:
                    loss = linear_cross_entropy(hidden, model.lm_head, y[rows], num_chunks=2)
                loss.backward()
            norms.append(clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(all_reduce_mean(loss))
        state = gather_full_state_dict(model)
        if name == "fsdp_qlora":
            state = merged_state_dict(model, state)
        if info.is_main:
            torch.save(state, os.path.join(out_dir, f"{name}.pt"))
        results[name] = {"losses": losses, "norms": norms, "mesh": str(mesh)}
    if info.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    destroy()


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_hsdp_tp_qlora_match_single_process(tmp_path):
    references = {qlora: train_single_process(qlora) for qlora in (False, True)}
    spawn(worker, 2, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(LAYOUTS)
    for name, got in results.items():
        ref_losses, ref_norms, ref_state = references[name == "fsdp_qlora"]
        print(name, got["mesh"], got["losses"])
        assert ref_losses[-1] < ref_losses[0] - 0.1
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), name
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), name
        assert_same_weights(torch.load(tmp_path / f"{name}.pt", weights_only=True), ref_state, name)
