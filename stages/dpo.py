"""dpo: preference optimization of the SFT model (sigmoid DPO, IPO, SimPO, ORPO or KTO; full, LoRA or QLoRA).

    python stages/dpo.py --config RESOLVED.json --data results/data/<key> --model results/sft/<key> --out results/dpo/<key>
    torchrun --nproc-per-node N stages/dpo.py ...
    ... --pairs results/reward/<key>      # with dpo.pairs: on_policy (the folder's pairs.jsonl, or a pairs file)

Reads the config keys in `READS` (and its run settings: loggers, `dpo.log_every`,
`dpo.checkpoint_every`). Pairs are the prepared `preference` split (`dpo.pairs: offline`) or the
reward stage's on-policy pairs (`on_policy`: a parquet/jsonl file of prompt/chosen/rejected rows,
tokenized here like the prepared split). `dpo.batch_size` pairs (all processes together) make one
optimizer step, split into `dpo.grad_accum` micro-batches; each pair weighs the same.

The reference is the starting model. `dpo.reference: precompute` scores every training pair with
it once, before training, and caches the log-probs in `<out>.resume/` (no reference model in
memory while training); `online` scores each batch with a frozen copy (full) or with the
adapters disabled (LoRA/QLoRA). SimPO and ORPO need no reference (ORPO adds the chosen NLL itself).

KTO (`dpo.loss: kto`) trains on the prepared `unpaired` split instead: completions labelled
desirable or not, each stored with a mismatched completion for the KL reference point z0. z0 is
measured over the whole step (every micro-batch and rank, without gradients) before its backward
passes, so grad_accum and the process count leave it alone; `dpo.chosen_nll_weight` applies to the
desirable rows.

Held-out pairs come from the `eval` split (each task's answer vs. its plausible mistake). Before
training the starting model's likelihood ranking of them is measured (`likelihood_acc_sft`: share of
pairs whose chosen completion it finds more likely, per token for IPO/SimPO); after training the
DPO model's implicit-reward accuracy (`pref_acc`) and its own likelihood ranking
(`likelihood_acc`); every `dpo.eval_every` steps too (`eval_pref_acc`, ... in `metrics.jsonl`: `keep: best`
and early stopping compare them). Resume state lives in `<out>.resume/`; rerunning the same command continues
from it. The output is an HF model folder with `metrics.jsonl` and `posttrain.json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from posttrain.data.loader import Batches, preference_batches, preference_collate, eval_split_rows, to_device
from posttrain.data.sources import DataError, canonical_rows, load_source
from posttrain.data.store import Split
from posttrain.data.tokenize import preference_split
from posttrain.dpo import OnlineReference, PairLogps, PrecomputedReference, reference_scores, score_pairs
from posttrain.dpo.step import PER_TOKEN, likelihood_accuracy, pair_loss, preference_step
from posttrain.evaluation import eval_pairs
from posttrain.losses.dpo import REFERENCE_FREE, UNPAIRED
from posttrain.losses.head import OutputHead
from posttrain.tokenizer import Tokenizer
from posttrain.training.faults import SettingError, run_main
from posttrain.training.harness import StageRun
from posttrain.training.setup import model_config

STAGE = "dpo"
READS = ("seed", "model.policy", "model.dtype", "model.backend", "data.max_seq_len", "data.truncation", "memory", "parallel", "dpo")
INPUTS = {
    "data": "prepared data folder (results/data/<key>)",
    "model": "starting model (also the reference): the output of the stage before dpo in `pipeline` (absent: model.policy)",
    "pairs": "the reward stage's output folder (its pairs.jsonl) or a pairs file (needed with dpo.pairs: on_policy)",
}


def on_policy_pairs(path: str, tok: Tokenizer, data_cfg: dict[str, Any]) -> Split:
    """The reward stage's pairs (prompt, chosen, rejected), tokenized like the prepared preference split."""
    rows, _ = canonical_rows(load_source(path), "preference", path)
    columns, stats = preference_split(rows, tok, data_cfg["max_seq_len"], data_cfg["truncation"])
    if not columns["chosen_input_ids"]:
        raise DataError(f"{path}: no usable pair ({stats})")
    return Split.from_columns(columns)


