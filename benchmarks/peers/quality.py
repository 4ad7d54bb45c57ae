"""posttrain vs TRL on one recipe, judged by one scorer: TRL's SFTTrainer, DPOTrainer and GRPOTrainer retrace a
finished posttrain run, and posttrain's own `evaluate` stage scores both sides' models.

    python benchmarks/peers/quality.py RESULTS/grpo/<key> --out RESULTS/peers/<variant>   # one variant (seed)
    python benchmarks/peers/quality.py RESULTS/dpo/<key> --stages sft,dpo --out ...       # the stages so far
    python benchmarks/peers/quality.py --control RESULTS/grpo/<key2> --out RESULTS/peers/<variant>  # a posttrain control
    python benchmarks/peers/quality.py --table RESULTS/peers/seed1 RESULTS/peers/seed2    # the side-by-side table

Run it from the workflow's directory: `model.policy` and verifier files are read relative to it, as the run read them.

The posttrain side is the run itself: the given output's lineage names its data, SFT, DPO and reward folders,
and its evaluate outputs hold the held-out metrics. The TRL side starts from the same model folder
(`model.policy`) and chains SFT -> DPO -> GRPO as a TRL user would, each stage on exactly the rows
posttrain's stage trained on, in the same order (the loaders' seeded permutation, replayed; TRL reads them
sequentially):
- SFT: posttrain's prepared rows as token ids and labels (the same chat template and loss mask).
- DPO: the same pairs (the prepared split, or with `dpo.pairs: on_policy` the pairs of the run's reward scoring
  of its SFT model, which TRL's DPO also starts from: posttrain's SFT and TRL's train alike) as prompt and
  completion text, which TRL tokenizes; the script checks TRL's ids equal
  posttrain's. Sigmoid loss with `beta`, the chosen-NLL term as TRL's `sft` loss at `chosen_nll_weight`,
  reference log-probs precomputed from the SFT model.
- GRPO: the reward stage's prompts (text that tokenizes back to posttrain's ids, checked), the same verifiers
  as the reward function, `group_size` samples, token-level (`dapo`) loss, group-normalized advantages,
  clip `clip_eps`, no KL, `max_new_tokens`, `temperature`.
Every stage: the same steps, batch, AdamW (betas 0.9/0.999, eps 1e-8, weight decay) and learning-rate
schedule (posttrain's `build_lr_scheduler`, handed to the trainer), clipping norm, float32 on CPU.
What TRL lacks is listed in the output (`differences`): posttrain's `grpo.dynamic_sampling`, for one. A control
(`--control`: a posttrain output of the same stage from the same data and starting model, with other settings
of that stage, such as `grpo.dynamic_sampling: false`) joins the table as a side of its own, named by the
settings it changes: it tells whether such a difference is what separates the two sides.

Each TRL output folder gets a `posttrain.json` (stage, key `trl`, the run's config) so `evaluate` reads it as a
stage output; DPO's preference accuracy is measured against TRL's own SFT model, as its reference was.
Wall time per stage: the stage process's own clock on the posttrain side, model load to saved folder on TRL's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).resolve().parent)]

from peers_common import unshifted_labels  # noqa: E402

STAGES = ("sft", "dpo", "grpo")
METRICS = ("accuracy", "pass@1", "pass@4", "nll", "pref_acc")
LOSS_STEPS = 10  # the training-loss comparison: both sides see the same rows, so SFT and DPO start out alike


# ----- the posttrain run -----

def run_folders(folder: Path, stages: Sequence[str]) -> dict[str, Path]:
    """The outputs `folder` was built from (itself included), by stage; those `stages` need must be among them.

    A run with on-policy DPO scores rewards twice: `reward` is the scoring grpo read, `dpo_pairs` the one DPO's pairs
    came from (each stage's own record names its `reward` upstream).
    """
    from posttrain.workflow.lineage import lineage
    from posttrain.workflow.roles import DPO_PAIRS

    entries = lineage(folder)
    folders = {entry["stage"]: Path(entry["path"]) for entry in entries if entry["stage"] != "reward"}
    scorings = {entry["key"]: Path(entry["path"]) for entry in entries if entry["stage"] == "reward"}
    for entry in entries:
        reads = (entry["record"] or {}).get("upstream", {}).get("reward")
        if reads is not None and entry["stage"] in ("dpo", "grpo"):
            folders[DPO_PAIRS if entry["stage"] == "dpo" else "reward"] = scorings[reads]
    needed = ["prepare_data", *stages, *(["reward"] if "grpo" in stages else [])]
    missing = [s for s in needed if s not in folders]
    if missing:
        raise SystemExit(f"{folder}: its lineage lacks {', '.join(missing)}; give the output of the last stage to "
                         f"compare (a GRPO output for all three: prepare_data -> sft -> dpo -> reward -> grpo)")
    for stage in [*needed, *([DPO_PAIRS] if DPO_PAIRS in folders and "dpo" in stages else [])]:
        if not folders[stage].is_dir():
            raise SystemExit(f"{folders[stage]}: the {stage} output the run names is not there")
    return folders


def evaluation_of(stage_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The evaluate output of a stage output (its config names it upstream) and that evaluate config.

    Only a finished one counts: every plan writes its configs, so a dry run under other code or settings leaves
    an evaluate config of the same stage output that never ran.
    """
    from posttrain.utils.provenance import read_provenance

    record = read_provenance(stage_dir)
    evals = stage_dir.parent.parent / "eval"
    planned = []
    for config in sorted(evals.glob("*.config.json")):
        cfg = json.loads(config.read_text())
        if cfg.get("upstream", {}).get(record["stage"]) == record["key"]:
            planned.append((config.with_name(config.name.removesuffix(".config.json")), cfg))
    finished = [(out, cfg) for out, cfg in planned if (out / "metrics.json").is_file()]
    if len(finished) > 1:
        raise SystemExit(f"{stage_dir} has {len(finished)} finished evaluations ({', '.join(str(o) for o, _ in finished)}): "
                         "remove the ones of other settings")
    if finished:
        return finished[0]
    if planned:
        raise SystemExit(f"{', '.join(str(o) for o, _ in planned)}: the evaluation of {stage_dir} has not finished")
    raise SystemExit(f"{evals}: no evaluation of {stage_dir}; run the workflow's evaluate targets first")


def posttrain_side(stage_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A posttrain stage output's held-out metrics, wall time and losses, and the config of its evaluation."""
    from posttrain.utils.provenance import read_provenance

    evaluation, eval_cfg = evaluation_of(stage_dir)
    record = read_provenance(stage_dir)
    return {"metrics": _pick(json.loads((evaluation / "metrics.json").read_text())),
            "wall_time_s": record["wall_time_s"], "threads": record.get("threads"), "folder": str(stage_dir),
            "train_loss": logged_losses(stage_dir)}, eval_cfg


def add_control(control: Path, out: Path) -> dict[str, Any]:
    """Adds to `out`'s comparison a posttrain run of one stage that differs from the compared run only in that
    stage's own settings (same data, same starting model): a side named by those settings, to tell which of
    them makes a posttrain/TRL gap."""
    from posttrain.utils.provenance import read_provenance
    from posttrain.workflow.overrides import dotted_leaves

    result = read_json_if(out / "quality.json")
    if not result:
        raise SystemExit(f"{out / 'quality.json'}: missing; compare the run first")
    record = read_provenance(control)
    stage = record["stage"]
    if stage not in result["stages"]:
        raise SystemExit(f"{control}: a {stage} output; {out / 'quality.json'} compares {', '.join(result['stages'])}")
    run = read_provenance(Path(result["stages"][stage]["posttrain"]["folder"]))
    if record["upstream"] != run["upstream"]:
        raise SystemExit(f"{control}: starts from {record['upstream']}, the compared {stage} from {run['upstream']}; "
                         "a control must differ only in its own stage's settings")
    ours, theirs = (dict(dotted_leaves(cfg.get(stage, {}), stage)) for cfg in (record["config"], run["config"]))
    changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if not changed:
        raise SystemExit(f"{control}: its {stage} settings equal the compared run's; nothing to control for")
    name = "posttrain, " + ", ".join(f"{k}={json.dumps(ours.get(k))}" for k in changed)
    side, _ = posttrain_side(control)
    result["stages"][stage].setdefault("controls", {})[name] = side
    write_json(out / "quality.json", result)
    return result


# ----- TRL's side -----

def _optimizers(model, section: dict[str, Any]):
    """AdamW and posttrain's learning-rate schedule for one stage section, handed to the TRL trainer."""
    import torch

    from posttrain.optim import build_lr_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=float(section["lr"]), betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=float(section.get("weight_decay", 0.0)))
    scheduler = build_lr_scheduler(optimizer, int(section.get("warmup_steps", 0)), int(section["steps"]),
                                   float(section.get("min_lr_ratio", 1.0)), section.get("schedule", "cosine"),
                                   float(section.get("decay_ratio", 0.1)))
    return optimizer, scheduler


def _arguments(section: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    import torch

    return {"output_dir": str(out / "trainer"), "max_steps": int(section["steps"]),
            "learning_rate": float(section["lr"]), "max_grad_norm": float(section.get("max_grad_norm") or 0.0),
            "gradient_accumulation_steps": 1, "bf16": False, "fp16": False, "use_cpu": not torch.cuda.is_available(),
            "report_to": "none", "save_strategy": "no", "logging_steps": 1, "disable_tqdm": False, "seed": seed,
            "dataloader_num_workers": 0}


def _train(trainer, out: Path) -> list[float]:
    """Train, save the model folder, and return the per-step training losses TRL logged."""
    trainer.train()
    trainer.save_model(str(out))
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def _load(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    return model, AutoTokenizer.from_pretrained(str(folder))


def trained_order(batches, steps: int) -> list[int]:
    """The row indices posttrain's loader hands out over `steps` steps, in order (its seeded permutation)."""
    return [int(i) for _ in range(steps) for i in next(batches)["index"]]


def sft_documents(data_dir: Path, order: Sequence[int]) -> dict[str, list[list[int]]]:
    """TRL's rows: each posttrain SFT row's one trained document, labels unshifted (transformers shifts inside)."""
    import numpy as np

    from posttrain.data.store import load_split

    split = load_split(data_dir, "sft")
    rows = split[np.asarray(order)]
    ids_out, labels_out = [], []
    for n, (ids, labels, docs) in enumerate(zip(rows["input_ids"], rows["labels"], rows["document_ids"])):
        ids, labels, docs = np.asarray(ids), np.asarray(labels), np.asarray(docs)
        trained = sorted({int(d) for d in docs[labels != -100]})
        if len(trained) != 1:
            raise SystemExit(f"{data_dir}/sft row {order[n]}: {len(trained)} trained documents in one row; this "
                             "comparison feeds TRL one document per row (set data.packing: false)")
        keep = docs == trained[0]
        ids_out.append(ids[keep].tolist())
        labels_out.append(unshifted_labels(ids[keep], labels[keep]))
    return {"input_ids": ids_out, "labels": labels_out}


def train_sft(policy: Path, data_dir: Path, section: dict[str, Any], seed: int, out: Path) -> list[float]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from posttrain.data.loader import sft_batches

    order = trained_order(sft_batches(data_dir, int(section["batch_size"]), seed=seed), int(section["steps"]))
    model, tokenizer = _load(policy)
    dataset = Dataset.from_dict(sft_documents(data_dir, order))
    args = SFTConfig(**_arguments(section, seed, out), per_device_train_batch_size=int(section["batch_size"]),
                     max_length=None, packing=False, train_sampling_strategy="sequential")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         optimizers=_optimizers(model, section))
    return _train(trainer, out)


def _split_pair(ids: Sequence[int], labels: Sequence[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, trained completion ids) of one posttrain preference sequence (labels shifted by one)."""
    trained = [t + 1 for t, y in enumerate(labels) if y != -100]
    return list(ids[: trained[0]]), list(ids[trained[0] : trained[-1] + 1])


def preference_texts(rows: Any, order: Sequence[int], tokenizer,
                     source: str) -> tuple[dict[str, list[str]], list[dict[str, list[int]]]]:
    """TRL's DPO rows as text (prompt, chosen, rejected; each completion ends with its eos) and the ids they must
    tokenize to, from posttrain's tokenized pairs `rows` (a split; `source` names it in errors)."""
    import numpy as np

    picked = rows[np.asarray(order)]
    texts: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    expected = []
    for c_ids, c_labels, r_ids, r_labels in zip(picked["chosen_input_ids"], picked["chosen_labels"],
                                                picked["rejected_input_ids"], picked["rejected_labels"]):
        prompt, chosen = _split_pair(c_ids, c_labels)
        prompt_r, rejected = _split_pair(r_ids, r_labels)
        if prompt != prompt_r:
            raise SystemExit(f"{source}: a pair's chosen and rejected prompts differ")
        texts["prompt"].append(tokenizer.decode(prompt, skip_special_tokens=False))
        texts["chosen"].append(tokenizer.decode(chosen, skip_special_tokens=False))
        texts["rejected"].append(tokenizer.decode(rejected, skip_special_tokens=False))
        expected.append({"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected})
    return texts, expected


def dpo_stage() -> Any:
    """stages/dpo.py as a module: on-policy pairs are read by the stage's own reader, not a copy of it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("posttrain_dpo_stage", ROOT / "stages" / "dpo.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    return stage


def trained_pairs(data_dir: Path, pairs: Path | None, section: dict[str, Any], data_cfg: dict[str, Any],
                  seed: int) -> tuple[Any, list[int], str]:
    """The pairs posttrain's DPO stage trained on (the prepared split, or with `dpo.pairs: on_policy` the
    reward scoring's pairs), drawn by the stage's own `training_pairs`: the rows, those it drew over its steps,
    and their source."""
    from posttrain.tokenizer import Tokenizer

    if section["pairs"] == "on_policy" and pairs is None:
        raise SystemExit(f"dpo.pairs {section['pairs']}: this comparison maps offline pairs, and on-policy pairs "
                         "from the run's reward scoring (its lineage names none)")
    args = argparse.Namespace(data=str(data_dir), pairs=str(pairs) if section["pairs"] == "on_policy" else None)
    cfg = {"dpo": section, "data": data_cfg, "seed": seed}
    batches, files = dpo_stage().training_pairs(args, cfg, Tokenizer(Path(data_dir) / "tokenizer"),
                                                int(section["batch_size"]), 0, 1)
    source = str(files[0]) if section["pairs"] == "on_policy" else f"{data_dir}/preference"
    return batches.dataset, trained_order(batches, int(section["steps"])), source


def train_dpo(start: Path, data_dir: Path, pairs: Path | None, section: dict[str, Any], data_cfg: dict[str, Any],
              seed: int, out: Path) -> list[float]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    if section["loss"] != "sigmoid" or section["reference"] != "precompute" or section["label_smoothing"]:
        raise SystemExit("this comparison maps dpo.loss sigmoid, dpo.reference precompute, no label smoothing")
    rows, order, source = trained_pairs(data_dir, pairs, section, data_cfg, seed)
    model, tokenizer = _load(start)
    texts, expected = preference_texts(rows, order, tokenizer, source)
    weight = float(section.get("chosen_nll_weight", 0.0))
    losses = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, weight]} if weight else {"loss_type": ["sigmoid"]}
    args = DPOConfig(**_arguments(section, seed, out), per_device_train_batch_size=int(section["batch_size"]),
                     max_length=int(data_cfg["max_seq_len"]), beta=float(section["beta"]),
                     precompute_ref_log_probs=True, train_sampling_strategy="sequential", **losses)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_dict(texts), processing_class=tokenizer,
                         optimizers=_optimizers(model, section))
    got = trainer.train_dataset
    for i, want in enumerate(expected):
        row = {k: list(got[i][k]) for k in want}
        if row != want:
            raise SystemExit(f"TRL tokenized {source} pair {order[i]} to other ids than posttrain trained on: "
                             f"{row} vs {want}")
    return _train(trainer, out)


def train_grpo(start: Path, data_dir: Path, reward_dir: Path, section: dict[str, Any], verifiers: list[Any],
               seed: int, out: Path) -> list[float]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rewards.verifiers import Rewards
    from posttrain.rl.prompts import training_prompts

    steps, per_step, group = int(section["steps"]), int(section["prompts_per_step"]), int(section["group_size"])
    batches = training_prompts(str(data_dir), str(reward_dir), per_step, seed, 0, 1)
    prompt_ids, examples = [], []
    for _ in range(steps):
        batch = next(batches)
        prompt_ids += [list(map(int, p)) for p in batch["prompt_ids"]]
        examples += batch["examples"]
    model, tokenizer = _load(start)
    prompts = [tokenizer.decode(p, skip_special_tokens=False) for p in prompt_ids]
    for i, (text, ids) in enumerate(zip(prompts, prompt_ids)):
        if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            raise SystemExit(f"GRPO prompt {i} does not tokenize back to posttrain's ids")
    rewards = Rewards(verifiers)

    def reward(completions: list[str], example: list[str], **_: Any) -> list[float]:
        rows = [json.loads(e) for e in example]
        return [rewards.total(v) for v in rewards.score(completions, rows)]

    args = GRPOConfig(**_arguments(section, seed, out), per_device_train_batch_size=per_step * group,
                      num_generations=group, max_completion_length=int(section["max_new_tokens"]),
                      temperature=float(section["temperature"]), top_p=1.0, epsilon=float(section["clip_eps"]),
                      beta=float(section["kl_coef"]), loss_type="dapo" if section["token_level"] else "grpo",
                      scale_rewards="group" if section["std_normalize"] else "none", num_iterations=1,
                      shuffle_dataset=False, use_vllm=False)
    dataset = Dataset.from_dict({"prompt": prompts, "example": [json.dumps(e) for e in examples]})
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, optimizers=_optimizers(model, section))
    return _train(trainer, out)


def differences(cfg: dict[str, Any], stages: Sequence[str]) -> list[str]:
    """What posttrain's run used that this TRL run of `stages` does not do alike (a stage's config holds
    only the sections it reads: a DPO output's has no `grpo`)."""
    out = []
    if "grpo" in stages and cfg["grpo"].get("dynamic_sampling"):
        out.append("grpo.dynamic_sampling: posttrain refills groups whose samples all score alike "
                   f"(up to {cfg['grpo']['max_resamples']} resamples); TRL's GRPOTrainer has no such option, so "
                   "its flat groups carry no gradient")
    if "grpo" in stages and cfg["grpo"]["advantage"] != "grpo":
        out.append(f"grpo.advantage {cfg['grpo']['advantage']}: TRL's side uses group-normalized (GRPO) advantages")
    if "dpo" in stages and cfg["dpo"].get("chosen_nll_weight"):
        out.append("the chosen-NLL term: posttrain averages it per sequence, TRL's `sft` loss per token of the batch")
    return out


# ----- one variant -----

def _trl_record(stage: str, cfg: dict[str, Any], wall: float) -> dict[str, Any]:
    return {"stage": stage, "key": "trl", "upstream": {}, "seed": cfg["seed"], "wall_time_s": round(wall, 3),
            "config": cfg, "trainer": "trl"}


def evaluate(eval_cfg: dict[str, Any], data_dir: Path, model: Path, out: Path,
             reference: Path | None) -> dict[str, Any]:
    """posttrain's evaluate stage on `model`, in its own process, as the workflow runs it. An evaluation an earlier
    invocation left at `out` scored the model this one replaced: the stage refuses to overwrite it, so it goes."""
    import shutil

    config = out.with_name(out.name + ".config.json")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(eval_cfg, indent=2))
    command = [sys.executable, str(ROOT / "stages" / "evaluate.py"), "--config", str(config), "--data", str(data_dir),
               "--model", str(model), "--out", str(out)]
    if reference is not None:
        command += ["--reference", str(reference)]
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads((out / "metrics.json").read_text())


def compare(run: Path, out: Path, stages: Sequence[str]) -> dict[str, Any]:
    from posttrain.model_files import resolve_model_source
    from posttrain.models import is_preset
    from posttrain.utils.provenance import read_provenance
    from posttrain.workflow.roles import DPO_PAIRS

    folders = run_folders(run, stages)
    data_dir = folders["prepare_data"]
    cfg = read_provenance(run)["config"]
    seed = int(cfg["seed"])
    if is_preset(cfg["model"]["policy"]):
        raise SystemExit(f"model.policy {cfg['model']['policy']!r} is a preset; TRL needs a model folder")
    policy = resolve_model_source(cfg["model"]["policy"])  # relative to the workflow's directory, as the run read it
    previous = read_json_if(out / "quality.json")
    result: dict[str, Any] = {"run": str(run), "seed": seed, "policy": str(policy), "differences": [],
                              "environment": environment(), "stages": {}}
    starts = {"sft": policy, "dpo": out / "sft", "grpo": out / "dpo"}
    trainers: dict[str, Callable[[Path, Path], list[float]]] = {
        "sft": lambda start, dest: train_sft(start, data_dir, cfg["sft"], seed, dest),
        "dpo": lambda start, dest: train_dpo(start, data_dir, folders.get(DPO_PAIRS), cfg["dpo"], cfg["data"], seed,
                                             dest),
        "grpo": lambda start, dest: train_grpo(start, data_dir, folders["reward"], cfg["grpo"],
                                               cfg["reward"]["verifiers"], seed, dest),
    }
    for stage in [s for s in STAGES if s in folders]:
        ours, eval_cfg = posttrain_side(folders[stage])
        saved = previous.get("stages", {}).get(stage, {})  # this stage's row from an earlier invocation
        row = {"posttrain": ours, **({"controls": saved["controls"]} if "controls" in saved else {})}
        dest = out / stage
        if stage in stages:
            if not starts[stage].is_dir():
                raise SystemExit(f"{starts[stage]}: TRL's {stage} starts from it; run the earlier stages first")
            print(f"TRL {stage} from {starts[stage]}", flush=True)
            began = time.perf_counter()
            losses = trainers[stage](starts[stage], dest)
            wall = time.perf_counter() - began
            (dest / "posttrain.json").write_text(json.dumps(_trl_record(stage, cfg, wall), indent=2))
            metrics = evaluate(eval_cfg, data_dir, dest, out / "eval" / stage,
                               out / "sft" if stage == "dpo" else None)
            row["trl"] = {"metrics": _pick(metrics), "wall_time_s": round(wall, 3), "folder": str(dest),
                          "train_loss": losses}
        elif "trl" in saved:  # TRL's stage from an earlier invocation
            row["trl"] = saved["trl"]
        result["stages"][stage] = row
        result["differences"] = differences(cfg, [s for s, r in result["stages"].items() if "trl" in r])
        write_json(out / "quality.json", result)
    return result


def logged_losses(folder: Path) -> list[float]:
    """A posttrain stage output's per-step training loss (`metrics.jsonl`), step 1 first."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_step = {int(r["step"]): float(r["loss"]) for r in records if "loss" in r}
    return [by_step[step] for step in sorted(by_step)]


def loss_gap(row: dict[str, Any], steps: int = LOSS_STEPS) -> float | None:
    """The largest |posttrain - TRL| per-step training loss over the first `steps` steps (None without both)."""
    if "trl" not in row:
        return None
    ours, theirs = row["posttrain"]["train_loss"][:steps], row["trl"]["train_loss"][:steps]
    return max(abs(a - b) for a, b in zip(ours, theirs)) if ours and theirs else None


def _pick(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: metrics.get(k) for k in METRICS}


def environment() -> dict[str, Any]:
    import torch
    import transformers
    import trl

    from posttrain.report.machine import ISA_FLAGS, cpu_model_and_flags

    cpu, flags = cpu_model_and_flags()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
        commit += " with uncommitted changes" if changed else ""
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
            "isa": sorted(f for f in ISA_FLAGS if f in flags), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__, "commit": commit}


def read_json_if(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


# ----- the table -----

def sides(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A stage's compared runs by side name: posttrain, TRL and each control."""
    return {**{side: row[side] for side in ("posttrain", "trl") if side in row}, **row.get("controls", {})}


def markdown_table(results: list[dict[str, Any]]) -> str:
    """Per stage and side: each metric's mean ± sample std over the variants (seeds), and wall time in minutes."""
    import statistics

    def cell(values: list[float | None], scale: float = 1.0, digits: int = 3) -> str:
        values = [v * scale for v in values if v is not None]
        if not values:
            return "–"
        mean = f"{statistics.fmean(values):.{digits}f}"
        return mean if len(values) == 1 else f"{mean} ± {statistics.stdev(values):.{digits}f}"

    head = ["stage", "side", "greedy accuracy", "pass@1", "pass@4", "NLL", "pref_acc", "minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join([":--", ":--"] + ["--:"] * (len(head) - 2)) + "|"]
    for stage in STAGES:
        per_seed = [sides(r["stages"].get(stage, {})) for r in results]
        controls = sorted({name for found in per_seed for name in found} - {"posttrain", "trl"})
        for side in ("posttrain", "trl", *controls):
            rows = [found[side] for found in per_seed if side in found]
            if not rows:
                continue
            values = [cell([row["metrics"][m] for row in rows]) for m in METRICS]
            minutes = cell([row["wall_time_s"] for row in rows], 1 / 60, digits=1)
            lines.append(f"| {stage} | {side} | " + " | ".join(values) + f" | {minutes} |")
    gaps = []
    for stage in STAGES:
        values = [g for r in results if (g := loss_gap(r["stages"].get(stage, {"posttrain": {}}))) is not None]
        if values:
            gaps.append(f"{stage} {max(values):.4f}")
    if gaps:
        lines += ["", "Per-step training loss, largest |posttrain - TRL| over the first "
                      f"{LOSS_STEPS} steps (any seed): " + ", ".join(gaps) + "."]
    seeds = ", ".join(str(r["seed"]) for r in results)
    env = results[0]["environment"]
    plural = "s" if len(results) > 1 else ""
    isa = f" ({', '.join(env['isa'])})" if env.get("isa") else ""
    usable = f", {env['cores_usable']} usable" if env.get("cores_usable", env["cores"]) != env["cores"] else ""
    threads = f", TRL at {env['torch_threads']} torch thread(s)" if "torch_threads" in env else ""
    ours = sorted({row["posttrain"]["threads"] for r in results for row in r["stages"].values()
                   if row.get("posttrain", {}).get("threads")})
    threads += f", posttrain's stages at {', '.join(map(str, ours))}" if ours else ""
    commits = ", ".join(dict.fromkeys(r["environment"]["commit"] for r in results))
    dates = ", ".join(dict.fromkeys(r["environment"]["date"][:10] for r in results))
    lines += ["", f"*mean ± std over seed{plural} {seeds}; {env['cpu']}{isa}, {env['cores']} cores{usable}{threads}, "
                  f"torch {env['torch']}, "
                  f"transformers {env['transformers']}, TRL {env['trl']}, commit {commits}, {dates}; "
                  "made by `python benchmarks/peers/quality.py --table " +
                  " ".join(r.get("out", "") for r in results).strip() + "`.*"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", nargs="?", type=Path,
                        help="a finished run's output of the last stage to compare (RESULTS/grpo/<key> for all three)")
    parser.add_argument("--out", type=Path, help="where TRL's folders, their evaluations and quality.json go")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help="TRL stages to run (each starts from the one before)")
    parser.add_argument("--control", type=Path,
                        help="with --out: add this posttrain stage output, which differs from the compared run only "
                             "in its stage's settings, to the saved comparison as a side of its own")
    parser.add_argument("--table", type=Path, nargs="+",
                        help="print the markdown table of saved --out folders and exit")
    parser.add_argument("--update", type=Path,
                        help="with --table: write it between <!-- BLOCK:begin --> and <!-- BLOCK:end --> in this file")
    parser.add_argument("--block", default="quality",
                        help="with --update: the marked block's name, one per recipe compared (default: quality)")
    args = parser.parse_args(argv)
    if args.table:
        results = []
        for folder in args.table:
            result = json.loads((folder / "quality.json").read_text())
            results.append({**result, "out": str(folder)})
        notes = dict.fromkeys(note for result in results for note in result["differences"])  # each once, in order
        table = "\n".join([markdown_table(results), "", *(f"- {note}" for note in notes)])
        print(table)
        if args.update:
            from posttrain.report.readme_table import replace_block

            args.update.write_text(replace_block(args.update.read_text(), table, str(args.update), name=args.block))
        return
    if args.control is not None:
        if args.out is None:
            parser.error("--control needs --out (the saved comparison it joins)")
        print(json.dumps(add_control(args.control.resolve(), args.out.resolve())["stages"], indent=2))
        return
    if args.run is None or args.out is None:
        parser.error("give a run's output folder and --out (or --table)")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    result = compare(args.run.resolve(), args.out.resolve(), stages)
    print(json.dumps(result["stages"], indent=2))


if __name__ == "__main__":
    main()
