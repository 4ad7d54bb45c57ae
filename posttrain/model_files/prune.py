"""A smaller student from a pretrained model: some of its decoder layers, everything else as it was.

    python -m posttrain.model_files.prune models/smollm2-135m-instruct --layers 8 --out models/smollm2-8-layers

Distillation wants a student that shares the teacher's tokenizer (the KD loss compares their
distributions token by token) and does not start from nothing. Keeping `--layers` evenly spaced
decoder layers of a pretrained model (the first and the last among them) with its embeddings,
final norm and tokenizer gives one: the layers are renumbered, `num_hidden_layers` is set, and
`pruned-from.json` records the source folder, the sha256 of its weights and the layers kept. The
folder appears complete or not at all.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch

from posttrain.model_files.hf import CheckpointError, folder_tool, read_hf_config, read_safetensors, save_hf_model, weight_files
from posttrain.utils.io import PROVENANCE_FILE, atomic_dir, file_sha256

SOURCE_FILE = "pruned-from.json"
# Config lists with one entry per layer: attention kinds (Qwen3, Gemma 3, ...), SmolLM3's rope flags.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
WEIGHTS = (".safetensors", ".safetensors.index.json")
# Rewritten (config, generation config) or not this folder's (a stage output's provenance).
NOT_COPIED = ("config.json", "generation_config.json", PROVENANCE_FILE)


def kept_layers(total: int, keep: int) -> list[int]:
    """`keep` of `total` layer indices, evenly spaced, first and last included."""
    if not 1 <= keep <= total:
        raise CheckpointError(f"--layers must be between 1 and the model's {total} layers, got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def prune(source: Path, out: Path, keep: int) -> Path:
    """Write `out`: `source` with `keep` of its decoder layers (see the module doc); returns `out`."""
    source = Path(source)
    config = read_hf_config(source)
    total = int(config["num_hidden_layers"])
    layers = kept_layers(total, keep)
    renumber = {old: new for new, old in enumerate(layers)}
    files = weight_files(source)
    state = {}
    for name, tensor in read_safetensors(files).items():
        match = LAYER.match(name)
        if match is None:
            state[name] = tensor
        elif int(match.group(1)) in renumber:
            state[f"model.layers.{renumber[int(match.group(1))]}.{match.group(2)}"] = tensor
    record = {"source": str(source.resolve()), "weights_sha256": {f.name: file_sha256(f) for f in files},
              "source_layers": total, "layers": layers}
    dtypes = {t.dtype for t in state.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    generation = source / "generation_config.json"
    generation_config = json.loads(generation.read_text()) if generation.is_file() else None
    config = {**config, "num_hidden_layers": len(layers)}
    for key in PER_LAYER_KEYS:  # the kept layers' entries
        if isinstance(config.get(key), list):
            config[key] = [config[key][i] for i in layers]
    with atomic_dir(out) as tmp:
        save_hf_model(state, config, tmp, dtype, generation_config=generation_config)
        for path in sorted(source.iterdir()):  # tokenizer, chat template, where the weights came from
            if path.is_file() and not path.name.endswith(WEIGHTS) and path.name not in NOT_COPIED:
                shutil.copy2(path, tmp / path.name)
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="an HF model folder")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    args = parser.parse_args(argv)
    return folder_tool("prune", lambda: prune(args.source, args.out, args.layers), SOURCE_FILE)


if __name__ == "__main__":
    sys.exit(main())
