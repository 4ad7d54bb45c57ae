"""Helpers shared by the tests that compare a model of ours with transformers' own."""

from __future__ import annotations

import torch


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
