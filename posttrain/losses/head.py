"""The output head as every loss and scorer uses it, decided once per model: chunked, or full logits.

Chunked (the default) never holds a `[B, S, V]` logits tensor: the kept positions are projected
and scored a chunk at a time (`posttrain.losses.logprobs`). The full-logits path is taken under
tensor parallelism, where the vocabulary-sharded logits go straight into `F.cross_entropy` inside
`loss_parallel` (`context()`), or with `memory.chunked_ce: false` (the memory baseline). SFT's
cross-entropy, DPO's sequence log-probs, GRPO's token log-probs and entropies, the KD divergence
and the evaluate stage's held-out NLL and preference scores all go through one `OutputHead`, so the
choice cannot drift between stages. (The reward model's head is a scalar score, not this one.)

Under context parallelism (`parallel.cp`) the hidden states hold this rank's positions of each row:
the head shards the labels (targets, masks) the same way and returns whole-row results, sums
all-reduced and per-token values gathered back (`posttrain.parallel.context_parallel`), so a stage's
loss is the same expression with or without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from posttrain.losses.ce import full_cross_entropy, linear_cross_entropy
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.logprobs import kept_token_logprobs, sequence_logprobs, token_logprobs_and_entropy
from posttrain.models import Transformer
from posttrain.parallel import loss_context, uses_tensor_parallel
from posttrain.parallel.context_parallel import ContextParallel


def plain(x: Tensor) -> Tensor:
    """A plain tensor: a DTensor (sequence-sharded hidden states, replicated losses) becomes its full value."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def summed_lm_loss(model: Transformer, head: OutputHead, batch: Mapping[str, Tensor]) -> Tensor:
    """SFT's loss: cross-entropy summed over a batch's loss tokens (packed rows attend within their documents)."""
    hidden = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    return head.summed_cross_entropy(hidden, batch["labels"])


class OutputHead:
    """`model.lm_head` with the scoring path chosen from the mesh and `memory` (`chunked_ce`, `ce_chunks`)."""

    def __init__(self, model: Transformer, mesh: DeviceMesh | None, memory: Mapping[str, Any]):
        self.project = model.lm_head
        self.mesh = mesh
        self.cp: ContextParallel | None = getattr(model, "context_parallel", None)
        self.tensor_parallel = uses_tensor_parallel(mesh)
        self.chunked = bool(memory["chunked_ce"])
        self.full_logits = self.tensor_parallel or not self.chunked
        self.num_chunks = int(memory["ce_chunks"])

    def context(self) -> AbstractContextManager[None]:
        """Where the losses and their backward run: loss parallel under tensor parallelism."""
        return loss_context(self.mesh)

    def _token_nll(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Per-position cross-entropy `[B * S]` through the full logits (0 at ignored positions)."""
        return full_cross_entropy(hidden, self.project, labels, reduction="none")

    def local(self, labels: Tensor) -> Tensor:
        """The positions of `labels` the hidden states hold (this rank's under context parallelism)."""
        return self.cp.shard(labels, IGNORE_INDEX) if self.cp is not None else labels

    def whole(self, total: Tensor) -> Tensor:
        """A sum over the local positions made the whole rows' (all-reduced under context parallelism)."""
        return self.cp.sum(plain(total)) if self.cp is not None else total

    def summed_cross_entropy(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Cross-entropy summed over the labelled tokens (the caller divides by the step's count)."""
        labels = self.local(labels)
        if self.full_logits:
            return self.whole(full_cross_entropy(hidden, self.project, labels, reduction="sum"))
        return self.whole(linear_cross_entropy(hidden, self.project, labels, num_chunks=self.num_chunks, reduction="sum"))

    def kept_token_logprobs(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Log-probs `[N]` of the labelled tokens, row-major (held-out NLL sums them in float64)."""
        if self.cp is not None:
            logps, _ = self.token_logprobs_and_entropy(hidden, labels, labels != IGNORE_INDEX)
            return logps[labels != IGNORE_INDEX]
        if self.full_logits:
            return -plain(self._token_nll(hidden, labels))[(labels != IGNORE_INDEX).flatten()]
        return kept_token_logprobs(hidden, self.project, labels, num_chunks=self.num_chunks)

    def sequence_logprobs(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Summed log-prob `[B]` of each row's labelled tokens and their count `[B]`."""
        sums, counts = self._sequence_logprobs(hidden, self.local(labels))
        return self.whole(sums), (labels != IGNORE_INDEX).sum(-1)

    def _sequence_logprobs(self, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        if self.full_logits:
            token_logps = -plain(self._token_nll(hidden, labels))
            return token_logps.view(labels.shape).sum(-1), (labels != IGNORE_INDEX).sum(-1)
        return sequence_logprobs(hidden, self.project, labels, num_chunks=self.num_chunks)

    def token_logprobs_and_entropy(
        self, hidden: Tensor, targets: Tensor, mask: Tensor, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """Token log-probs and entropies `[B, S]` under logits / `temperature` (as sampled); 0 outside `mask`."""
        if self.cp is not None:
            local = self._token_logprobs_and_entropy(hidden, self.cp.shard(targets, IGNORE_INDEX),
                                                     self.cp.shard(mask, 0), temperature)
            return tuple(self.cp.gather(t, targets.shape[1]) for t in local)
        return self._token_logprobs_and_entropy(hidden, targets, mask, temperature)

    def _token_logprobs_and_entropy(self, hidden: Tensor, targets: Tensor, mask: Tensor,
                                    temperature: float) -> tuple[Tensor, Tensor]:
        if not self.full_logits:
            return token_logprobs_and_entropy(hidden, self.project, targets, num_chunks=self.num_chunks,
                                              temperature=temperature)
        logits = self.project(hidden).float() / temperature
        logp = -F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return plain(logp).view(mask.shape), plain(entropy) * mask

    def rows(self) -> Callable[[Tensor], Tensor]:
        """The head as a function of plain hidden rows, for losses that compare two models' logits (KD).

        Under tensor parallelism the rows enter replicated and each chunk's logits are gathered
        whole, so one chunk's full-vocabulary logits exist at a time, as without it.
        """
        if not self.tensor_parallel:
            return self.project
        tp = self.mesh["tp"]
        return lambda rows: self.project(DTensor.from_local(rows, tp, [Replicate()])).full_tensor()

    def chunking(self) -> dict[str, Any]:
        """`num_chunks` / `checkpoint_chunks` for the chunked losses: one chunk, no recompute, when full logits are asked for."""
        return {"num_chunks": self.num_chunks, "checkpoint_chunks": None} if self.chunked else {
            "num_chunks": 1, "checkpoint_chunks": False}
