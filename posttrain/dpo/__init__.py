"""DPO pieces the stage composes: pair log-probs (chunked, data-parallel scoring passes), the reference, the step."""

from posttrain.dpo.reference import (
    OnlineReference,
    PrecomputedReference,
    fingerprint,
    file_stats,
    load_cache,
    model_files,
    reference_cache_path,
    reference_scores,
    save_cache,
)
from posttrain.dpo.logprobs import PairLogps, completion_logprobs, pair_logprobs, reshard, score_pairs

__all__ = [
    "OnlineReference",
    "PairLogps",
    "PrecomputedReference",
    "completion_logprobs",
    "file_stats",
    "fingerprint",
    "load_cache",
    "model_files",
    "pair_logprobs",
    "reference_cache_path",
    "reference_scores",
    "reshard",
    "save_cache",
    "score_pairs",
]
