"""Helpers shared by the tests that compare a model of ours with transformers' own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 512  # above the tiny preset's tokenizer, which the SFT data is prepared with
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Families without a native port, dropout off (a training stage runs the model's own dropout settings).
FAMILIES = {
    "gpt_neox": dict(SMALL, hidden_dropout=0.0, attention_dropout=0.0),
    "starcoder2": dict(SMALL, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0),
    "granite": dict(SMALL, num_key_value_heads=2, logits_scaling=3.0, embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.3),
}

# The native ports beyond Llama and Qwen (and Qwen2's window), tiny and float32, windows shorter than the sequences.
NATIVE_VOCAB = 101
NATIVE_WINDOW = 7  # shorter than every sequence of the tests: the window decides what a query sees
NATIVE_BASE = dict(vocab_size=NATIVE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                   bos_token_id=None, eos_token_id=None)
NATIVE_FAMILIES = {
    "mistral": dict(NATIVE_BASE, model_type="mistral", sliding_window=NATIVE_WINDOW, tie_word_embeddings=False),
    # Qwen2 with use_sliding_window: the layers from max_window_layers on attend within the window.
    "qwen2-sliding": dict(NATIVE_BASE, model_type="qwen2", use_sliding_window=True, sliding_window=NATIVE_WINDOW,
                          max_window_layers=1),
    "olmo2": dict(NATIVE_BASE, model_type="olmo2", attention_bias=True),
    # Every second layer without rope (transformers' no_rope_layer_interval rule).
    "smollm3": dict(NATIVE_BASE, model_type="smollm3", num_hidden_layers=4, no_rope_layer_interval=2),
    # Local, global, local; the global layers' rope linearly scaled, the local ones' own theta.
    "gemma3_text": dict(NATIVE_BASE, model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=24,
                        sliding_window=NATIVE_WINDOW,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_theta=100_000.0, rope_local_base_freq=10_000.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # Fused projections, half the head dims rotated, every layer windowed (Phi-3-mini-4k's layout).
    "phi3": dict(NATIVE_BASE, model_type="phi3", partial_rotary_factor=0.5, sliding_window=NATIVE_WINDOW),
}


def save_family(name: str, folder: str | Path, **overrides: Any):
    """A random model of the family (a transformers-only one of FAMILIES, or a native port's of NATIVE_FAMILIES), saved
    as transformers saves it (norms and biases away from their init)."""
    import transformers

    torch.manual_seed(0)
    settings = NATIVE_FAMILIES[name] if name in NATIVE_FAMILIES else {"model_type": name, **FAMILIES.get(name, SMALL)}
    config = transformers.AutoConfig.for_model(**{**settings, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    return model


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of ragged prompts left-padded with 0, as our sampler pads them."""
    longest = max(map(len, prompts))
    padded = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    return padded, attention


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy `generate` of `new` tokens per prompt (no eos stop), the prompts left-padded."""
    padded, attention = left_padded(prompts)
    hf.generation_config.eos_token_id = None
    out = hf.generate(padded, attention_mask=attention, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[:, padded.shape[1]:].tolist()


def transformers_weights(folder: str | Path, resaved: str | Path) -> dict[str, torch.Tensor]:
    """What `AutoModelForCausalLM.from_pretrained(folder)` holds, under the checkpoint names: saved again to `resaved`
    (transformers renames some tensors on load and back on save) and read from there."""
    import transformers

    from sft_testing import weights

    transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(resaved)
    return weights(resaved)
