"""pass@k: the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on Code".

With n samples of which c are correct, the chance that k samples drawn without replacement from
those n contain at least one correct one is ``1 - C(n - c, k) / C(n, k)``. Averaged over prompts it
is an unbiased estimate of pass@k, with less variance than drawing k samples once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that a k-subset of n samples with c correct holds a correct one (exact integers)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n (samples per prompt), got k={k}, n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over prompts; ``correct_counts[i]`` is c for prompt i, each with n samples."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k: no prompts")
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
