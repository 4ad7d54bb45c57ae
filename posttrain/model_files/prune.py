"""A smaller student from a pretrained model: some of its decoder layers, everything else as it was.

    python -m posttrain.model_files.prune models/smollm2-135m-instruct --layers 20 \
        --select angular --calibration config/examples/smollm2-calibration.jsonl --out models/smollm2-20-layers

Distillation wants a student that shares the teacher's tokenizer (the KD loss compares their
distributions token by token) and does not start from nothing. Keeping `--layers` decoder layers of a
pretrained model with its embeddings, final norm and tokenizer gives one: the layers are renumbered,
`num_hidden_layers` is set, and `pruned-from.json` records the source folder, the sha256 of its
weights and the layers kept. The folder appears complete or not at all.

Which layers: `--select even` keeps evenly spaced ones, the first and the last among them.
`--select angular` drops one contiguous block, the one whose input and output hidden states are
closest in angle on calibration text (Gromov et al., "The Unreasonable Ineffectiveness of the Deeper
Layers", 2024): the block the model changes its representation least across, the last layer always
kept. With `--calibration` (either selection) the record also holds `calibration_kl`, the mean
next-token KL from the source to the pruned model on those rows: how far the student starts from
its teacher (docs/smollm2.md compares the two selections on SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.model_files.hf import (
    CheckpointError,
    folder_tool,
    load_hf_model,
    read_hf_config,
    read_safetensors,
    save_hf_model,
    weight_files,
)
from posttrain.models.hf_backend import HFCausalLM
from posttrain.tokenizer import Tokenizer
from posttrain.utils.io import PROVENANCE_FILE, atomic_dir, file_sha256

SOURCE_FILE = "pruned-from.json"
# Config lists with one entry per layer: attention kinds (Qwen3, Gemma 3, ...), SmolLM3's rope flags.
PER_LAYER_KEYS = ("layer_types", "no_rope_layers")
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
WEIGHTS = (".safetensors", ".safetensors.index.json")
# Rewritten (config, generation config) or not this folder's (a stage output's provenance).
NOT_COPIED = ("config.json", "generation_config.json", PROVENANCE_FILE)
SELECTIONS = ("even", "angular")


def kept_layers(total: int, keep: int) -> list[int]:
    """`keep` of `total` layer indices, evenly spaced, first and last included."""
    if not 1 <= keep <= total:
        raise CheckpointError(f"--layers must be between 1 and the model's {total} layers, got {keep}")
    if keep == 1:
        return [0]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def calibration_texts(path: Path, limit: int) -> list[list[dict[str, Any]]] | list[str]:
    """The first `limit` rows of a JSONL file, each a chat (`messages`) or a plain string (`text`)."""
    rows: list[Any] = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise CheckpointError(f"--calibration {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if len(rows) == limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}:{number}: not JSON ({e.msg})") from None
        value = row.get("messages", row.get("text")) if isinstance(row, dict) else None
        if not (isinstance(value, str) and value) and not (isinstance(value, list) and value):
            raise CheckpointError(f"{path}:{number}: a row needs `messages` (a list of chat messages) or `text` (a string)")
        rows.append(value)
    if not rows:
        raise CheckpointError(f"--calibration {path}: no rows")
    return rows


def calibration_ids(tokenizer: Tokenizer, texts: list[Any]) -> list[torch.Tensor]:
    """Each row's token ids, a chat rendered with the folder's chat template."""
    return [torch.tensor([tokenizer.encode(tokenizer.apply_chat_template(text) if isinstance(text, list) else text)])
            for text in texts]


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks() if isinstance(model, HFCausalLM) else model.model.layers.values())


def block_distances(model: nn.Module, rows: list[torch.Tensor], drop: int) -> list[float]:
    """Mean angular distance (arccos of the cosine, over pi) between the hidden states entering layer
    `l` and layer `l + drop`, over every token of `rows`, for each start `l` with `l + drop` before the
    last layer."""
    blocks = decoder_blocks(model)
    if not 1 <= drop < len(blocks):
        raise CheckpointError(f"--select angular drops a block of 1 to {len(blocks) - 1} layers, not {drop}")
    entering: list[torch.Tensor] = []

    def keep_input(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        entering.append(args[0] if args else kwargs["hidden_states"])

    handles = [block.register_forward_pre_hook(keep_input, with_kwargs=True) for block in blocks]
    sums = torch.zeros(len(blocks) - drop, dtype=torch.float64)
    try:
        with torch.no_grad():
            for ids in rows:
                entering.clear()
                model(ids)
                states = torch.stack(entering)[:, 0].double()  # [layers, tokens, hidden]
                cosine = torch.nn.functional.cosine_similarity(states[:-drop], states[drop:], dim=-1)
                sums += (torch.arccos(cosine.clamp(-1, 1)) / math.pi).sum(-1)
    finally:
        for handle in handles:
            handle.remove()
    return (sums / sum(ids.shape[1] for ids in rows)).tolist()


def next_token_kl(source: nn.Module, pruned: nn.Module, rows: list[torch.Tensor]) -> float:
    """Mean KL(source || pruned) of the next-token distributions over every token of `rows`: how far
    the student starts from its teacher, whichever layers were kept."""
    total = 0.0
    with torch.no_grad():
        for ids in rows:
            p = source.logits(source(ids)).double().log_softmax(-1)
            q = pruned.logits(pruned(ids)).double().log_softmax(-1)
            total += (p.exp() * (p - q)).sum().item()
    return total / sum(ids.shape[1] for ids in rows)


def angular_layers(distances: list[float], total: int, drop: int) -> list[int]:
    """The layers left when the block of `drop` starting where `distances` is smallest is removed."""
    start = min(range(len(distances)), key=distances.__getitem__)
    return [i for i in range(total) if not start <= i < start + drop]


def prune(source: Path, out: Path, keep: int, select: str = "even", calibration: Path | None = None,
          calibration_rows: int = 64) -> Path:
    """Write `out`: `source` with `keep` of its decoder layers (see the module doc); returns `out`."""
    source = Path(source)
    config = read_hf_config(source)
    total = int(config["num_hidden_layers"])
    layers = kept_layers(total, keep)
    selection: dict[str, Any] = {"select": select}
    if select not in SELECTIONS:
        raise CheckpointError(f"--select must be one of {', '.join(SELECTIONS)}, got {select!r}")
    if select == "angular" and calibration is None:
        raise CheckpointError("--select angular needs --calibration: a JSONL file of `messages` or `text` rows")
    model = rows = None
    if calibration is not None:
        texts = calibration_texts(calibration, calibration_rows)
        model = load_hf_model(source, backend="auto").eval()
        rows = calibration_ids(Tokenizer(source), texts)
        selection.update(calibration=str(calibration), calibration_sha256=file_sha256(Path(calibration)))
    if select == "angular":
        distances = block_distances(model, rows, total - keep)
        layers = angular_layers(distances, total, total - keep)
        selection["block_distances"] = [round(d, 6) for d in distances]
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
              "source_layers": total, "layers": layers, **selection}
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
        if model is not None:  # the student's distance from its source, for comparing selections
            record["calibration_kl"] = round(next_token_kl(model, load_hf_model(tmp, backend="auto").eval(), rows), 6)
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path, help="an HF model folder")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    parser.add_argument("--select", choices=SELECTIONS, default="even",
                        help="even: evenly spaced layers; angular: drop the block that changes the hidden states least")
    parser.add_argument("--calibration", type=Path, help="JSONL rows of `messages` or `text`: what --select angular measures on; "
                        "either selection then records the pruned model's KL from the source on them")
    parser.add_argument("--calibration-rows", type=int, default=64, help="how many calibration rows to read")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    args = parser.parse_args(argv)
    return folder_tool("prune", lambda: prune(args.source, args.out, args.layers, args.select, args.calibration,
                                              args.calibration_rows), SOURCE_FILE)


if __name__ == "__main__":
    sys.exit(main())
