"""prepare_data: raw data -> tokenized, packed, file-addressed splits for every later stage.

    python stages/prepare_data.py --config RESOLVED.json --out results/data/<key>

Reads the config keys in `READS`: `seed`, the model's tokenizer source and `data`. Rows come from the
built-in tasks (`data.tasks`, `data.n_*`) and from `data.sources` (local files and folders, or hub
datasets, in the shapes of docs/data.md), per kind, each source mixed in by its `weight` and
`max_rows`. The tokenizer is the model folder's, or for a preset a byte-level BPE trained on the
training text; every user row must render with its chat template (tool calls included), or it is a
bad row. Output (written to a temporary sibling and renamed when complete):

    sft/ sft_eval/ preference/ unpaired/ prompts/ eval/   Arrow shards (posttrain.data.store.load_split)
    tokenizer/                                  HF tokenizer folder used for every split
    stats.json                                  rows, tokens, loss tokens, packing, drop counts
    posttrain.json                              provenance

`sft_eval` holds out min(data.n_eval, 10%) of the SFT rows, chosen by the seed, for NLL (a row that
appears more than once, e.g. by a source's weight above 1, is held out with all its copies).
`unpaired` (KTO's) holds the `unpaired` sources' rows, then each preference pair as two rows (its
chosen completion desirable, its rejected one undesirable).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from posttrain.model_files import resolve_model_source
from posttrain.data.sources import (
    KINDS, ORIGIN, TASK_COLUMNS, TASK_KINDS, canonical_rows, source_rows, unpair,
)
from posttrain.data.store import write_split
from posttrain.data.tasks import make_splits
from posttrain.data.tokenize import (
    check_rendering, preference_split, prompt_split, sft_split, tokenizer_training_text, unpaired_split,
)
from posttrain.models import is_preset
from posttrain.stage_config import load_stage_config, parse_inputs
from posttrain.tokenizer import Tokenizer, read_chat_template, set_chat_template, train_bpe_tokenizer
from posttrain.training.faults import run_main
from posttrain.utils.provenance import write_stage_output

STAGE = "prepare_data"
READS = ("seed", "model.policy", "model.tokenizer", "model.chat_template", "data")
INPUTS = {}  # the first stage: no upstream inputs, only --config and --out


def collect_rows(data: dict[str, Any], seed: int) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """Canonical rows per kind (built-in tasks first, then each source in order) and bad rows skipped."""
    rows: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    bad = dict.fromkeys(KINDS, 0)
    if data["tasks"]:
        sizes = {kind: data[f"n_{kind}"] for kind in TASK_KINDS}
        for kind, generated in make_splits(data["tasks"], sizes, seed).items():
            rows[kind] += canonical_rows(generated, kind, f"data.tasks ({kind})", TASK_COLUMNS[kind])[0]
    for i, source in enumerate(data["sources"]):
        where = f"data.sources[{i}]"
        canonical, n_bad = source_rows(source, where, f"{seed}/{where}", skip_bad=data["on_bad_row"] == "skip")
        rows[source["kind"]] += canonical
        bad[source["kind"]] += n_bad
    return rows, bad


def hold_out(rows: list[dict], n: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(kept, held out): `n` distinct rows chosen by the seed, both in data order.

    Copies of a row (the same conversation, wherever it comes from) count as one: a held-out row
    leaves no copy among the kept ones, and is held out once.
    """
    group_of: dict[str, int] = {}
    groups = [group_of.setdefault(json.dumps({k: v for k, v in r.items() if k != ORIGIN}, sort_keys=True, default=str),
                                  len(group_of)) for r in rows]
    held = set(random.Random(f"{seed}/sft_eval").sample(range(len(group_of)), min(n, len(group_of))))
    seen: set[int] = set()
    held_rows = []
    for g, r in zip(groups, rows):
        if g in held and g not in seen:
            seen.add(g)
            held_rows.append(r)
    return [r for g, r in zip(groups, rows) if g not in held], held_rows


