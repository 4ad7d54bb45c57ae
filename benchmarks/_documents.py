"""Synthetic SFT documents with a long-tailed length distribution, shared by the throughput benchmarks.

Kept free of posttrain imports: the peer benchmark's TRL runs load it without loading posttrain.
"""

from __future__ import annotations

import numpy as np


def skewed_documents(n: int, seq: int, vocab: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and labels of `n` documents, lengths lognormal (median seq/8), clipped to [8, seq]."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(seq / 8), sigma=0.8, size=n).astype(int), 8, seq)
    ids = [rng.integers(1, vocab, size=int(length)) for length in lengths]
    labels = []
    for doc in ids:
        label = np.append(doc[1:], -100)
        label[: len(doc) // 4] = -100  # the prompt part
        labels.append(label)
    return ids, labels
