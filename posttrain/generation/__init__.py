"""Generation: the native KV-cache sampler (and, as an extra, vLLM)."""

from posttrain.generation.backend import GenerationBackend, NativeBackend, VLLMBackend, import_vllm
from posttrain.generation.sampler import GenerationOutput, SamplingParams, filter_logits, generate

__all__ = [
    "GenerationBackend",
    "GenerationOutput",
    "NativeBackend",
    "SamplingParams",
    "VLLMBackend",
    "filter_logits",
    "generate",
    "import_vllm",
]