def training_pairs(args: argparse.Namespace, cfg: dict[str, Any], tok: Tokenizer, micro: int, rank: int,
                   size: int) -> tuple[Batches, list[Path]]:
    """The training pair batches of this rank and the files they come from (for the reference cache key)."""
    if cfg["dpo"]["pairs"] == "offline":
        if args.pairs:
            raise DataError("--pairs is given but dpo.pairs is offline; set dpo.pairs: on_policy to train on it")
        split = "unpaired" if cfg["dpo"]["loss"] in UNPAIRED else "preference"
        batches = preference_batches(args.data, micro, seed=cfg["seed"], split=split, rank=rank, world_size=size)
        if not len(batches.dataset):
            raise DataError(f"{args.data}/{split}: no rows to train dpo.loss={cfg['dpo']['loss']} on")
        return batches, sorted((Path(args.data) / split).glob("data-*.arrow"))
    if cfg["dpo"]["loss"] in UNPAIRED:
        raise DataError(f"dpo.loss={cfg['dpo']['loss']} trains on the unpaired split: set dpo.pairs: offline")
    if not args.pairs:
        raise DataError("dpo.pairs is on_policy: pass the reward stage's output folder (or its pairs file) with --pairs")
    given = Path(args.pairs)
    pairs = given / "pairs.jsonl" if given.is_dir() else given
    dataset = on_policy_pairs(str(pairs), tok, cfg["data"])
    return Batches(dataset, micro, preference_collate(tok.pad_id), seed=cfg["seed"], rank=rank, world_size=size), [pairs]


def held_out_pairs(data_dir: str, tok: Tokenizer, max_len: int) -> Split:
    """Pairs of the `eval` split's rows that carry a reference and a rejected response (possibly none)."""
    return Split.from_columns(eval_pairs(eval_split_rows(data_dir)["examples"], tok, max_len))


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model", "pairs"))
    cfg, dpo, args = run.cfg, run.section, run.args
    start = run.start_model()
    accum = dpo["grad_accum"]
    uses_reference = dpo["loss"] not in REFERENCE_FREE
    per_token = dpo["loss"] in PER_TOKEN
    hf_config = model_config(start, run.tokenizer)
    model = run.build_model(start, hf_config, dpo["method"], dpo["lora"])
    head = OutputHead(model, run.mesh, run.memory)

    micro = run.micro_batch_size()
    train, pair_files = training_pairs(args, cfg, run.tokenizer, micro, run.dp_rank, run.dp_size)
    held_out = held_out_pairs(args.data, run.tokenizer, cfg["data"]["max_seq_len"])
    run.epoch_size(len(train.dataset), dpo["batch_size"])
    optimization = run.optimization(model)

    precompute = uses_reference and dpo["reference"] == "precompute"
    cached = reference_scores(run, model, head, train, held_out, pair_files, precompute)
    held_out_ref = (PairLogps(cached["eval_chosen"], cached["eval_rejected"], cached["eval_chosen_tokens"],
                              cached["eval_rejected_tokens"]) if len(held_out) else None)
    reference: PrecomputedReference | OnlineReference | None = None
    if precompute:
        reference = PrecomputedReference(cached["train_chosen"], cached["train_rejected"])
    elif uses_reference and dpo["method"] == "full":
        frozen = run.frozen_model(start, hf_config)
        reference = OnlineReference(frozen, OutputHead(frozen, run.mesh, run.memory), release=True)
    elif uses_reference:
        reference = OnlineReference(model, head)  # LoRA/QLoRA: the policy with its adapters disabled

    def evaluate() -> dict[str, float]:
        """Held-out pairs: implicit-reward accuracy and margin against the reference, and likelihood accuracy."""
        if held_out_ref is None:
            return {}
        policy = score_pairs(model, head, held_out, train.collate, micro // run.dp_size, run.device, "held-out pairs",
                             run.is_main)
        _, pair_metrics = pair_loss(dpo, policy, (held_out_ref.chosen, held_out_ref.rejected) if uses_reference else None)
        return {"eval_pref_acc": float(pair_metrics["rewards/accuracy"]),
                "eval_pref_margin": float(pair_metrics["rewards/margin"]),
                "eval_likelihood_acc": likelihood_accuracy(policy, per_token)}

    if held_out_ref is None and run.eval_every:
        raise SettingError(f"dpo.eval_every: {args.data}: no eval row carries response and rejected_response, "
                           "so there is nothing to evaluate during training; set dpo.eval_every: 0")
    run.resume(model, optimization, train)
    before = run.measure_before(evaluate)

    train_step = preference_step(dpo, model, head, reference, optimization, run.mesh, run.device, run.tokenizer.pad_id)
    record: dict[str, Any] = {}
    for step in run.steps():
        record = train_step([to_device(next(train), run.device) for _ in range(accum)])
        useful = record.pop("useful_tokens")
        record.update(optimization.step(step, record["loss"]))
        run.log_step(record, postfix={"loss": ".4f", "rewards/accuracy": ".2f"}, tokens=useful)

    after = run.final_evaluation()
    summary: dict[str, Any] = {"reference": dpo["reference"] if uses_reference else None,
                               "train_loss_last": record.get("loss"), "train_reward_acc_last": record.get("rewards/accuracy")}
    if held_out_ref is not None:
        summary.update({k.removeprefix("eval_"): v for k, v in after.items()},
                       likelihood_acc_sft=before["eval_likelihood_acc"], pref_pairs=len(held_out))
    else:
        summary.update(pref_acc=None, pref_acc_note=f"{args.data}: no eval row carries response and rejected_response")
    run.finish(model, hf_config, summary, base_model=start)


if __name__ == "__main__":
    run_main(STAGE, main)
