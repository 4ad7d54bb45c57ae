"""Generation: the native KV-cache sampler (and, as an extra, vLLM)."""

from posttrain.generation.sampler import GenerationOutput, SamplingParams, filter_logits, generate

__all__ = ["GenerationOutput", "SamplingParams", "filter_logits", "generate"]
