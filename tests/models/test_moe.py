"""Qwen3-MoE and Qwen2-MoE: logits and the load-balancing loss equal transformers' `Qwen3MoeForCausalLM` and
`Qwen2MoeForCausalLM` on random configs (top-k with and without renormalization, dense layers between sparse
ones, Qwen2-MoE's gated shared expert), HF folders round-trip,
and a training step adds the loss with the config's coefficient."""

from __future__ import annotations

import pytest
import torch

from posttrain.model_files import load_hf_model, save_hf_model
from posttrain.models.moe import SparseMoE
from posttrain.training.optimization import Optimization

transformers = pytest.importorskip("transformers")

BASE = dict(model_type="qwen3_moe", vocab_size=97, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
            num_experts_per_tok=2, tie_word_embeddings=False, router_aux_loss_coef=0.01)
CONFIGS = {
    "top2-unnormalized": BASE,
    "top3-normalized-sparse-every-second": dict(BASE, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2),
    "dense-layer-0-tied": dict(BASE, mlp_only_layers=[0], tie_word_embeddings=True),
    # Qwen2-MoE: q/k/v biases, no q/k norms, a sigmoid-gated shared expert beside the routed ones.
    "qwen2-moe-shared-expert": dict(BASE, model_type="qwen2_moe", shared_expert_intermediate_size=40),
}
TOLERANCE = 1e-5  # float32; experts add in the same order, matmuls are blocked differently (fused gate/up in transformers)


