"""Hugging Face folder interop: safetensors in, safetensors out, never pickle or remote code.

A model source is a local HF folder or a hub id; a hub id goes through `snapshot_download`,
which honours `HF_HUB_OFFLINE` and the local cache. A stage's adapter-only output (`<stage>.save:
adapter`: `config.json` and a PEFT LoRA adapter, no model weights) is a source too: `model_tensors`
reads its base (the adapter config's `base_model_name_or_path`, itself possibly adapter-only) and
folds the adapter in, so every reader of a folder's weights gets merged weights.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from posttrain.models import Transformer
from posttrain.models.args import ModelConfigError, model_backend
from posttrain.models.families import FAMILIES
from posttrain.models.hf_backend import HFCausalLM, TransformersModel, check_head_parity, transformers_config
from posttrain.models.lora import merge_peft_adapter

M = TypeVar("M", bound=torch.nn.Module)

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# What a model folder needs; weights other than safetensors (pickles) are never fetched.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class CheckpointError(ValueError):
    """A model folder or weight file that cannot be loaded as asked; the message names the file."""


def resolve_model_source(source: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder as is, or a hub id downloaded (safetensors and configs only) into the HF cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path}: a model source must be a folder (config.json + *.safetensors), not a file")
    source = str(source)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise CheckpointError(f"model folder {source!r} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=source, revision=revision, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        why = "HF_HUB_OFFLINE is set and it is not in the local cache" if offline else f"{type(e).__name__}: {e}"
        raise CheckpointError(
            f"cannot get model {source!r} from the Hugging Face hub ({why}). Download it where there is "
            f"network (`huggingface-cli download {source} --local-dir DIR`) and set the model to that folder path"
        ) from None


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; a model folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the index's shards, or the single file."""
    index = folder / SAFE_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / SAFE_SINGLE
    if single.exists():
        return [single]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {pickles}: pickle checkpoints are refused; convert them to safetensors)" if pickles else ""
    raise CheckpointError(f"{folder}: no {SAFE_SINGLE} or {SAFE_INDEX}{hint}")


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    """A PEFT adapter in place of model weights (a stage's `save: adapter` output)."""
    folder = Path(folder)
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / SAFE_SINGLE).exists() and not (folder / SAFE_INDEX).exists()


def adapter_base(folder: str | os.PathLike) -> str:
    """The base model an adapter-only folder was trained on (its adapter config's `base_model_name_or_path`)."""
    path = Path(folder) / ADAPTER_CONFIG
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not base:
        raise CheckpointError(f"{path}: names no base_model_name_or_path, so the adapter has no weights to apply to")
    return str(base)


def model_tensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every weight of a model folder, by HF name; an adapter-only folder's are its base's with the adapter merged.

    The base is resolved like any model source (a folder, relative to the working directory as stage inputs
    are, or a hub id).
    """
    folder = Path(folder)
    if not is_adapter_folder(folder):
        return read_safetensors(weight_files(folder))
    return with_adapter(folder, model_tensors(resolve_model_source(adapter_base(folder))))


def with_adapter(folder: Path, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's tensors with the adapter-only `folder`'s PEFT adapter folded in."""
    adapter_config = json.loads((folder / ADAPTER_CONFIG).read_text())
    try:
        return merge_peft_adapter(base, read_safetensors([folder / ADAPTER_WEIGHTS]), adapter_config)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{folder}: the adapter does not apply to its base {adapter_base(folder)}: "
                              f"{type(e).__name__}: {e}") from None


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from None
    return tensors


def nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or inf, with how many (None: every value finite)."""
    for name, tensor in tensors.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            return f"{name!r} ({int((~torch.isfinite(local)).sum())} of {local.numel()} values)"
    return None


def checkpoint_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of `model` under its checkpoint's names: a native model's are already; transformers renames
    some tensors on load, which `save_pretrained` writes back under their checkpoint names (GPT-NeoX's embed_out):
    a model on the transformers backend (`HFCausalLM`, the reward model's `HFRewardModel`) reverts them."""
    return model.checkpoint_state(state) if isinstance(model, TransformersModel) else state


