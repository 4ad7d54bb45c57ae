"""TRL's side of the peer benchmark: SFTTrainer, DPOTrainer and GRPOTrainer on the shared model folder and data.

The settings mirror posttrain's (`peers_ours.py`): the model loaded from the same folder
(`transformers`, SDPA attention, float32 on CPU), the same data in the same order (sequential
sampler), AdamW with the same lr, betas, eps and weight decay at a constant schedule, clipping at
the same norm, no gradient checkpointing, no mixed precision (TRL turns both on by default; a CPU
run in float32 cannot use bf16). Everything else is TRL's default, as a TRL user gets it:
its fused (chunked) LM-head loss, its per-step metrics, AdamW from `transformers`' default
`optim`, and dynamic padding to the longest sequence of each batch.

- SFT padded: pre-tokenized documents (`input_ids` + `labels` with the prompt masked), no packing.
- SFT packed: TRL's packing (best-fit decreasing), which is padding-free: the rows of a batch
  are concatenated into one sequence and `transformers` masks attention per document from the
  position ids.
- DPO: sigmoid loss with `precompute_ref_log_probs=True` (no reference model while training).
- GRPO: `model.generate` (no vLLM), no KL term (beta 0), DAPO token-level loss, group-scaled
  rewards, the same verifiable reward function (`peers_common.parity_reward`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from peers_common import (
    Documents,
    PAD_ID,
    Settings,
    grpo_prompts,
    parity_reward,
    preference_pairs,
    sft_document_count,
    sft_documents,
    text,
    unshifted_labels,
)

os.environ.setdefault("TQDM_DISABLE", "1")


def trl_version() -> str:
    import trl

    return trl.__version__


def _load(folder: Path):
    """Model (float32 master weights, SDPA attention) and tokenizer from the shared folder, on the GPU if there is one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="sdpa")
    return model, AutoTokenizer.from_pretrained(str(folder))


def _common_args(config_cls: type, s: Settings, out: str, bf16: bool = False, compile_backend: str | None = None
                 ) -> dict[str, Any]:
    """TrainingArguments shared by the three trainers. `bf16`: autocast mixed precision (CUDA);
    `compile_backend`: `torch_compile` with this backend."""
    # transformers 5.x renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    names = {f.name for f in dataclasses.fields(config_cls)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    args = {
        "output_dir": out, "max_steps": s.total_steps, "learning_rate": s.lr, "lr_scheduler_type": "constant",
        "warmup_steps": 0, "adam_beta1": s.betas[0], "adam_beta2": s.betas[1], "adam_epsilon": s.eps,
        "weight_decay": s.weight_decay, "max_grad_norm": s.max_grad_norm, "gradient_accumulation_steps": 1,
        checkpointing: False, "bf16": bf16, "fp16": False, "use_cpu": not torch.cuda.is_available(),
        "report_to": "none", "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True, "seed": s.seed,
        "dataloader_num_workers": 0, "log_level": "error",
    }
    if compile_backend:
        args.update(torch_compile=True, torch_compile_backend=compile_backend)
    return args


class StepClock(TrainerCallback):
    """The wall-clock time and tokens-seen counter at the end of every optimizer step."""

    def __init__(self) -> None:
        self.begin = 0.0
        self.ends: list[float] = []
        self.tokens_seen: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())
        self.tokens_seen.append(int(state.num_input_tokens_seen))


class CountingCollator:
    """Wraps the trainer's collator and records each training batch's non-pad tokens, batch after batch."""

    def __init__(self, collate, pad_id: int):
        self.collate, self.pad_id, self.counts = collate, pad_id, []

    def __call__(self, examples):
        batch = self.collate(examples)
        self.counts.append(int((batch["input_ids"] != self.pad_id).sum()))
        return batch