def build_tokenizer(cfg: dict[str, Any], rows: dict[str, list[dict]], out: Path) -> Tokenizer:
    """`model.tokenizer` if set, else the policy's: a BPE trained here for presets, the folder's otherwise;
    with `model.chat_template`, that template in place of its own."""
    model, data = cfg["model"], cfg["data"]
    source = model["tokenizer"] or model["policy"]
    if model["tokenizer"] is None and is_preset(model["policy"]):
        train_bpe_tokenizer(tokenizer_training_text(rows), data["vocab_size"], out, model_max_length=data["max_seq_len"])
    else:
        Tokenizer(resolve_model_source(source)).save(out)
    if model["chat_template"]:  # every stage and output folder copies this tokenizer, template included
        set_chat_template(out, read_chat_template(model["chat_template"]))
    return Tokenizer(out)


def main() -> None:
    args = parse_inputs(STAGE, INPUTS)
    started = time.time()
    cfg = load_stage_config(args.config, READS, __file__)
    data, seed = cfg["data"], cfg["seed"]
    max_len = data["max_seq_len"]

    rows, bad = collect_rows(data, seed)
    rows["sft"], sft_eval = hold_out(rows["sft"], min(data["n_eval"], len(rows["sft"]) // 10), seed)

    def write(out: Path) -> dict[str, Any]:
        tok = build_tokenizer(cfg, rows, out / "tokenizer")
        unrendered = dict.fromkeys(KINDS, 0)
        for kind in KINDS:
            rows[kind], n_bad, unrendered[kind] = check_rendering(kind, rows[kind], tok, data["on_bad_row"] == "skip")
            bad[kind] += n_bad
        held, n_bad, held_unrendered = check_rendering("sft", sft_eval, tok, data["on_bad_row"] == "skip")
        bad["sft"] += n_bad
        splits: dict[str, dict[str, Any]] = {}
        for name, split_rows in (("sft", rows["sft"]), ("sft_eval", held)):
            columns, splits[name] = sft_split(
                split_rows, tok, max_len, data["loss_mask"], data["truncation"], data["packing"], desc=f"tokenize {name}"
            )
            write_split(out, name, columns)
        columns, splits["preference"] = preference_split(rows["preference"], tok, max_len, data["truncation"])
        write_split(out, "preference", columns)
        columns, splits["unpaired"] = unpaired_split(rows["unpaired"] + unpair(rows["preference"]), tok, max_len,
                                                     data["truncation"])
        write_split(out, "unpaired", columns)
        for name in ("prompts", "eval"):
            columns, splits[name] = prompt_split(rows[name], tok, max_len, desc=f"tokenize {name}")
            write_split(out, name, columns)
        for name, stats in splits.items():
            stats["bad_rows_skipped"] = bad.get(name, 0)  # held-out rows were counted with sft
            reasoning = unrendered.get(name, 0) + (held_unrendered if name == "sft" else 0)
            if reasoning:  # the template's choice (e.g. Qwen3 renders the last turns' only); said, not hidden
                stats["reasoning_not_rendered"] = reasoning

        stats = {
            "max_seq_len": max_len,
            "packing": data["packing"],
            "loss_mask": data["loss_mask"],
            "truncation": data["truncation"],
            "tokenizer": {"vocab_size": tok.vocab_size, "pad_id": tok.pad_id, "eos_ids": tok.eos_ids},
            "splits": splits,
        }
        (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        summary = {f"{name}_rows": s["rows"] for name, s in splits.items()}
        summary["sft_packing_efficiency"] = splits["sft"]["packing_efficiency"]
        return summary

    summary = write_stage_output(args.out, cfg, STAGE, started, write)
    print(json.dumps({"out": args.out, **summary}))


if __name__ == "__main__":
    run_main(STAGE, main)