def hf_moe(cfg: dict, folder):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval()
    with torch.no_grad():  # a router with real preferences, norms away from 1
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_aux_loss_equal_transformers(name, tmp_path):
    cfg = CONFIGS[name]
    hf = hf_moe(cfg, tmp_path / "hf")
    ours = load_hf_model(tmp_path / "hf")
    sparse = [i for i, layer in ours.model.layers.items() if isinstance(layer.mlp, SparseMoE)]
    expected_sparse = [str(i) for i in range(3) if i not in cfg.get("mlp_only_layers", [])
                       and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0]
    assert sparse == expected_sparse
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids, output_router_logits=True)
    ours.train()
    logits = ours.logits(ours(ids))
    assert (logits - reference.logits).abs().max().item() <= TOLERANCE
    assert ours.aux_loss.item() == pytest.approx(reference.aux_loss.item(), rel=1e-5)
    ours.eval()
    with torch.no_grad():
        ours(ids)
    assert ours.aux_loss is None  # only training forwards record it

    save_hf_model(ours.state_dict(), ours.hf_config, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert (back(ids).logits - reference.logits).abs().max().item() <= TOLERANCE


def test_a_training_backward_adds_the_load_balancing_loss_with_its_coefficient(tmp_path):
    from posttrain.workflow.schema import load_config

    hf_moe(BASE, tmp_path / "hf")
    memory = load_config()["memory"]
    section = {"lr": 0.1, "steps": 1, "warmup_steps": 0, "min_lr_ratio": 1.0, "max_grad_norm": None,
               "skip_nonfinite": 0, "grad_accum": 2}
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    grads = {}
    for with_aux in (True, False):
        model = load_hf_model(tmp_path / "hf").train()
        optimization = Optimization(model, section, memory, None, "sft")
        loss = model.logits(model(ids)).logsumexp(-1).mean()
        if not with_aux:
            loss = loss + model.aux_loss * (0.01 / 2)  # by hand: coefficient over the step's two forwards
            model.aux_loss = None
        optimization.backward(loss)
        grads[with_aux] = model.model.layers["0"].mlp.gate.weight.grad.clone()
    torch.testing.assert_close(grads[True], grads[False])
    assert grads[True].abs().sum() > 0


@pytest.mark.slow
def test_sft_trains_a_moe_policy_in_one_and_two_processes(tmp_path):
    """The `tiny-moe` preset through the SFT stage: held-out loss falls, the output is a Qwen3-MoE folder
    transformers reads with our logits, and FSDP2 over two processes gives one process's losses, with the
    experts split over them (`parallel.ep: 2`) too."""
    from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses, weights

    data = prepare_data(tmp_path, {"n_sft": 200})
    sft = {"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 1000, "log_every": 1}
    cfg = resolved_config("sft", "moe", sft=sft, model={"policy": "tiny-moe"})
    run_sft(cfg, data, tmp_path / "one")
    run_sft(cfg, data, tmp_path / "two", nproc=2)
    run_sft(resolved_config("sft", "moe-ep", sft=sft, model={"policy": "tiny-moe"}, parallel={"ep": 2}), data,
            tmp_path / "ep", nproc=2)
    one, two = train_losses(metrics(tmp_path / "one")), train_losses(metrics(tmp_path / "two"))
    assert len(one) == 6 and one[-1] < one[0]
    # Not dense SFT's 1e-5: routing is discontinuous, so the last-bit difference of FSDP2's gradient reduction can
    # send a near-tied token to another expert (measured: 4.7e-5 at one of six steps, 0 to 1e-6 at the others).
    assert two == pytest.approx(one, rel=2e-4)
    assert train_losses(metrics(tmp_path / "ep")) == pytest.approx(two, rel=2e-4)
    ep_weights, dp_weights = weights(tmp_path / "ep"), weights(tmp_path / "two")
    assert set(ep_weights) == set(dp_weights)  # rank 0 wrote every expert, the other rank's too
    for key, value in dp_weights.items():
        assert float((ep_weights[key] - value).norm() / value.norm()) < 1e-3, key
    ours = load_hf_model(tmp_path / "one").eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = torch.randint(0, ours.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours.logits(ours(ids)) - hf(ids).logits).abs().max().item() <= TOLERANCE


@pytest.mark.slow
@pytest.mark.distributed
def test_an_expert_parallel_run_killed_after_its_checkpoint_resumes_bitwise(tmp_path):
    """Each rank checkpoints only the experts it holds (distinct keys per rank in one DCP checkpoint) and reads
    them back: the resumed run ends with the uninterrupted run's weights."""
    from sft_testing import prepare_data, resolved_config, run_sft, weights

    data = prepare_data(tmp_path, {"n_sft": 120})
    sft = {"steps": 4, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1}
    cfg = resolved_config("sft", "moe-ep-resume", sft=sft, model={"policy": "tiny-moe"}, parallel={"ep": 2})
    run_sft(cfg, data, tmp_path / "whole", nproc=2)
    killed = run_sft(cfg, data, tmp_path / "killed", nproc=2, check=False, POSTTRAIN_TEST_SIGKILL_AT_STEP="3")
    assert killed.returncode != 0 and not (tmp_path / "killed").exists()
    assert "resuming from" in run_sft(cfg, data, tmp_path / "killed", nproc=2).stdout
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "killed")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_features_under_expert_parallelism_match_data_parallelism(tmp_path):
    """Activation checkpointing and the optimizer stepping in backward with the experts split over two ranks:
    the losses of plain data parallelism with the same memory settings."""
    from sft_testing import metrics, prepare_data, resolved_config, run_sft, train_losses

    data = prepare_data(tmp_path, {"n_sft": 120})
    sft = {"steps": 4, "batch_size": 8, "lr": 3e-3, "warmup_steps": 1, "checkpoint_every": 1000, "log_every": 1,
           "max_grad_norm": None}
    memory = {"activation_checkpointing": 1, "optimizer_in_backward": True}
    for name, parallel in (("dp", {}), ("ep", {"ep": 2})):
        cfg = resolved_config("sft", f"moe-mem-{name}", sft=sft, model={"policy": "tiny-moe"}, memory=memory,
                              parallel=parallel)
        run_sft(cfg, data, tmp_path / name, nproc=2)
    dp, ep = train_losses(metrics(tmp_path / "dp")), train_losses(metrics(tmp_path / "ep"))
    assert len(dp) == 4 and ep == pytest.approx(dp, rel=2e-4)  # routing's tolerance, as above