def load_state_into(model: Transformer | HFCausalLM, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy checkpoint tensors into the model, refusing any missing, unexpected or misshapen tensor."""
    expected = dict(model.state_dict())
    if model.tied_head:
        expected.pop("lm_head.weight", None)
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r}" + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, the config expects {tuple(expected[name].shape)}"
            )
    bad = nonfinite_tensor(tensors)
    if bad:
        raise CheckpointError(f"{source}: tensor {bad} holds NaN or inf values; a model trained or scored from it "
                              "would learn nothing but NaN")
    with torch.no_grad():
        for name, tensor in tensors.items():
            expected[name].copy_(tensor)


def load_hf_model(
    source: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    backend: str = "native",
) -> Transformer | HFCausalLM:
    """Build the model from a folder's config.json on the meta device, then fill it from safetensors
    (an adapter-only folder: its base's, merged with the adapter). `backend` is `model.backend`: on the
    transformers backend, transformers builds the model (on CPU, random init first) and the same tensors fill it."""
    folder = resolve_model_source(source, revision)
    config = read_hf_config(folder)
    if backend != "native" and folder_backend(config, backend, folder) == "transformers":
        return load_transformers_model(folder, config).to(device, dtype)
    tensors = model_tensors(folder)
    with torch.device("meta"):
        try:
            model = Transformer(config)
        except ValueError as e:
            raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(buffers_only=True)
    load_state_into(model, tensors, str(folder))
    return model.to(dtype)


def load_transformers_model(folder: Path, config: dict[str, Any]) -> HFCausalLM:
    """transformers' causal LM of a folder (`pretrained_checked`). An adapter-only folder: its base, loaded so, with
    the adapter folded in (`adapter_folded`)."""
    from transformers import AutoModelForCausalLM

    if is_adapter_folder(folder):
        return adapter_folded(folder, load_transformers_model)
    where = str(folder / "config.json")
    model = HFCausalLM(pretrained_checked(AutoModelForCausalLM, folder, transformers_config(config, where)), config)
    check_head_parity(model, where)
    return model


def pretrained_checked(auto_class: Any, folder: Path, config: Any,
                       allowed: Callable[[Any, str, str], bool] = lambda model, kind, key: False) -> Any:
    """`auto_class.from_pretrained` of a folder (safetensors only, float32, transformers' own checkpoint renamings),
    refusing missing, unexpected or misshapen tensors but those `allowed(model, kind, key)` accepts."""
    weight_files(folder)  # refuses pickles with the reason
    model, info = auto_class.from_pretrained(folder, config=config, dtype=torch.float32, use_safetensors=True,
                                             output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        wrong = sorted(key for key in map(str, info.get(kind) or []) if not allowed(model, kind, key))
        if wrong:
            raise CheckpointError(f"{folder}: {kind.replace('_', ' ')} {wrong[:3]}")
    return model


def adapter_folded(folder: Path, load: Callable[[Path, dict[str, Any]], M]) -> M:
    """An adapter-only folder's base, loaded by `load`, with the adapter folded in under the loaded model's names
    (PEFT's, as the adapter was saved)."""
    base = resolve_model_source(adapter_base(folder))
    model = load(base, read_hf_config(base))
    model.load_state_dict(with_adapter(folder, model.state_dict()))
    return model


def folder_backend(config: dict[str, Any], backend: str, folder: Path) -> str:
    """`model_backend`, its refusal a `CheckpointError` naming the folder's config.json."""
    try:
        return model_backend(config, backend, str(folder / "config.json"))
    except ModelConfigError as e:
        raise CheckpointError(str(e)) from None


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def save_hf_model(
    state: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    generation_config: dict[str, Any] | None = None,
) -> None:
    """Write `config.json`, `generation_config.json` and safetensors (sharded with an index above `max_shard_bytes`).

    `state` is a full (unsharded) state dict in HF names; tied output weights are not duplicated;
    the weights are written unquantized, and the config says so (no `quantization_config`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hf_config.get("tie_word_embeddings"):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in sorted(state.items())}
    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / SAFE_SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    write_hf_config(hf_config, out, dtype, generation_config)


def write_hf_config(hf_config: dict[str, Any], out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    generation_config: dict[str, Any] | None = None) -> None:
    """`config.json` and `generation_config.json` of a folder whose weights are `dtype` (or of an adapter-only
    folder, whose base's architecture they describe)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The tensors written are dense: a source's `quantization_config` (a GGUF file's, say) would send
    # loaders (vLLM) looking for a quantization that is not there.
    config = {**{k: v for k, v in hf_config.items() if k != "quantization_config"},
              "torch_dtype": str(dtype).removeprefix("torch.")}
    config["dtype"] = config["torch_dtype"]
    if "architectures" not in config:
        config["architectures"] = [architecture(config["model_type"])]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_config.get(k) is not None}
    gen.update(generation_config or {})
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def architecture(model_type: str, classifier: bool = False) -> str:
    """The class name a config.json of `model_type` names, its causal LM's or (`classifier`) its sequence
    classifier's (a reward model): a native family's (`posttrain.models.families`), else transformers' own."""
    if model_type in FAMILIES:
        family = FAMILIES[model_type]
        return family.sequence_classification if classifier else family.causal_lm
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    return (MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES if classifier else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[model_type]


def folder_tool(name: str, write: Callable[[], Path], record: str) -> int:
    """A command-line tool's end that writes a model folder: the folder's `record` file on stdout, exit 0;
    a `CheckpointError` as one line on stderr, exit 1."""
    try:
        out = write()
    except CheckpointError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(json.loads((out / record).read_text())))
    return 0
