"""Expert parallelism over gloo processes on loopback: a Qwen3-MoE model with its experts split over
`parallel.ep` ranks (tokens sent to them by all-to-all) trains like one process.

The model is built on the meta device, parallelized (EP, then FSDP2), materialized and given rank 0's
weights by broadcast, as the stages do. Every layout trains 5 steps of the same global batch with
gradient clipping; losses and gradient norms must equal one process's within 1e-5 relative (float32
noise: the all-to-all regroups rows, FSDP2 reduces gradients in another order; routing decisions are
discrete, so a larger gap would mean a token went to another expert), and the gathered final weights
(every expert, from whichever rank holds it) within float32 noise of Adam's steps.
"""

import json
import os

import pytest
import torch

from spawn_testing import assert_same_weights, join_loopback_group, spawn

from posttrain.losses.ce import linear_cross_entropy
from posttrain.models import Transformer
from posttrain.models.moe import Experts
from posttrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_

MOE = {
    "model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "tie_word_embeddings": False, "initializer_range": 0.1, "router_aux_loss_coef": 0.0,
}
STEPS, BATCH, SEQ, LR = 5, 4, 12, 3e-3
# name -> (processes, memory, parallel)
LAYOUTS = {
    "ep2": (2, {}, {"ep": 2}),
    "ep2_checkpointed": (2, {"activation_checkpointing": 1}, {"ep": 2}),
    "ep2_of_4_shards": (4, {}, {"ep": 2}),  # two ranks hold each expert: FSDP2 shards it over them
}


def reference_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Transformer(MOE).state_dict()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 96, (BATCH, SEQ), generator=g), torch.randint(0, 96, (BATCH, SEQ), generator=g)


def train(model: torch.nn.Module, rows: slice, memory: dict) -> tuple[list[float], list[float]]:
    from posttrain.parallel import all_reduce_mean

    opt = build_optimizer(model, LR, 0.0, memory, foreach=False)
    sched = build_lr_scheduler(opt, 2, STEPS, 0.1)
    x, y = batch()
    losses, norms = [], []
    for _ in range(STEPS):
        loss = linear_cross_entropy(model(x[rows]), model.lm_head, y[rows], num_chunks=2)
        loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(all_reduce_mean(loss))
    return losses, norms


def worker(rank: int, world_size: int, port: int, out_dir: str, name: str) -> None:
    join_loopback_group(rank, world_size, port)
    from posttrain.parallel import (build_mesh, data_parallel_rank, destroy, gather_full_state_dict, init_distributed,
                                    load_full_state_dict, materialize, parallelize)

    _, memory, parallel = LAYOUTS[name]
    info = init_distributed()
    mesh = build_mesh(info, ep=parallel["ep"])
    with torch.device("meta"):
        model = Transformer(MOE)
    parallelize(model, mesh, memory, parallel)
    held = [e.held for e in model.modules() if isinstance(e, Experts)]
    materialize(model, info.device, init=False)
    load_full_state_dict(model, reference_weights() if info.is_main else {}, broadcast_from_rank0=True)
    dp_rank, dp_size = data_parallel_rank(mesh)
    losses, norms = train(model, slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size), memory)
    state = gather_full_state_dict(model)
    if info.is_main:
        torch.save(state, os.path.join(out_dir, f"{name}.pt"))
    with open(os.path.join(out_dir, f"{name}-{rank}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "held": held}, f)
    destroy()


@pytest.mark.distributed
@pytest.mark.slow
def test_expert_parallel_training_matches_one_process(tmp_path):
    model = Transformer(MOE)
    model.load_state_dict(reference_weights())
    ref_losses, ref_norms = train(model, slice(0, BATCH), {})
    ref_state = model.state_dict()
    assert ref_losses[-1] < ref_losses[0] - 0.1
    for name, (procs, _, parallel) in LAYOUTS.items():
        spawn(worker, procs, str(tmp_path), name)
        ranks = [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(procs)]
        share = MOE["num_experts"] // parallel["ep"]
        for r, got in enumerate(ranks):
            first = (r % parallel["ep"]) * share
            assert got["held"] == [list(range(first, first + share))] * MOE["num_hidden_layers"], (name, r)
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), name
            assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), name
        assert_same_weights(torch.load(tmp_path / f"{name}.pt", weights_only=True), ref_state, name)


def test_expert_parallel_refusals():
    from posttrain.parallel import parallelize
    from posttrain.parallel.distributed import DistInfo, build_mesh

    with pytest.raises(ValueError, match="need a device mesh"):
        parallelize(Transformer(MOE), None, {}, {"ep": 2})
    with pytest.raises(ValueError, match=r"parallel.ep \(2\) must divide the 1 FSDP shards"):
        build_mesh(DistInfo(0, 1, 0, torch.device("cpu")), ep=2)  # whether or not a process group exists
