"""The transformers backend: a family without a native port runs on `AutoModelForCausalLM`'s own code.

`HFCausalLM` wraps the model transformers builds (never remote code) so the stages see what they
see of `Transformer`: `forward` returns the final hidden states as the output projection takes them
(Granite's `logits_scaling`, Cohere's `logit_scale` folded in), `lm_head` is that projection (the
model's output embeddings, whatever its own name), and the parameter names are the model's HF names:
the wrapper registers the model's children as its own, so a state dict is its checkpoint.

Packed rows: where the model's forward takes `position_ids`, each document's positions restart at 0
and transformers' masks keep attention inside each document (its packed-sequence rule); otherwise
the documents are cut out into right-padded rows with an attention mask, and put back.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import nn

from posttrain.models.args import ModelConfigError
from posttrain.models.transformer import document_positions

# Config keys by which a CausalLM's forward changes the output projection's logits; divided/multiplied here.
_LOGIT_DIVISOR, _LOGIT_MULTIPLIER = "logits_scaling", "logit_scale"
PARITY_TOLERANCE = 1e-4


def transformers_config(hf_config: dict[str, Any], source: str = "config.json") -> Any:
    """transformers' config object for an HF config dict (its own class, never remote code)."""
    from transformers import AutoConfig

    if hf_config.get("auto_map"):
        raise ModelConfigError(f"{source}: the model needs remote code (auto_map); posttrain never runs trust_remote_code models")
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "transformers_version")}
    try:
        return AutoConfig.for_model(hf_config["model_type"], **fields)
    except (KeyError, ValueError) as e:
        raise ModelConfigError(f"{source}: transformers cannot build model_type {hf_config.get('model_type')!r}: {e}") from None


class TransformersModel(nn.Module):
    """A model transformers builds, wrapped so that its state dict is its checkpoint: the wrapped model is not a
    registered child, its children are, under their own names (the HF names)."""

    backend = "transformers"

    def __init__(self, wrapped: nn.Module, hf_config: dict[str, Any]):
        super().__init__()
        object.__setattr__(self, "wrapped", wrapped)
        for name, child in wrapped.named_children():
            self.add_module(name, child)
        self.hf_config = dict(hf_config)

    def train(self, mode: bool = True) -> TransformersModel:
        """Also flip the wrapped model's own flag (its forward reads `self.training`)."""
        self.wrapped.training = mode
        return super().train(mode)

    def checkpoint_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict under the names the model's checkpoints use (transformers renames some on load:
        GPT-NeoX's embed_out is its lm_head), as `save_pretrained` writes them."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.wrapped, dict(state))