def setup_sft(folder: Path, s: Settings, packed: bool, documents: Documents | None = None, bf16: bool = False,
              compile_backend: str | None = None) -> dict[str, Any]:
    """SFTTrainer on `documents` (default: `sft_documents`), packed or padded."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _load(folder)
    ids, labels = documents or sft_documents(s, sft_document_count(s))
    if not packed:
        ids, labels = ids[: s.total_steps * s.rows], labels[: s.total_steps * s.rows]
    dataset = Dataset.from_dict({"input_ids": [d.tolist() for d in ids],
                                 "labels": [unshifted_labels(d, y) for d, y in zip(ids, labels)]})
    out = tempfile.mkdtemp(prefix="peers-trl-")
    args = SFTConfig(**_common_args(SFTConfig, s, out, bf16, compile_backend), per_device_train_batch_size=s.rows, max_length=s.seq, packing=packed,
                     train_sampling_strategy="sequential")
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    return _state(trainer, s, count_batches=True)


def setup_dpo(folder: Path, s: Settings) -> dict[str, Any]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tokenizer = _load(folder)
    pairs = preference_pairs(s, s.total_steps * s.pairs)
    dataset = Dataset.from_dict({"prompt": [text(p) for p, _, _ in pairs],
                                 "chosen": [" " + text(c) for _, c, _ in pairs],
                                 "rejected": [" " + text(r) for _, _, r in pairs]})
    out = tempfile.mkdtemp(prefix="peers-trl-")
    args = DPOConfig(**_common_args(DPOConfig, s, out), per_device_train_batch_size=s.pairs, max_length=s.seq, beta=s.dpo_beta,
                     loss_type=["sigmoid"], precompute_ref_log_probs=True, train_sampling_strategy="sequential")
    trainer = DPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    return _state(trainer, s, count_batches=True)


def trl_parity_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """TRL reward function: `peers_common.parity_reward` on each decoded completion."""
    return [parity_reward(c, {}) for c in completions]


def setup_grpo(folder: Path, s: Settings) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _load(folder)
    prompts = grpo_prompts(s, s.total_steps * s.prompts)
    dataset = Dataset.from_dict({"prompt": [text(p) for p in prompts]})
    out = tempfile.mkdtemp(prefix="peers-trl-")
    args = GRPOConfig(**_common_args(GRPOConfig, s, out), per_device_train_batch_size=s.prompts * s.group,
                      num_generations=s.group, max_completion_length=s.max_new_tokens, temperature=s.temperature,
                      epsilon=s.clip_eps, beta=0.0, loss_type="dapo", scale_rewards="group", num_iterations=1,
                      shuffle_dataset=False, use_vllm=False)
    trainer = GRPOTrainer(model=model, reward_funcs=[trl_parity_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    return _state(trainer, s, count_batches=False)


def _state(trainer, s: Settings, count_batches: bool) -> dict[str, Any]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    clock = StepClock()
    trainer.add_callback(clock)
    counter = None
    if count_batches:
        counter = CountingCollator(trainer.data_collator, PAD_ID)
        trainer.data_collator = counter
    return {"trainer": trainer, "clock": clock, "counter": counter, "settings": s}


def run(state: dict[str, Any]) -> dict[str, Any]:
    """`trainer.train()`; the timed window runs from the end of the last warm-up step (without warm-up: from the
    start of training) to the end of the last step."""
    s: Settings = state["settings"]
    trainer, clock = state["trainer"], state["clock"]
    trainer.train()
    shutil.rmtree(trainer.args.output_dir, ignore_errors=True)  # save_strategy "no": nothing of value there
    if len(clock.ends) != s.total_steps:
        raise RuntimeError(f"TRL ran {len(clock.ends)} steps, expected {s.total_steps}")
    start = clock.ends[s.warmup - 1] if s.warmup else clock.begin
    timed = range(s.warmup, s.total_steps)
    if state["counter"] is not None:
        useful = sum(state["counter"].counts[i] for i in timed)
    else:
        seen = [0, *clock.tokens_seen]
        useful = seen[s.total_steps] - seen[s.warmup]
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    return {"seconds": clock.ends[-1] - start, "steps": s.steps, "useful_tokens": useful, "losses": losses}
