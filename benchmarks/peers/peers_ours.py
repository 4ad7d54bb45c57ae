"""posttrain's side of the peer benchmark: the stages' own steps on the shared model folder and data.

Each workload has a `setup_*` (build model, optimizer, batches; not measured) and `run` (the
warm-up and timed steps, measured for peak memory by `benchmarks/_memory.py`). The memory
settings are the shipped defaults (`config/config.yaml`: chunked cross-entropy on, no activation
checkpointing, plain AdamW, no compile), float32 on CPU, one process.

- SFT: `sft_memory.train_step` (the stage's `summed_loss`, divided by the loss tokens, clip,
  AdamW) on rows from `posttrain.data.packing.pack_or_pad`: packed rows with per-document
  attention, or one document per row padded to the row length (what data prep writes with
  `data.packing: false`), batched as the SFT loader batches them (padding-free: the rows' trained
  spans repacked into as few rows as fit, per-document attention), inside the timed step as the
  stage's loader does it.
- DPO: `dpo_memory.train_step` (sigmoid DPO on chunked pair log-probs) with the reference
  log-probs precomputed in setup by the starting model (`dpo.reference: precompute`).
- GRPO: `_posttrain_step.grpo_step`: the stage's sync step with the native KV-cache sampler.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peers_common import (
    Documents,
    PAD_ID,
    REWARD_SPEC,
    Settings,
    grpo_prompts,
    preference_pairs,
    sft_document_count,
    sft_documents,
)


def _memory_defaults() -> dict[str, Any]:
    from sft_memory import variant_config

    return variant_config(("chunked_ce",))["memory"]  # = config/config.yaml's memory section


def _optimizer_section(s: Settings) -> dict[str, Any]:
    """The stage-section keys `build_optimizer_and_scheduler` reads: AdamW, constant lr, clipping."""
    return {"lr": s.lr, "weight_decay": s.weight_decay, "max_grad_norm": s.max_grad_norm, "grad_accum": 1,
            "warmup_steps": 0, "min_lr_ratio": 1.0, "steps": s.total_steps}


def _model_and_optimizer(folder: Path, cfg: dict[str, Any], stage: str):
    """The stage's setup: a process group where the stage would have one (torchrun, or CUDA), model, optimizer.

    Plain `python` on CPU (the peer runs): one process, no mesh, float32.
    """
    from posttrain.checkpoint import read_hf_config
    from posttrain.parallel import build_mesh, init_distributed
    from posttrain.training.setup import build_model, build_optimizer_and_scheduler

    info = init_distributed()
    mesh = build_mesh(info)
    model = build_model(str(folder), read_hf_config(folder), info, mesh, cfg)
    optimizer, _ = build_optimizer_and_scheduler(model, cfg[stage], cfg["memory"])
    return model, optimizer, mesh, info.device


def setup_sft(folder: Path, s: Settings, packed: bool, documents: Documents | None = None,
              features: tuple[str, ...] = ("chunked_ce",)) -> dict[str, Any]:
    """SFT rows of `documents` (default: `sft_documents`), packed or one per row; the first `total_steps` batches.

    `features` are `sft_memory.FEATURES` names (default: the shipped memory settings); with
    `optimizer_in_backward` there is no gradient clipping (the stage refuses the combination).
    """
    from sft_memory import variant_config
    from sft_throughput import stored_batches

    from posttrain.data.packing import pack_or_pad
    from posttrain.losses.head import OutputHead
    from posttrain.training.setup import max_grad_norm

    cfg = variant_config(features)
    cfg["sft"].update(_optimizer_section(s))
    if cfg["memory"]["optimizer_in_backward"]:
        cfg["sft"]["max_grad_norm"] = None
    model, optimizer, mesh, device = _model_and_optimizer(folder, cfg, "sft")
    ids, labels = documents or sft_documents(s, sft_document_count(s))
    if not packed:
        ids, labels = ids[: s.total_steps * s.rows], labels[: s.total_steps * s.rows]
    rows = pack_or_pad(ids, labels, s.seq, PAD_ID, packing=packed)
    data = stored_batches(rows, s.rows)[: s.total_steps]  # batched in the timed step (`_step`)
    if len(data) < s.total_steps:
        raise ValueError(f"SFT data give {len(data)} batches of {s.rows} rows, fewer than {s.total_steps} steps")
    return {"kind": "sft", "model": model, "optimizer": optimizer, "mesh": mesh, "device": device, "cfg": cfg,
            "head": OutputHead(model, mesh, cfg["memory"]), "clip": max_grad_norm(cfg["sft"]), "data": data, "settings": s}


def preference_columns(pairs: list[tuple[list[int], list[int], list[int]]]) -> dict[str, list[np.ndarray]]:
    """Rows as data prep writes the preference split: prompt + completion ids, labels aligned (-100 on the prompt)."""
    cols: dict[str, list[np.ndarray]] = {}
    for prompt, chosen, rejected in pairs:
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            ids = np.array(prompt + completion, dtype=np.int64)
            labels = np.full(len(ids), -100, dtype=np.int64)
            labels[len(prompt) - 1 : -1] = completion  # position t predicts token t + 1
            cols.setdefault(f"{side}_input_ids", []).append(ids)
            cols.setdefault(f"{side}_labels", []).append(labels)
    return cols


def setup_dpo(folder: Path, s: Settings) -> dict[str, Any]:
    from dpo_memory import variant_config

    from posttrain.data.loader import preference_collate
    from posttrain.dpo import PrecomputedReference, pair_logprobs
    from posttrain.losses.head import OutputHead
    from posttrain.training.setup import max_grad_norm

    cfg = variant_config("off", "precompute", None)
    cfg["memory"] = _memory_defaults()
    cfg["dpo"].update(_optimizer_section(s), beta=s.dpo_beta)
    model, optimizer, mesh, device = _model_and_optimizer(folder, cfg, "dpo")
    cols = preference_columns(preference_pairs(s, s.total_steps * s.pairs))
    collate = preference_collate(PAD_ID)
    data = []
    for start in range(0, s.total_steps * s.pairs, s.pairs):
        index = np.arange(start, start + s.pairs)
        data.append(collate({k: [v[i] for i in index] for k, v in cols.items()}, index))
    with torch.no_grad():  # the reference pass of `dpo.reference: precompute`, before training
        head = OutputHead(model, mesh, cfg["memory"])
        ref = [pair_logprobs(model, head, {k: v.to(device) for k, v in batch.items()}) for batch in data]
    reference = PrecomputedReference(torch.cat([r.chosen for r in ref]), torch.cat([r.rejected for r in ref]))
    return {"kind": "dpo", "model": model, "optimizer": optimizer, "mesh": mesh, "device": device, "cfg": cfg,
            "head": head, "reference": reference, "clip": max_grad_norm(cfg["dpo"]), "data": data, "settings": s}


def setup_grpo(folder: Path, s: Settings) -> dict[str, Any]:
    from posttrain.losses.head import OutputHead
    from posttrain.rl.rollout import PromptBatch, WorkerSpec, build_worker
    from posttrain.training.setup import max_grad_norm

    cfg = {"seed": s.seed, "memory": _memory_defaults(), "parallel": {"tp": 1, "dp_replicate": 1},
           "grpo": {**_optimizer_section(s), "std_normalize": True, "clip_eps": s.clip_eps,
                    "temperature": s.temperature, "tis_cap": 2.0}}
    model, optimizer, mesh, device = _model_and_optimizer(folder, cfg, "grpo")
    if mesh is not None:
        raise ValueError("the GRPO peer run is one process on CPU (run it with plain python)")
    spec = WorkerSpec(backend="native", model_dir=str(folder), tokenizer_dir=str(folder), group_size=s.group,
                      temperature=s.temperature, max_new_tokens=s.max_new_tokens, verifiers=(REWARD_SPEC,),
                      max_batch_size=256, seed=s.seed)
    worker = build_worker(spec)
    prompts = grpo_prompts(s, s.total_steps * s.prompts)
    data = [PromptBatch(prompts[i : i + s.prompts], [{}] * s.prompts, list(range(i, i + s.prompts)))
            for i in range(0, len(prompts), s.prompts)]
    return {"kind": "grpo", "model": model, "optimizer": optimizer, "worker": worker, "head": OutputHead(model, None, cfg["memory"]),
            "cfg": cfg, "clip": max_grad_norm(cfg["grpo"]), "pad_id": PAD_ID, "version": 0, "data": data,
            "settings": s}


def train_one(state: dict[str, Any], batch: Any, step: int) -> tuple[float, int]:
    """(loss, useful tokens) of one training step."""
    kind = state["kind"]
    if kind == "grpo":
        from _posttrain_step import grpo_step

        out = grpo_step(state, batch, seed=state["settings"].seed + step)
        return out["loss"], out["useful_tokens"]
    if kind == "sft":
        from sft_memory import train_step

        from posttrain.data.loader import length_multiple, sft_rows_batch

        stored, useful = batch  # useful: the non-pad tokens of the rows as stored (TRL's count)
        batch = sft_rows_batch(*stored, multiple=length_multiple(bool(state["cfg"]["memory"]["compile"])))
    else:
        from dpo_memory import train_step

        useful = int((batch["chosen_input_ids"] != PAD_ID).sum() + (batch["rejected_input_ids"] != PAD_ID).sum())
    state["batch"] = {k: v.to(state["device"]) for k, v in batch.items()}
    return train_step(state), useful


def run(state: dict[str, Any]) -> dict[str, Any]:
    """Warm-up then timed steps; the window runs from the end of the last warm-up step to the end of the last step."""
    s: Settings = state["settings"]
    useful, losses, start = 0, [], time.perf_counter()
    for step, batch in enumerate(state["data"]):
        if step == s.warmup:
            start = time.perf_counter()
        loss, tokens = train_one(state, batch, step)
        losses.append(loss)
        if step >= s.warmup:
            useful += tokens
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": s.steps, "useful_tokens": useful, "losses": losses}
