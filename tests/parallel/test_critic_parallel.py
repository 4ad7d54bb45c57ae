"""PPO's critic under data parallelism: sharded with FSDP2 over two gloo ranks, each backpropagating its half of
the step's rows (its share of the step's tokens), it gets one process's gradient norm and takes its step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spawn_testing import join_loopback_group, spawn
from posttrain.rl.critic import Critic, ValueModel

TINY = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": False}
GRPO = {"critic_lr": 1e-3, "value_clip": 0.2, "max_grad_norm": 1.0}
ROWS, SEQ = 4, 10


def value_model() -> ValueModel:
    torch.manual_seed(0)
    return ValueModel(TINY)


def step_batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=g)
    mask = torch.ones(ROWS, SEQ, dtype=torch.bool)
    mask[:, :3] = False  # prompts
    mask[1, -4:] = False  # a short completion
    return ids, torch.randn(ROWS, SEQ, generator=g) * mask, torch.randn(ROWS, SEQ, generator=g), mask


def critic_step(critic: Critic, rows: slice) -> dict[str, float]:
    ids, old, returns, mask = step_batch()
    metrics = critic.backward(ids[rows], old[rows], returns[rows], mask[rows], denominator=float(mask.sum()))
    return {"value_loss": metrics["value_loss"], "grad_norm": critic.step()}


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_loopback_group(rank, world_size, port)
    from posttrain.parallel import build_mesh, destroy, init_distributed, parallelize

    info = init_distributed()
    mesh = build_mesh(info)
    model = value_model()
    parallelize(model, mesh, {})
    result = critic_step(Critic(model, GRPO, replicas=world_size), slice(rank * ROWS // 2, (rank + 1) * ROWS // 2))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    destroy()


@pytest.mark.distributed
@pytest.mark.slow
def test_a_sharded_critic_takes_one_process_gradient(tmp_path):
    one = critic_step(Critic(value_model(), GRPO), slice(0, ROWS))
    spawn(worker, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["grad_norm"] == ranks[1]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert ranks[0]["value_loss"] + ranks[1]["value_loss"] == pytest.approx(one["value_loss"], rel=1e-5)
