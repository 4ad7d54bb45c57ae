"""Completions sampled during distillation: by the student (on-policy, GKD) or by the teacher (`teacher_samples`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

from posttrain.model_files import load_state_into
from posttrain.data.chat import shifted_labels
from posttrain.data.loader import Batches
from posttrain.data.packing import build_rows
from posttrain.generation import SamplingParams
from posttrain.generation.backend import NativeBackend
from posttrain.models import Transformer, document_positions
from posttrain.models.hf_backend import HFCausalLM, build_transformers_model
from posttrain.models.lora import merged_state_dict
from posttrain.rollouts import GENERATION_BATCH, Sampler
from posttrain.tokenizer import Tokenizer

SAMPLING_TEMPERATURE = 1.0  # on-policy completions come from the student's own distribution


def sampling_model(model: Transformer | HFCausalLM, mesh: DeviceMesh | None,
                   copy: Transformer | HFCausalLM | None = None) -> Transformer | HFCausalLM:
    """A model the KV-cache sampler can drive on each rank alone, holding `model`'s current weights.

    One process: `model` itself. Under a mesh: an unsharded copy (`copy`, refreshed in place, or a
    new one), since each rank's decode loop runs a different number of steps and cannot follow
    FSDP's collectives (a LoRA/QLoRA student's adapters merged into it). Collective under a mesh (every rank
    gathers the full weights).
    """
    if mesh is None:
        return model
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if copy is None:
        copy = _unsharded_like(model, next(iter(state.values())).device)
    load_state_into(copy, merged_state_dict(model, state), "distill: gathered weights")
    return copy.eval()


def _unsharded_like(model: Transformer | HFCausalLM, device: torch.device) -> Transformer | HFCausalLM:
    """An unsharded model of `model`'s config on its own code (weights to be loaded): the native one built on the
    meta device, transformers' built (and randomly initialized) on CPU."""
    if isinstance(model, HFCausalLM):
        return build_transformers_model(model.hf_config).to(device)
    with torch.device("meta"):
        copy = Transformer(model.hf_config)
    copy.to_empty(device=device)
    copy.tie_weights()
    copy.init_weights(buffers_only=True)
    return copy


def completion_batch(prompts: list[list[int]], completions: list[list[int]], max_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row per prompt + completion (cut at `max_len`), trained on the completion tokens only."""
    docs_ids, docs_labels = [], []
    for prompt, completion in zip(prompts, completions):
        ids = (prompt + completion)[:max_len]
        trained = ([False] * len(prompt) + [True] * len(completion))[:max_len]
        docs_ids.append(ids)
        docs_labels.append(shifted_labels(ids, trained))
    rows = build_rows(docs_ids, docs_labels, [[i] for i in range(len(prompts))], max_len, pad_id)
    batch = {k: torch.from_numpy(v.astype(np.int64)) for k, v in rows.items()}
    batch["position_ids"] = document_positions(batch["document_ids"])
    return batch


class SampledBatches:
    """Micro-batches of completions sampled for the `prompts` split (by the student for GKD, by the
    teacher for `teacher_samples`), `steps_ahead` micro-batches at a time.

    `refill(sampler, seed)` samples the prompts of the next `steps_ahead` micro-batches in one
    generation call; `next()` hands them out in order. The state (prompt position and the pending
    completions) makes a resumed run continue exactly.
    """

    def __init__(self, prompts: Batches, steps_ahead: int, max_new_tokens: int, max_len: int, tokenizer: Tokenizer):
        self.prompts, self.steps_ahead, self.max_len = prompts, steps_ahead, max_len
        self.tokenizer, self.pad_id = tokenizer, tokenizer.pad_id
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=SAMPLING_TEMPERATURE,
                                     stop_token_ids=tokenizer.eos_ids)
        self.pending: list[tuple[list[list[int]], list[list[int]]]] = []  # (prompts, completions) per micro-batch

    def empty(self) -> bool:
        return not self.pending

    def refill(self, sampler: Transformer | HFCausalLM, seed: int) -> int:
        """Sample the next `steps_ahead` micro-batches' completions; returns the tokens generated."""
        groups = [next(self.prompts)["prompt_ids"] for _ in range(self.steps_ahead)]
        flat = [p for group in groups for p in group]
        samples = Sampler(NativeBackend(sampler, self.pad_id, max_batch_size=GENERATION_BATCH), self.tokenizer).sample(
            flat, None, self.params, seed)
        start = 0
        for group in groups:
            self.pending.append((group, [s.tokens for s in samples[start : start + len(group)]]))
            start += len(group)
        return sum(len(s.tokens) for s in samples)

    def __next__(self) -> dict[str, torch.Tensor]:
        prompts, completions = self.pending.pop(0)
        return completion_batch(prompts, completions, self.max_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts.state_dict(), "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.pending = [(list(p), list(c)) for p, c in state["pending"]]
