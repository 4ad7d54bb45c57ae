"""reward_model: a Bradley-Terry reward model trained on the prepared preference split.

    python stages/reward_model.py --config RESOLVED.json --data DATA_DIR [--model POLICY_DIR] --out DIR

Reads the config keys in `READS` (and its run settings: loggers, `reward_model.log_every`,
`reward_model.checkpoint_every`). The model is the starting policy's decoder plus a scalar head
(`posttrain.rewards.reward_model`), the policy being the one GRPO starts from (`--model`, or
`model.policy` when GRPO comes first in `pipeline`): every native family, and on the transformers
backend (`model.backend`) the families transformers has a sequence classifier for, whose own
`*ForSequenceClassification` it then is (a family without one is refused here and in the dry run,
`posttrain.rules.reward_model_backend_problem`). A seeded `reward_model.held_out` share of the
pairs is held out; each step takes `reward_model.batch_size` of the others and minimizes
-log sigmoid(r_chosen - r_rejected). The decoder trains in full or with LoRA/QLoRA adapters
(`reward_model.method`, `reward_model.lora`); the new score head always trains in full and is saved with
the adapter (PEFT's `modules_to_save`). Held-out pairwise accuracy (ties count as wrong) is measured
before training, every `reward_model.eval_every` steps and at the last.

Resume state lives in `<out>.resume/` (every `reward_model.checkpoint_every` steps and on SIGTERM,
with the non-finite guard `reward_model.skip_nonfinite`); rerunning the same command continues
from it. The output is a Hugging Face sequence-classification folder (`*ForSequenceClassification`,
one label) that `transformers` scores exactly as the stage does, with the tokenizer,
`metrics.jsonl` and `posttrain.json` (held-out accuracy before and after, pair counts); with adapters,
what `reward_model.save` asks (`posttrain.training.final_model`: merged weights, the PEFT adapter
(task type SEQ_CLS), or both).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from posttrain.data.loader import Batches, preference_collate
from posttrain.data.store import Split, load_split
from posttrain.losses.bradley_terry import bradley_terry_loss
from posttrain.rewards import RewardModel, load_reward_model, reward_model_config, scored_lengths
from posttrain.rules import reward_model_backend_problem
from posttrain.training.faults import SettingError, run_main
from posttrain.training.harness import StageRun
from posttrain.training.setup import add_adapters, backend_of, model_config

STAGE = "reward_model"
READS = ("seed", "model.policy", "model.dtype", "model.backend", "memory", "reward_model")
INPUTS = {
    "data": "prepared data folder (results/data/<key>): its preference split",
    "model": "the policy GRPO starts from, whose decoder the reward model starts from (absent: model.policy)",
}
EVAL_BATCH = 64  # pairs per held-out forward


def pair_rewards(model: RewardModel, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) rewards of a preference batch, in one forward over both sides."""
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]).to(device)
    lengths = torch.cat([scored_lengths(batch["chosen_labels"]), scored_lengths(batch["rejected_labels"])]).to(device)
    return model(ids, lengths).chunk(2)


@torch.no_grad()
def pairwise_accuracy(model: RewardModel, pairs: Split, pad_id: int, device: torch.device) -> float:
    """Share of pairs whose chosen completion out-scores the rejected one (ties count as wrong)."""
    model.eval()
    wins = []
    for batch in Batches(pairs, EVAL_BATCH, preference_collate(pad_id), seed=0, shuffle=False, loop=False):
        chosen, rejected = pair_rewards(model, batch, device)
        wins += (chosen > rejected).tolist()
    model.train()
    return float(np.mean(wins))


def split_pairs(run: StageRun) -> tuple[Split, Split]:
    """(training, held-out) pairs: a seeded `held_out` share kept apart, both in data order."""
    section, data_dir = run.section, run.args.data
    pairs = load_split(data_dir, "preference")
    order = np.random.default_rng([run.cfg["seed"], len(pairs)]).permutation(len(pairs))
    n_held = max(1, int(len(pairs) * section["held_out"]))
    if len(pairs) - n_held < section["batch_size"]:
        raise ValueError(f"{data_dir}/preference: {len(pairs)} pairs leave fewer than reward_model.batch_size "
                         f"({section['batch_size']}) to train on after holding out {n_held}")
    return pairs.select(np.sort(order[n_held:])), pairs.select(np.sort(order[:n_held]))


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model",), one_process=True)
    section, pad_id, device = run.section, run.tokenizer.pad_id, run.device
    start = run.start_model()
    config = model_config(start, run.tokenizer)
    run.backend = backend_of(start, config, run.cfg["model"]["backend"])
    why = reward_model_backend_problem(str(config.get("model_type")), run.backend)  # the dry run's rule too
    if why:
        raise SettingError(f"reward_model.source: {why}")
    run.check_adapters(section["method"], start)
    model = load_reward_model(start, device=device, backend=run.cfg["model"]["backend"])
    add_adapters(model, section["method"], section["lora"], modules_to_save=("score",))
    pairs, held_out = split_pairs(run)
    train = Batches(pairs, section["batch_size"], preference_collate(pad_id), seed=run.cfg["seed"])
    run.epoch_size(len(pairs), section["batch_size"])
    optimization = run.optimization(model)

    run.resume(model, optimization, train)
    before = run.measure_before(lambda: {"held_out_accuracy": pairwise_accuracy(model, held_out, pad_id, device)})
    record: dict[str, Any] = {}
    for step in run.steps():
        chosen, rejected = pair_rewards(model, next(train), device)
        loss, stats = bradley_terry_loss(chosen, rejected)
        optimization.backward(loss)
        record = {"loss": loss.item(), **{k: v.item() for k, v in stats.items()}}
        record.update(optimization.step(step, record["loss"]))
        run.log_step(record)
    after = run.final_evaluation()

    summary = {
        "held_out_accuracy_before": before["held_out_accuracy"],
        "held_out_accuracy": after["held_out_accuracy"],
        "train_loss_last": record["loss"],
        "train_pairs": len(pairs),
        "held_out_pairs": len(held_out),
    }
    run.finish(model.eval(), reward_model_config(model, pad_id), summary, base_model=start)


if __name__ == "__main__":
    run_main(STAGE, main)
