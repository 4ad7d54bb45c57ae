"""GRPO's prompts: the reward stage's filtered set (or the data's `prompts` split), and the held-out eval rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from posttrain.data.loader import Batches, eval_split_rows, prompt_batches, prompt_collate
from posttrain.data.store import Split, load_split
from posttrain.rl.rollout import PromptBatch

PROMPT_COLUMNS = ("prompt_ids", "answer", "task", "example")
PROMPTS_FILE = "grpo_prompts.parquet"


def training_prompts(data_dir: str, reward_dir: str | None, batch_size: int, seed: int, rank: int,
                     world_size: int) -> Batches:
    """The reward stage's `grpo_prompts.parquet` in `reward_dir`, or the data's `prompts` split without one."""
    if reward_dir is None:
        return prompt_batches(data_dir, batch_size, seed=seed, rank=rank, world_size=world_size)
    path = Path(reward_dir) / PROMPTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the reward stage writes the GRPO prompt set there")
    missing = [c for c in PROMPT_COLUMNS if c not in pq.read_schema(path).names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (expected {', '.join(PROMPT_COLUMNS)})")
    dataset = Split(pq.read_table(path, columns=list(PROMPT_COLUMNS)))
    if len(dataset) < batch_size:
        raise ValueError(f"{path}: {len(dataset)} prompts, fewer than grpo.prompts_per_step ({batch_size})")
    return Batches(dataset, batch_size, prompt_collate, seed=seed, rank=rank, world_size=world_size)


def prompt_count(data_dir: str, reward_dir: str | None) -> int:
    """How many prompts `training_prompts` draws from (what `grpo.epochs` counts)."""
    if reward_dir is None:
        return len(load_split(data_dir, "prompts"))
    path = Path(reward_dir) / PROMPTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the reward stage writes the GRPO prompt set there")
    return pq.read_metadata(path).num_rows


def eval_prompts(data_dir: str, n: int, rank: int, world_size: int) -> PromptBatch:
    """This data-parallel rank's share of the first `n` rows of the `eval` split."""
    prompts = PromptBatch.from_loader(eval_split_rows(data_dir, n))
    return PromptBatch(prompts.prompt_ids[rank::world_size], prompts.examples[rank::world_size], prompts.index[rank::world_size])
