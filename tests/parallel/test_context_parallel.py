"""Context parallelism over two gloo processes on loopback: rows split over `parallel.cp` ranks (head-tail
chunks, keys and values gathered per layer) give one process's losses and gradients.

The model is built on the meta device, parallelized (CP, then FSDP2 over `dp_shard_cp`), materialized and
given rank 0's weights by broadcast, as the stages build it. Each of the head's losses (SFT's summed
cross-entropy, DPO's sequence log-probs, GRPO's token log-probs) is computed on packed rows (documents
attending within themselves) and on plain causal rows, of a length the 2 x cp chunks do not divide (the
rows are padded), with ignored labels. Tolerance: float32 noise of a different summation order (attention
over a gathered, masked key set; sums split over ranks): 1e-5 relative on losses, 1e-4 on gradients.
"""

import json
from pathlib import Path

import pytest
import torch

from spawn_testing import join_loopback_group, spawn

from posttrain.losses.head import OutputHead
from posttrain.models import Transformer

TINY = {
    "model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "initializer_range": 0.05,
}
BATCH, SEQ = 2, 19
MEMORY = {"chunked_ce": True, "ce_chunks": 2}


def reference_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Transformer(TINY).state_dict()


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    labels[:, :3] = -100  # a prompt
    labels[1, -4:] = -100  # a padding tail
    docs = torch.tensor([[0] * 7 + [1] * 8 + [2] * 4, [0] * 12 + [1] * 7])
    return {"ids": ids, "labels": labels, "docs": docs}


def losses(model: Transformer, head: OutputHead, packed: bool, entropy_bonus: float) -> dict[str, torch.Tensor]:
    x = inputs()
    docs = x["docs"] if packed else None
    labels = x["labels"]
    mask = labels != -100
    out = {}
    out["sft"] = head.summed_cross_entropy(model(x["ids"], document_ids=docs), labels) / mask.sum()
    sums, counts = head.sequence_logprobs(model(x["ids"], document_ids=docs), labels)
    out["dpo"] = -(sums / counts).sum()
    logps, entropy = head.token_logprobs_and_entropy(model(x["ids"], document_ids=docs), labels, mask)
    advantages = torch.linspace(-1, 1, SEQ)[None]
    out["grpo"] = -(logps * advantages * mask).sum() / mask.sum() - entropy_bonus * (entropy * mask).sum() / mask.sum()
    return out


def run(model: Transformer, head: OutputHead, full_grads, entropy_bonus: float) -> dict[str, dict]:
    """Loss value and every parameter's full gradient, per loss and row kind."""
    result = {}
    for packed in (True, False):
        for name in ("sft", "dpo", "grpo"):
            loss = losses(model, head, packed, entropy_bonus)[name]
            loss.backward()
            result[f"{name}-{'packed' if packed else 'causal'}"] = {
                "loss": loss.item(), "grads": {k: full_grads(p.grad).tolist() for k, p in model.named_parameters()}}
            model.zero_grad()
    return result


# name -> (processes, parallel, GRPO's entropy bonus). Under TP the entropy of the vocabulary-sharded logits
# gets another gradient than one process's (2% on the embedding, with or without CP): GRPO logs the entropy
# and never backpropagates it, so the TP layout leaves the bonus out.
LAYOUTS = {"cp2": (2, {"cp": 2}, 0.01), "tp2-cp2": (4, {"cp": 2, "tp": 2}, 0.0)}


def worker(rank: int, world_size: int, port: int, out_dir: str, layout: str) -> None:
    join_loopback_group(rank, world_size, port)
    from posttrain.parallel import (build_mesh, destroy, init_distributed, load_full_state_dict, loss_context,
                                    materialize, parallelize)
    from posttrain.losses.head import plain

    _, parallel, bonus = LAYOUTS[layout]
    info = init_distributed()
    mesh = build_mesh(info, tp=parallel.get("tp", 1), cp=parallel["cp"])
    with torch.device("meta"):
        model = Transformer(TINY)
    parallelize(model, mesh, {}, parallel)
    materialize(model, info.device, init=False)
    load_full_state_dict(model, reference_weights() if info.is_main else {}, broadcast_from_rank0=True)
    assert plain(model(inputs()["ids"])).shape[1] == 10  # this rank's 10 of the 19 positions, padded to 20
    with loss_context(mesh):  # loss parallel under TP
        result = run(model, OutputHead(model, mesh, MEMORY), lambda g: g.full_tensor(), bonus)
    if info.is_main:
        Path(out_dir, f"{layout}.json").write_text(json.dumps(result))
    destroy()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_context_parallel_losses_and_gradients_match_one_process(layout, tmp_path):
    """cp 2 over 2 processes, and cp 2 with tensor parallelism 2 over 4 (one mesh: FSDP2 has one shard)."""
    model = Transformer(TINY)
    model.load_state_dict(reference_weights())
    processes, _, bonus = LAYOUTS[layout]
    reference = run(model, OutputHead(model, None, MEMORY), lambda g: g, bonus)
    spawn(worker, processes, str(tmp_path), layout)
    got = json.loads((tmp_path / f"{layout}.json").read_text())
    assert set(got) == set(reference) == {f"{n}-{k}" for n in ("sft", "dpo", "grpo") for k in ("packed", "causal")}
    assert reference["sft-packed"]["loss"] != pytest.approx(reference["sft-causal"]["loss"], rel=1e-3)
    for case, ref in reference.items():
        assert got[case]["loss"] == pytest.approx(ref["loss"], rel=1e-5), case
        for key, grad in ref["grads"].items():
            ours, theirs = torch.tensor(got[case]["grads"][key]), torch.tensor(grad)
            rel = float((ours - theirs).norm() / theirs.norm())
            assert rel < 1e-4, f"{case}: {key} gradient differs by {rel:.2e} (relative L2)"


def test_head_tail_shards_cover_every_position_once_and_balance_the_causal_work():
    from posttrain.parallel.context_parallel import ContextParallel

    cp = ContextParallel.__new__(ContextParallel)
    cp.size, cp.rank = 2, 0
    held = [cp.positions(19, torch.device("cpu"), r) for r in range(2)]
    assert cp.padded(19) == 20
    assert sorted(torch.cat(held).tolist()) == list(range(20))
    assert held[0].tolist() == [0, 1, 2, 3, 4, 15, 16, 17, 18, 19]
    assert sum(held[0].tolist()) == sum(held[1].tolist())  # as many causal keys on each rank
