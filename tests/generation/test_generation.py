"""The KV-cache sampler against transformers' generate, and its log-probs against a full forward."""

import pytest
import torch

from posttrain.generation import SamplingParams, filter_logits, generate
from posttrain.models import Transformer

transformers = pytest.importorskip("transformers")

CFG = dict(model_type="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
           pad_token_id=0, eos_token_id=100)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CFG)).eval()
    ours = Transformer(hf.config.to_dict()).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def ragged_prompts(n=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 16, (n,), generator=g).tolist()
    return [torch.randint(1, 100, (k,), generator=g).tolist() for k in lengths]


def full_forward_logprobs(model, prompt, tokens, temperature=1.0):
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model.logits(model(seq))[0, len(prompt) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_greedy_equals_transformers_on_ragged_prompts(models):
    hf, ours = models
    prompts = ragged_prompts()
    out = generate(ours, prompts, SamplingParams(max_new_tokens=32))
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention = (ids != 0).long()
    for i, p in enumerate(prompts):
        attention[i, width - len(p) :] = 1
    ref = hf.generate(ids, attention_mask=attention, do_sample=False, max_new_tokens=32, min_new_tokens=32,
                      pad_token_id=0, eos_token_id=None)
    for i in range(len(prompts)):
        assert out.tokens[i] == ref[i, width:].tolist()
        lp = full_forward_logprobs(ours, prompts[i], out.tokens[i])
        assert (lp - torch.tensor(out.logprobs[i])).abs().max().item() <= 1e-4


def test_sampled_logprobs_are_the_tempered_distribution(models):
    _, ours = models
    prompts = ragged_prompts(4, seed=2)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.9)
    out = generate(ours, prompts, params, generator=torch.Generator().manual_seed(0))
    again = generate(ours, prompts, params, generator=torch.Generator().manual_seed(0))
    assert out.tokens == again.tokens
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        assert (full_forward_logprobs(ours, p, toks, 0.7) - torch.tensor(lps)).abs().max().item() <= 1e-4


def test_stops_at_eos_and_stop_strings(models):
    _, ours = models
    prompts = ragged_prompts(3, seed=3)
    free = generate(ours, prompts, SamplingParams(max_new_tokens=10))
    stop_id = free.tokens[0][3]
    out = generate(ours, prompts, SamplingParams(max_new_tokens=10, stop_token_ids=[stop_id]))
    assert out.tokens[0] == free.tokens[0][: free.tokens[0].index(stop_id) + 1]
    assert out.finish_reasons[0] == "stop"
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    target = str(free.tokens[1][2])
    out = generate(ours, prompts, SamplingParams(max_new_tokens=10, stop_strings=[target]), decode=decode)
    assert target in decode(out.tokens[1]) and target not in decode(out.tokens[1][:-1])


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, None)[0, 2:]).all()
    kept = ~torch.isinf(filter_logits(logits, None, 0.8))
    assert kept.tolist() == [[True, True, False, False]]


def test_bad_params():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
