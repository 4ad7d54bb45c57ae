"""One process: mesh validation, activation checkpointing and compile leave loss and gradients unchanged."""

import contextlib

import pytest
import torch

from posttrain.losses.ce import linear_cross_entropy
from posttrain.models import Transformer
from posttrain.parallel import (
    DistInfo,
    build_mesh,
    data_parallel_rank,
    gather_full_state_dict,
    load_full_state_dict,
    loss_context,
    parallelize,
)

TINY = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.02,
}


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TINY)


def loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    docs = torch.tensor([[0] * 10 + [1] * 6, [0] * 16])  # packed rows: per-document attention too
    loss = linear_cross_entropy(model(x, document_ids=docs), model.lm_head, y, num_chunks=2)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def grads_by_hf_name(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in grads.items()}


def test_build_mesh_refuses_sizes_that_do_not_divide_the_world():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="does not divide the world size 3"):
        build_mesh(DistInfo(0, 3, 0, cpu), tp=2)
    assert build_mesh(DistInfo(0, 1, 0, cpu)) is None  # one process without a process group
    assert data_parallel_rank(None) == (0, 1)
    with pytest.raises(ValueError, match="need a device mesh"):
        parallelize(make_model(), None, {}, {"tp": 2})


@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_keeps_loss_grads_and_names(every):
    plain_loss, plain_grads = loss_and_grads(make_model())
    model = parallelize(make_model(), None, {"activation_checkpointing": every}, {})
    wrapped = [name for name, block in model.model.layers.items() if hasattr(block, "_checkpoint_wrapped_module")]
    assert wrapped == [str(i) for i in range(0, TINY["num_hidden_layers"], every)]
    loss, grads = loss_and_grads(model)
    assert torch.equal(loss, plain_loss)
    grads = grads_by_hf_name(grads)
    assert set(grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-9, msg=name)
    # Checkpoint wrappers are invisible in state dicts: HF names load and save unchanged.
    assert set(gather_full_state_dict(model)) == set(make_model().state_dict())
    load_full_state_dict(model, make_model().state_dict())
    assert isinstance(loss_context(None), contextlib.nullcontext)  # no TP: no loss_parallel


def test_negative_checkpointing_and_unknown_compile_mode_are_refused():
    with pytest.raises(ValueError, match="activation_checkpointing"):
        parallelize(make_model(), None, {"activation_checkpointing": -1}, {})
    with pytest.raises(ValueError, match="memory.compile"):
        parallelize(make_model(), None, {"compile": "everything"}, {})


@pytest.mark.slow
def test_compiled_blocks_with_checkpointing_match_eager():
    """`memory.compile: blocks` (with checkpointing, as in a memory-lean run): same loss and grads."""
    plain_loss, plain_grads = loss_and_grads(make_model())
    model = parallelize(make_model(), None, {"compile": "blocks", "activation_checkpointing": 1}, {})
    loss, grads = loss_and_grads(model)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    grads = grads_by_hf_name(grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert set(model.state_dict()) == set(make_model().state_dict())
