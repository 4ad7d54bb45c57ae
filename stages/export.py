"""export: the chosen model as a deployable Hugging Face folder (and optionally on the hub).

    python stages/export.py --config RESOLVED.json --model MODEL_DIR [--eval EVAL_DIR ...] --out DIR

Reads the config keys in `READS` (`export`). The model folder holds merged weights (a LoRA run
writes them merged with `save: both` or `merged`; adapter tensors among the weights, or an adapter beside
them, are refused), or is adapter-only (`save: adapter`), which is merged into its base as it loads. Output (written to a
temporary sibling and renamed when complete):

    config.json, model.safetensors (or shards)  weights in export.dtype
    generation_config.json                      stops at eos and the chat template's end-of-turn
    tokenizer files                             including the chat template
    README.md                                   model card: usage, eval numbers (--eval), lineage
    int8/                                       with export.int8: torchao int8 weight-only copy
    posttrain.json                              provenance (+ the push plan)

With `export.push_to_hub: owner/name` the folder goes to a private hub repo (token: HF_TOKEN);
with `export.dry_run: true` (default) the files that would be uploaded are listed, offline.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from safetensors import safe_open

from posttrain.training.faults import SettingError, run_main
from posttrain.model_files import CheckpointError, load_hf_model, save_hf_model, weight_files
from posttrain.model_files.hf import checkpoint_state, is_adapter_folder
from posttrain.export.hub import hub_token, push_folder, push_plan
from posttrain.export.model_card import render_model_card
from posttrain.stage_config import load_stage_config, parse_inputs
from posttrain.tokenizer import Tokenizer
from posttrain.training.final_model import DTYPES
from posttrain.utils.io import PROVENANCE_FILE, atomic_dir
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.lineage import lineage, read_provenance

STAGE = "export"
READS = ("model.backend", "export")
INPUTS = {"model": "model folder to export", "eval": "an evaluate output folder"}
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def assert_merged(model_dir: Path) -> None:
    """Refuse a folder whose weights are (or include) unmerged LoRA adapters; an adapter-only folder (a stage's
    `save: adapter`) is merged into its base as it loads."""
    if is_adapter_folder(model_dir):
        return
    for name in ADAPTER_FILES:
        if (model_dir / name).exists():
            raise CheckpointError(f"{model_dir / name}: an unmerged LoRA adapter; export needs a folder with merged weights")
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            lora = [k for k in handle.keys() if ".lora_" in k]
        if lora:
            raise CheckpointError(f"{path}: holds adapter tensor {lora[0]!r}; merge LoRA before export")


def generation_config(model_dir: Path, tok: Tokenizer) -> dict:
    """The model's generation config, with the tokenizer's end-of-turn ids added to `eos_token_id`."""
    path = model_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    eos = gen.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    gen["eos_token_id"] = list(dict.fromkeys(eos + tok.eos_ids))
    return gen


def main() -> None:
    args = parse_inputs(STAGE, INPUTS, repeatable=("eval",))
    started = time.time()
    cfg = load_stage_config(args.config, READS, __file__)
    ex = cfg["export"]
    dtype = DTYPES[ex["dtype"]]
    if ex["push_to_hub"] and not ex["dry_run"]:
        hub_token()  # fail before any work when the token is missing
    model_dir = Path(args.model)
    assert_merged(model_dir)
    record = read_provenance(model_dir)
    chain = lineage(model_dir)
    evals = [json.loads((Path(d) / "metrics.json").read_text()) for d in args.eval]
    tok = Tokenizer(model_dir)
    if not tok.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template; a post-trained model needs one to be used")
    model = load_hf_model(model_dir, backend=cfg["model"]["backend"])
    if ex["int8"] and model.backend != "native":
        raise SettingError(f"export.int8: the int8 copy quantizes the native model's layers; {model_dir} runs on the "
                           "transformers backend (model.backend), so export it without int8 (export.int8: false)")

    with atomic_dir(args.out) as out:
        save_hf_model(checkpoint_state(model, model.state_dict()), model.hf_config, out, dtype=dtype,
                      generation_config=generation_config(model_dir, tok))
        tok.save(out)
        if ex["int8"]:
            from posttrain.export.int8 import save_int8_copy  # torchao: seconds of import, only when asked

            save_int8_copy(model.to(dtype), out, out / "int8")
            tok.save(out / "int8")
        (out / "README.md").write_text(render_model_card(
            record=record, chain=chain, evals=evals, export_key=cfg["key"], dtype=ex["dtype"], int8=ex["int8"],
            repo_id=ex["push_to_hub"]), encoding="utf-8")
        summary = {"stage": record["stage"], "model_key": record["key"], "dtype": ex["dtype"], "int8": ex["int8"],
                   "model_backend": model.backend}
        if ex["push_to_hub"]:
            summary["push"] = push_plan(out, ex["push_to_hub"], ex["dry_run"], extra=(PROVENANCE_FILE,))
        write_provenance(out, cfg, STAGE, started, summary)
        if ex["push_to_hub"]:
            plan = summary["push"]
            if ex["dry_run"]:
                print(f"export: dry run, would upload {len(plan['files'])} files to the private repo {plan['repo_id']}:")
                print("\n".join(f"  {name}" for name in plan["files"]))
            else:
                url = push_folder(out, plan, commit_message=f"posttrain export {cfg['key']} ({record['stage']} {record['key']})")
                print(f"export: pushed to {url}")
    print(json.dumps({"out": args.out, **{k: v for k, v in summary.items() if k != "push"}}))


if __name__ == "__main__":
    run_main(STAGE, main)
