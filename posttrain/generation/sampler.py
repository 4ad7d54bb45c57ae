"""Batched sampling with a KV cache (ours, preallocated; transformers' own for `HFCausalLM`).

Ragged prompts are left-padded so every row decodes at the same cache index; padding is masked
out of attention and position ids count real tokens only, which keeps each row's numerics those
of an unpadded forward. Returned log-probabilities are those of the sampling distribution
(logits / temperature, before top-k/top-p), which is what RL importance ratios need; greedy
decoding returns the plain log-softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from posttrain.models import KVCache, Transformer
from posttrain.models.hf_backend import HFCausalLM


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # generated ids per prompt, up to and including the stop token
    logprobs: list[list[float]]  # log-probability of each generated id
    finish_reasons: list[str]  # "stop" or "length"


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Mask logits outside the top-k set and outside the smallest nucleus reaching top_p."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    if params.temperature == 0:
        logprobs = logits.float().log_softmax(-1)
        token = logits.argmax(-1)
    else:
        scaled = logits.float() / params.temperature
        logprobs = scaled.log_softmax(-1)
        probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


CachedForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cached_forward(model: Transformer | HFCausalLM, bsz: int, total: int, device: torch.device,
                   dtype: torch.dtype) -> CachedForward:
    """(new ids, their positions, valid positions so far [B, T]) -> the last position's logits, through a KV cache
    of the model's kind: ours (preallocated, boolean masks) or transformers' own (`HFCausalLM.new_cache`)."""
    if isinstance(model, HFCausalLM):
        hf_cache = model.new_cache()

        def hf_forward(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            return model.lm_head(model(ids, position_ids=positions, attn_mask=valid, kv_cache=hf_cache)[:, -1])

        return hf_forward
    cache = KVCache(model.args, bsz, total, device, dtype)

    def native_forward(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        if cache.length == 0:  # the prompts: causal over the valid positions
            n = ids.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            eye = torch.eye(n, dtype=torch.bool, device=device)
            # Pad queries attend to themselves only, so no softmax row is empty.
            mask = ((causal & valid[:, None, :]) | eye)[:, None]
        else:
            mask = valid[:, None, None, :]
        return model.lm_head(model(ids, position_ids=positions, attn_mask=mask, kv_cache=cache)[:, -1])

    return native_forward


@torch.inference_mode()
def generate(
    model: Transformer | HFCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    decode: Callable[[list[int]], str] | None = None,
) -> GenerationOutput:
    """Sample continuations of token-id prompts. `decode` is needed only for `stop_strings`."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate() needs at least one prompt and no empty prompt")
    if params.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    bsz, prompt_len = len(prompts), max(len(p) for p in prompts)
    total = prompt_len + params.max_new_tokens

    input_ids = torch.full((bsz, prompt_len), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(bsz, total, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        input_ids[i, prompt_len - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        valid[i, prompt_len - len(p) : prompt_len] = True
    positions = (valid[:, :prompt_len].long().cumsum(-1) - 1).clamp(min=0)
    forward = cached_forward(model, bsz, total, device, dtype)
    logits = forward(input_ids, positions, valid[:, :prompt_len])
    next_pos = positions[:, -1] + 1

    stop_ids = torch.as_tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
    out_tokens = torch.full((bsz, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(bsz, params.max_new_tokens, device=device)
    lengths = torch.full((bsz,), params.max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    for step in range(params.max_new_tokens):
        token, logprob = _pick(logits, params, generator)
        out_tokens[:, step] = torch.where(done, pad_id, token)
        out_logprobs[:, step] = torch.where(done, 0.0, logprob)
        newly = ~done & torch.isin(token, stop_ids)
        if params.stop_strings:
            for i in (~done & ~newly).nonzero().flatten().tolist():
                text = decode(out_tokens[i, : step + 1].tolist())
                if any(s in text for s in params.stop_strings):
                    newly[i] = True
        lengths = torch.where(newly, step + 1, lengths)
        done |= newly
        if bool(done.all()) or step == params.max_new_tokens - 1:
            break
        valid[:, prompt_len + step] = True
        logits = forward(token[:, None], next_pos[:, None], valid[:, : prompt_len + step + 1])
        next_pos = next_pos + 1

    tokens, logprobs, reasons = [], [], []
    for i in range(bsz):
        n = int(lengths[i])
        tokens.append(out_tokens[i, :n].tolist())
        logprobs.append(out_logprobs[i, :n].tolist())
        reasons.append("stop" if bool(done[i]) else "length")
    return GenerationOutput(tokens, logprobs, reasons)
