"""The exported model's `README.md`: how to load it, its eval numbers and its training lineage.

The lineage is the chain of `posttrain.json` records (`posttrain.workflow.lineage`): each stage's key,
wall time, summary metrics and the config section it ran with, so a reader can tell exactly what
produced the weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from posttrain.models import is_preset

# The config section each stage reads for itself (the shared sections are shown once).
STAGE_SECTIONS = {"prepare_data": "data", "sft": "sft", "dpo": "dpo", "reward": "reward", "grpo": "grpo",
                  "distill": "distill", "evaluate": "eval", "export": "export"}
SHARED_SECTIONS = ("seed", "model", "memory", "parallel")
EVAL_COLUMNS = ("accuracy", "reward", "nll", "ppl", "pref_acc")


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _pass_keys(evals: Sequence[Mapping[str, Any]]) -> list[str]:
    ks = sorted({int(k.split("@")[1]) for ev in evals for k in ev if k.startswith("pass@")})
    return [f"pass@{k}" for k in ks]


def _eval_table(evals: Sequence[Mapping[str, Any]]) -> list[str]:
    if not evals:
        return ["No evaluation was passed to the export (`--eval`)."]
    columns = ["accuracy", *_pass_keys(evals), *EVAL_COLUMNS[1:]]
    lines = ["| stage | model key | prompts | " + " | ".join(columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for ev in evals:
        cells = [ev.get("stage"), ev.get("model_key"), ev.get("n_prompts"), *(ev.get(c) for c in columns)]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    lines += ["", "accuracy: greedy pass@1 on held-out problems; pass@k: unbiased estimator over sampled "
              "completions; reward: mean verifier reward; nll/ppl: held-out SFT tokens; pref_acc: implicit "
              "preference accuracy (DPO models)."]
    return lines


def _base_model(config: Mapping[str, Any]) -> str | None:
    """The policy's hub id, when it is one (not a preset, not a local folder)."""
    policy = config.get("model", {}).get("policy")
    if not isinstance(policy, str) or is_preset(policy) or Path(policy).expanduser().exists() or policy.count("/") != 1:
        return None
    return policy


def _lineage_section(chain: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| # | stage | key | wall time (s) | summary |", "|---|---|---|---|---|"]
    for i, entry in enumerate(chain, 1):
        record = entry["record"] or {}
        summary = ", ".join(f"{k}={_fmt(v)}" for k, v in (record.get("metrics") or {}).items()
                            if not isinstance(v, (dict, list)))
        found = record.get("wall_time_s") if entry["record"] else "(folder not found)"
        lines.append(f"| {i} | {entry['stage']} | `{entry['key']}` | {_fmt(found)} | {summary or '–'} |")
    last = chain[-1]["record"] or {}
    shared = {k: last.get("config", {}).get(k) for k in SHARED_SECTIONS if k in last.get("config", {})}
    lines += ["", "Shared settings:", "", "```yaml", yaml.safe_dump(shared, sort_keys=False).rstrip(), "```"]
    for entry in chain:
        config = (entry["record"] or {}).get("config", {})
        section = STAGE_SECTIONS.get(entry["stage"])
        if section in config:
            body = yaml.safe_dump({section: config[section]}, sort_keys=False).rstrip()
            lines += ["", f"<details><summary>{entry['stage']} (<code>{entry['key']}</code>) config</summary>", "",
                      "```yaml", body, "```", "", "</details>"]
    return lines


def render_model_card(
    *,
    record: Mapping[str, Any],
    chain: Sequence[Mapping[str, Any]],
    evals: Sequence[Mapping[str, Any]],
    export_key: str,
    dtype: str,
    int8: bool,
    repo_id: str | None,
) -> str:
    """Markdown with YAML front matter (`library_name`, `tags`, `base_model` when a hub id)."""
    stage, key = record["stage"], record["key"]
    front = {"library_name": "transformers", "pipeline_tag": "text-generation",
             "tags": ["posttrain", *dict.fromkeys(e["stage"] for e in chain if e["stage"] != "prepare_data")]}
    base = _base_model(record.get("config", {}))
    if base:
        front["base_model"] = base
    where = repo_id or "path/to/this/folder"
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {repo_id or f'posttrain {stage} model {key}'}", "",
        f"The `{stage}` model (key `{key}`) of a posttrain pipeline, exported with key `{export_key}`: "
        f"weights in {dtype} safetensors (LoRA adapters, if any, merged), tokenizer with its chat template, "
        "and `generation_config.json` that stops at the end of an assistant turn.", "",
        "## Usage", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
        f'model = AutoModelForCausalLM.from_pretrained("{where}")',
        'messages = [{"role": "user", "content": "Compute 12 + 30."}]',
        'ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")',
        "out = model.generate(ids, max_new_tokens=32, do_sample=False)",
        "print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))",
        "```",
    ]
    if int8:
        lines += ["", "`int8/` holds an int8 weight-only copy (torchao `Int8WeightOnlyConfig`); see `int8/README.md` "
                  "for its format; it loads the same way with torchao installed."]
    lines += ["", "## Evaluation", "", *_eval_table(evals), "", "## Training lineage", "", *_lineage_section(chain), ""]
    versions = record.get("versions", {})
    lines += ["## Provenance", "", f"posttrain {versions.get('posttrain', '?')}, torch {versions.get('torch', '?')}, "
              f"commit `{record.get('git_commit')}`. Every stage folder's `posttrain.json` holds its full resolved "
              "config:", "", "```json", json.dumps({"stage": stage, "key": key, "upstream": record.get("upstream", {})},
                                                   indent=2), "```", ""]
    return "\n".join(lines)
