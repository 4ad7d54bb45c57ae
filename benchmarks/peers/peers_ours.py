"""posttrain's side of the peer benchmark: the stages' own steps on the shared model folder and data.

Each workload has a `setup_*` (build model, optimizer, batches; not measured) and `run` (the
warm-up and timed steps, measured for peak memory by `benchmarks/_memory.py`). The memory
settings are the shipped defaults (`config/config.yaml`: chunked cross-entropy on, no activation
checkpointing, plain AdamW, no compile), float32 on CPU, one process.

- SFT: the stage's step (`posttrain.sft.step.sft_step`: the summed cross-entropy over the step's
  loss tokens) and its `Optimization` (clip, AdamW) on rows from `posttrain.data.packing.pack_or_pad`: packed rows with per-document
  attention, or one document per row padded to the row length (what data prep writes with
  `data.packing: false`), batched as the SFT loader batches them (padding-free: the rows' trained
  spans repacked into as few rows as fit, per-document attention), inside the timed step as the
  stage's loader does it.
- DPO: the stage's step (`posttrain.dpo.step.preference_step`: sigmoid DPO on chunked pair log-probs)
  with the reference log-probs precomputed in setup by the starting model (`dpo.reference: precompute`).
- GRPO: the stage's step (`posttrain.rl.step.GRPOStep`, one inner epoch, one micro-batch) on groups
  the rollout worker samples with the current weights (the native KV-cache sampler), the new weights
  pushed to it after each step, as the stage's sync mode does.
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
    """The stage-section keys `Optimization` reads: AdamW, constant lr, clipping, no non-finite skips."""
    return {"lr": s.lr, "weight_decay": s.weight_decay, "max_grad_norm": s.max_grad_norm, "grad_accum": 1,
            "warmup_steps": 0, "min_lr_ratio": 1.0, "steps": s.total_steps, "skip_nonfinite": 0}


def _model_and_optimization(folder: Path, cfg: dict[str, Any], stage: str):
    """The stage's setup: a process group where the stage would have one (torchrun, or CUDA), model, optimization.

    Plain `python` on CPU (the peer runs): one process, no mesh, float32.
    """
    from posttrain.model_files import read_hf_config
    from posttrain.parallel import build_mesh, init_distributed
    from posttrain.training.optimization import Optimization
    from posttrain.training.setup import build_model

    info = init_distributed()
    mesh = build_mesh(info)
    model = build_model(str(folder), read_hf_config(folder), info, mesh, cfg)
    return model, Optimization(model, cfg[stage], cfg["memory"], mesh, stage), mesh, info.device


def setup_sft(folder: Path, s: Settings, packed: bool, documents: Documents | None = None,
              features: tuple[str, ...] = ("chunked_ce",), backend: str = "native") -> dict[str, Any]:
    """SFT rows of `documents` (default: `sft_documents`), packed or one per row; the first `total_steps` batches.

    `features` are `sft_memory.FEATURES` names (default: the shipped memory settings); with
    `optimizer_in_backward` there is no gradient clipping (the stage refuses the combination). `backend` is
    `model.backend` (every setup takes it: `transformers` measures the fallback on the same model).
    """
    from sft_memory import variant_config
    from sft_throughput import stored_batches

    from posttrain.data.packing import pack_or_pad
    from posttrain.losses.head import OutputHead
    from posttrain.sft.step import sft_step

    cfg = variant_config(features)
    cfg["model"]["backend"] = backend
    cfg["sft"].update(_optimizer_section(s))
    if cfg["memory"]["optimizer_in_backward"]:
        cfg["sft"]["max_grad_norm"] = None
    model, optimization, mesh, device = _model_and_optimization(folder, cfg, "sft")
    ids, labels = documents or sft_documents(s, sft_document_count(s))
    if not packed:
        ids, labels = ids[: s.total_steps * s.rows], labels[: s.total_steps * s.rows]
    rows = pack_or_pad(ids, labels, s.seq, PAD_ID, packing=packed)
    data = stored_batches(rows, s.rows)[: s.total_steps]  # batched in the timed step (`_step`)
    if len(data) < s.total_steps:
        raise ValueError(f"SFT data give {len(data)} batches of {s.rows} rows, fewer than {s.total_steps} steps")
    step = sft_step(model, OutputHead(model, mesh, cfg["memory"]), optimization, mesh, device, PAD_ID)
    return {"kind": "sft", "model": model, "optimization": optimization, "step": step, "device": device, "cfg": cfg, "data": data,
            "settings": s}


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


def setup_dpo(folder: Path, s: Settings, backend: str = "native") -> dict[str, Any]:
    from dpo_memory import variant_config

    from posttrain.data.loader import preference_collate
    from posttrain.dpo import PrecomputedReference, pair_logprobs
    from posttrain.dpo.step import preference_step
    from posttrain.losses.head import OutputHead

    cfg = variant_config("off", "precompute", None)
    cfg["model"]["backend"] = backend
    cfg["memory"] = _memory_defaults()
    cfg["dpo"].update(_optimizer_section(s), beta=s.dpo_beta)
    model, optimization, mesh, device = _model_and_optimization(folder, cfg, "dpo")
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
    step = preference_step({**cfg["dpo"], "batch_size": s.pairs}, model, head, reference, optimization, mesh, device,
                           PAD_ID)
    return {"kind": "dpo", "optimization": optimization, "step": step, "device": device, "cfg": cfg, "data": data,
            "settings": s}


def setup_grpo(folder: Path, s: Settings, backend: str = "native") -> dict[str, Any]:
    from posttrain.losses.head import OutputHead
    from posttrain.rl.rollout import PromptBatch, WorkerSpec, build_worker
    from posttrain.rl.step import GRPOStep, GroupBaseline

    # One inner epoch, one micro-batch a step, token-level PPO clipping, no KL reference.
    grpo = {**_optimizer_section(s), "std_normalize": True, "clip_eps": s.clip_eps, "clip_eps_high": None,
            "temperature": s.temperature, "tis_cap": 2.0, "advantage": "grpo", "inner_epochs": 1,
            "micro_batch_size": s.prompts * s.group, "token_level": True, "ratio": "token", "kl_coef": 0.0}
    cfg = {"seed": s.seed, "model": {"backend": backend}, "memory": _memory_defaults(), "parallel": {"tp": 1, "dp_replicate": 1}, "grpo": grpo}
    model, optimization, mesh, device = _model_and_optimization(folder, cfg, "grpo")
    if mesh is not None:
        raise ValueError("the GRPO peer run is one process on CPU (run it with plain python)")
    spec = WorkerSpec(backend="native", model_dir=str(folder), model_backend=backend, tokenizer_dir=str(folder),
                      group_size=s.group, temperature=s.temperature, max_new_tokens=s.max_new_tokens, verifiers=(REWARD_SPEC,),
                      max_batch_size=256, seed=s.seed)
    prompts = grpo_prompts(s, s.total_steps * s.prompts)
    data = [PromptBatch(prompts[i : i + s.prompts], [{}] * s.prompts, list(range(i, i + s.prompts)))
            for i in range(0, len(prompts), s.prompts)]
    step = GRPOStep(grpo, model, OutputHead(model, None, cfg["memory"]), optimization,
                    GroupBaseline(grpo, None, device), None, None, PAD_ID, None, device)
    return {"kind": "grpo", "model": model, "worker": build_worker(spec), "step": step, "version": 0,
            "device": device, "cfg": cfg, "data": data, "settings": s}


def train_one(state: dict[str, Any], batch: Any, step: int) -> tuple[float, int]:
    """(loss, useful tokens) of one training step."""
    kind = state["kind"]
    if kind == "grpo":
        from posttrain.rl.collection import StepBatch
        from posttrain.rl.rollout import rollout_stats
        from posttrain.rl.weights import policy_weights

        groups = state["worker"].collect(batch, state["settings"].seed + step)
        record = state["step"](StepBatch(groups, rollout_stats(groups), state["version"], step, 0.0, 0.0), step + 1)
        state["version"] += 1
        state["worker"].update_weights(policy_weights(state["model"], every_rank=True), state["version"])
        useful = sum(len(g.prompt_ids) * g.group_size + sum(len(c) for c in g.completions) for g in groups)
        return record["loss"], useful
    if kind == "sft":
        from posttrain.data.loader import length_multiple, sft_rows_batch

        stored, useful = batch  # useful: the non-pad tokens of the rows as stored (TRL's count)
        batch = sft_rows_batch(*stored, multiple=length_multiple(state["cfg"]["memory"]["compile"] is not None))
    else:
        useful = int((batch["chosen_input_ids"] != PAD_ID).sum() + (batch["rejected_input_ids"] != PAD_ID).sum())
    record = state["step"]([{k: v.to(state["device"]) for k, v in batch.items()}])
    state["optimization"].step(step + 1, record["loss"])
    return record["loss"], useful


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
