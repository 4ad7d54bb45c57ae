"""The evaluate stage's generation, out of the script so that a test can replace it before running the stage."""

from __future__ import annotations

from tqdm.auto import tqdm

from posttrain.generation import SamplingParams
from posttrain.generation.backend import GenerationBackend

GENERATION_BATCH = 64  # sequences per generate() call


def complete(backend: GenerationBackend, prompts: list[list[int]], params: SamplingParams, seed: int,
             desc: str) -> tuple[list[list[int]], list[str]]:
    """Generated ids and finish reasons per prompt, GENERATION_BATCH at a time (chunk i seeded `seed + i`)."""
    tokens: list[list[int]] = []
    reasons: list[str] = []
    starts = range(0, len(prompts), GENERATION_BATCH)
    for i, start in enumerate(tqdm(starts, desc=desc, unit="batch", mininterval=1.0)):
        out = backend.generate(prompts[start : start + GENERATION_BATCH], params, seed + i)
        tokens += out.tokens
        reasons += out.finish_reasons
    return tokens, reasons
