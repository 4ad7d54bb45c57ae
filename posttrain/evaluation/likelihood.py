"""Likelihood metrics: held-out NLL / perplexity and implicit preference accuracy.

Both score tokens with the chunked log-probs every loss uses (`posttrain.losses`), so the numbers
are those a training step would see, without ever materializing ``[batch, seq, vocab]`` logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from posttrain.data.tokenize import preference_split
from posttrain.data.loader import preference_collate
from posttrain.data.store import Split
from posttrain.dpo.logprobs import PairLogps, score_pairs
from posttrain.dpo.step import pair_loss
from posttrain.losses.dpo import REFERENCE_FREE
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer
from posttrain.tokenizer import Tokenizer


def _device(model: Transformer) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def heldout_nll(model: Transformer, batches: Iterable[Mapping[str, torch.Tensor]], num_chunks: int = 8,
                total: int | None = None) -> dict[str, Any]:
    """Mean negative log-likelihood per trained token over SFT-style batches, and its perplexity.

    Batches are those of `posttrain.data.loader.sft_batches` (packed rows, per-document attention).
    """
    device = _device(model)
    head = OutputHead(model, None, {"chunked_ce": True, "ce_chunks": num_chunks})
    nll_sum, tokens = 0.0, 0
    for batch in tqdm(batches, total=total, desc="held-out NLL", unit="batch", mininterval=1.0):
        hidden = model(batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                       document_ids=batch["document_ids"].to(device))
        logps = head.kept_token_logprobs(hidden, batch["labels"].to(device))
        nll_sum -= logps.double().sum().item()
        tokens += logps.numel()
    if tokens == 0:
        raise ValueError("held-out NLL: the split has no trained tokens")
    nll = nll_sum / tokens
    return {"nll": nll, "ppl": math.exp(nll), "nll_tokens": tokens}


def eval_pairs(examples: Sequence[Mapping[str, Any]], tok: Tokenizer, max_len: int) -> dict[str, list]:
    """Preference pairs (reference response vs. the task's plausible mistake) from held-out eval rows.

    Eval rows of the built-in tasks carry ``response`` and ``rejected_response``; they are never
    trained on, so these pairs are held out from DPO's training pairs. Rows without both fields are
    skipped. Tokenized exactly like the training pairs (`posttrain.data.tokenize.preference_split`).
    """
    rows = []
    for ex in examples:
        if not (isinstance(ex.get("response"), str) and isinstance(ex.get("rejected_response"), str)):
            continue
        prompt = ex["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        rows.append({
            "prompt": messages,
            "chosen": [{"role": "assistant", "content": ex["response"]}],
            "rejected": [{"role": "assistant", "content": ex["rejected_response"]}],
        })
    if not rows:
        return {"chosen_input_ids": [], "chosen_labels": [], "rejected_input_ids": [], "rejected_labels": []}
    columns, _ = preference_split(rows, tok, max_len, "right")
    return columns


def implicit_preference_accuracy(
    policy: Transformer, reference: Transformer | None, pairs: Mapping[str, list], dpo_cfg: Mapping[str, Any],
    pad_id: int, batch_size: int = 16,
) -> dict[str, Any]:
    """Share of pairs whose implicit reward (as defined by ``dpo.loss``) favours the chosen response.

    sigmoid/IPO: ``beta * (log pi - log pi_ref)`` (IPO length-averaged) needs the reference;
    SimPO's ``beta * mean log pi`` and ORPO's do not; KTO's is sigmoid DPO's. Ties count as wrong.
    Scored and judged by the DPO stage's own functions (`score_pairs`, `pair_loss`).
    """
    n = len(pairs["chosen_input_ids"])
    if n == 0:
        raise ValueError("implicit preference accuracy: no pairs")
    split, collate = Split.from_columns(dict(pairs)), preference_collate(pad_id)

    def scores(model: Transformer, who: str) -> PairLogps:
        head = OutputHead(model, None, {"chunked_ce": True, "ce_chunks": 8})  # the memory defaults (one process)
        return score_pairs(model, head, split, collate, batch_size, _device(model), f"preference pairs ({who})")

    logps, ref = scores(policy, "policy"), None
    if dpo_cfg["loss"] not in REFERENCE_FREE:
        if reference is None:
            raise ValueError(f"dpo.loss={dpo_cfg['loss']} needs the reference model")
        ref_logps = scores(reference, "reference")
        ref = (ref_logps.chosen, ref_logps.rejected)
    _, metrics = pair_loss(dpo_cfg, logps, ref)
    return {
        "pref_acc": metrics["rewards/accuracy"].item(),
        "pref_margin": metrics["rewards/margin"].item(),
        "pref_pairs": n,
    }
