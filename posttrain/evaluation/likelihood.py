"""Likelihood metrics: held-out NLL / perplexity and implicit preference accuracy.

Both score tokens with the chunked log-probs every loss uses (`posttrain.losses`), so the numbers
are those a training step would see, without ever materializing ``[batch, seq, vocab]`` logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from tqdm.auto import tqdm

from posttrain.data.tokenize import preference_split
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.dpo import REFERENCE_FREE, pair_reward_type, preference_loss
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


@torch.no_grad()
def completion_logprobs(model: Transformer, input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]],
                        pad_id: int, batch_size: int, desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-prob of each sequence's labelled tokens and their count, ``[N]`` each (float64/int64)."""
    device = _device(model)
    head = OutputHead(model, None, {"chunked_ce": True, "ce_chunks": 8})  # the memory defaults (one process)
    sums, counts = [], []
    for start in tqdm(range(0, len(input_ids), batch_size), desc=desc, unit="batch", mininterval=1.0):
        ids = pad_sequence([torch.tensor(x) for x in input_ids[start : start + batch_size]],
                           batch_first=True, padding_value=pad_id).to(device)
        lab = pad_sequence([torch.tensor(x) for x in labels[start : start + batch_size]],
                           batch_first=True, padding_value=IGNORE_INDEX).to(device)
        total, count = head.sequence_logprobs(model(ids), lab)
        sums.append(total.double().cpu())
        counts.append(count.cpu())
    return torch.cat(sums), torch.cat(counts)


def implicit_preference_accuracy(
    policy: Transformer, reference: Transformer | None, pairs: Mapping[str, list], dpo_cfg: Mapping[str, Any],
    pad_id: int, batch_size: int = 16,
) -> dict[str, Any]:
    """Share of pairs whose implicit reward (as defined by ``dpo.loss``) favours the chosen response.

    sigmoid/IPO: ``beta * (log pi - log pi_ref)`` (IPO length-averaged) needs the reference;
    SimPO's ``beta * mean log pi`` and ORPO's do not; KTO's is sigmoid DPO's. Ties count as wrong.
    """
    n = len(pairs["chosen_input_ids"])
    if n == 0:
        raise ValueError("implicit preference accuracy: no pairs")
    ids = pairs["chosen_input_ids"] + pairs["rejected_input_ids"]
    labels = pairs["chosen_labels"] + pairs["rejected_labels"]
    logps, lengths = completion_logprobs(policy, ids, labels, pad_id, batch_size, "preference pairs (policy)")
    ref = None
    if dpo_cfg["loss"] not in REFERENCE_FREE:
        if reference is None:
            raise ValueError(f"dpo.loss={dpo_cfg['loss']} needs the reference model")
        ref, _ = completion_logprobs(reference, ids, labels, pad_id, batch_size, "preference pairs (reference)")
    _, metrics = preference_loss(
        pair_reward_type(dpo_cfg["loss"]), logps[:n], logps[n:], lengths[:n], lengths[n:],
        None if ref is None else ref[:n], None if ref is None else ref[n:],
        beta=dpo_cfg["beta"], label_smoothing=dpo_cfg["label_smoothing"], simpo_gamma=dpo_cfg["simpo_gamma"],
    )
    return {
        "pref_acc": metrics["rewards/accuracy"].item(),
        "pref_margin": metrics["rewards/margin"].item(),
        "pref_pairs": n,
    }