class HFCausalLM(TransformersModel):
    """A transformers causal LM looking like `Transformer`: hidden states out, `lm_head` beside, HF names."""

    def __init__(self, causal_lm: nn.Module, hf_config: dict[str, Any]):
        super().__init__(causal_lm, hf_config)
        if "lm_head" not in self._modules:  # GPT-NeoX's embed_out: the losses call it `lm_head`
            object.__setattr__(self, "lm_head", causal_lm.get_output_embeddings())
        config = causal_lm.config
        if getattr(config, "final_logit_softcapping", None):
            raise ModelConfigError(f"{config.model_type}: final_logit_softcapping is not linear in the hidden states, "
                                   "which the chunked losses project; not supported on the transformers backend")
        self.logit_factor = 1.0 / float(getattr(config, _LOGIT_DIVISOR, None) or 1.0) * float(
            getattr(config, _LOGIT_MULTIPLIER, None) or 1.0)
        self.tied_head = self.lm_head.weight is causal_lm.get_input_embeddings().weight
        self.takes_positions = "position_ids" in inspect.signature(self.base.forward).parameters
        self.packing = "positions" if self.takes_positions else "padding"
        self._told = False

    @property
    def causal_lm(self) -> nn.Module:
        return self.wrapped

    @property
    def base(self) -> nn.Module:
        """The decoder without its head (not a registered child: its modules already are)."""
        return self.causal_lm.base_model

    def blocks(self) -> nn.ModuleList:
        """The decoder layers (what FSDP2 shards one by one and checkpointing wraps)."""
        lists = [m for m in self.base.children() if isinstance(m, nn.ModuleList)]
        if len(lists) != 1:
            raise ModelConfigError(f"{self.hf_config.get('model_type')}: cannot tell its decoder layers "
                                   f"({len(lists)} module lists in {type(self.base).__name__})")
        return lists[0]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: Any = None,
    ) -> torch.Tensor:
        """Final hidden states [B, S, D], scaled as the output projection takes them.

        `document_ids`: packed rows, each document attending to itself. `attn_mask` ([B, T] bool, the
        valid positions so far) and `kv_cache` (a transformers `Cache`) are for generation.
        """
        if document_ids is not None:
            self._tell_packing()
            if not self.takes_positions:
                return self._per_document(input_ids, document_ids)
            position_ids = document_positions(document_ids) if position_ids is None else position_ids
        kwargs: dict[str, Any] = {"use_cache": kv_cache is not None}
        if kv_cache is not None:
            kwargs["past_key_values"] = kv_cache
        if attn_mask is not None:
            kwargs["attention_mask"] = attn_mask.long()
        if position_ids is not None and self.takes_positions:
            kwargs["position_ids"] = position_ids.expand(input_ids.shape[0], -1)
        hidden = self.base(input_ids=input_ids, **kwargs).last_hidden_state
        return hidden * self.logit_factor if self.logit_factor != 1.0 else hidden

    def _per_document(self, input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        """Packed rows for a model without `position_ids`: one right-padded row per document, then put back."""
        spans = []  # (row, start, length)
        for row in range(input_ids.shape[0]):
            _, counts = torch.unique_consecutive(document_ids[row], return_counts=True)
            start = 0
            for n in counts.tolist():
                spans.append((row, start, n))
                start += n
        longest = max(n for _, _, n in spans)
        ids = input_ids.new_zeros(len(spans), longest)
        valid = torch.zeros(len(spans), longest, dtype=torch.bool, device=input_ids.device)
        for i, (row, start, n) in enumerate(spans):
            ids[i, :n] = input_ids[row, start:start + n]
            valid[i, :n] = True
        hidden = self.forward(ids, attn_mask=valid)
        rows: list[list[torch.Tensor]] = [[] for _ in range(input_ids.shape[0])]
        for i, (row, _, n) in enumerate(spans):
            rows[row].append(hidden[i, :n])
        return torch.stack([torch.cat(parts) for parts in rows])

    def _tell_packing(self) -> None:
        """Say once how packed rows run on this model."""
        if not self._told:
            how = ("per-document position ids (transformers' packed-sequence masks)" if self.packing == "positions"
                   else "one padded row per document (its forward takes no position_ids)")
            print(f"transformers backend: {self.hf_config.get('model_type')}: packed rows run as {how}",
                  file=sys.stderr, flush=True)
            self._told = True

    def new_cache(self) -> Any:
        """An empty transformers KV cache for `forward(..., kv_cache=)`."""
        from transformers import DynamicCache

        return DynamicCache(config=self.causal_lm.config)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits; only for short sequences (generation, tests). Training uses chunked losses."""
        return self.lm_head(hidden)

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def build_transformers_model(hf_config: dict[str, Any], source: str = "config.json") -> HFCausalLM:
    """transformers' model for `hf_config`, randomly initialized by transformers (float32, on CPU)."""
    from transformers import AutoModelForCausalLM

    config = transformers_config(hf_config, source)
    causal_lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = HFCausalLM(causal_lm, hf_config)
    check_head_parity(model, source)
    return model


@torch.no_grad()
def check_head_parity(model: HFCausalLM, source: str) -> None:
    """Refuse a model whose CausalLM forward does more to the logits than its output projection
    (a scaling or cap the wrapper does not know): our hidden states -> `lm_head` must give its logits."""
    was_training = model.training
    model.eval()
    ids = torch.arange(4, device=next(model.parameters()).device)[None] % int(model.causal_lm.config.vocab_size)
    ours = model.lm_head(model(ids)).float()
    theirs = model.causal_lm(input_ids=ids).logits.float()
    model.train(was_training)
    diff = float((ours - theirs).abs().max())
    if diff > PARITY_TOLERANCE * max(1.0, float(theirs.abs().max())):
        raise ModelConfigError(f"{source}: {model.hf_config.get('model_type')}'s forward changes the logits beyond its "
                               f"output projection (max |diff| {diff:.3g}); not supported on the transformers backend")
