"""dpo: preference optimization of the SFT model (sigmoid DPO, IPO, SimPO, ORPO or KTO; full, LoRA or QLoRA).

    python stages/dpo.py --config RESOLVED.json --data results/data/<key> --model results/sft/<key> --out results/dpo/<key>
    torchrun --nproc-per-node N stages/dpo.py ...
    ... --pairs results/reward/<key>/pairs.parquet      # with dpo.pairs: on_policy

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
(`likelihood_acc`). Resume state lives in `<out>.resume/`; rerunning the same command continues
from it. The output is an HF model folder with `metrics.jsonl` and `posttrain.json`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from posttrain.data.loader import Batches, preference_batches, preference_collate, prompt_batches, to_device
from posttrain.data.sources import DataError, canonical_rows, load_source
from posttrain.data.store import Split
from posttrain.data.tokenize import preference_split
from posttrain.dpo import (
    OnlineReference,
    completion_logprobs,
    PairLogps,
    PrecomputedReference,
    file_stats,
    fingerprint,
    load_cache,
    model_files,
    pair_logprobs,
    reference_cache_path,
    reshard,
    save_cache,
    score_pairs,
)
from posttrain.evaluation import eval_pairs
from posttrain.losses.dpo import REFERENCE_FREE, UNPAIRED, kto_loss, kto_reference_point, pair_reward_type, preference_loss
from posttrain.losses.head import OutputHead
from posttrain.models import Transformer
from posttrain.models.lora import disable_adapters
from posttrain.parallel import barrier
from posttrain.tokenizer import Tokenizer
from posttrain.training.faults import run_main
from posttrain.training.harness import StageRun
from posttrain.training.setup import model_config
from posttrain.training.stats import data_parallel_sum, non_pad_tokens

STAGE = "dpo"
READS = ("seed", "model.policy", "model.dtype", "data.max_seq_len", "data.truncation", "memory", "parallel", "dpo")
INPUTS = {
    "data": "prepared data folder (results/data/<key>)",
    "model": "starting model (also the reference): the output of the stage before dpo in `pipeline` (absent: model.policy)",
    "pairs": "on-policy pairs file of the reward stage (needed with dpo.pairs: on_policy)",
}
STEP_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected",
                "nll/chosen")
KTO_METRICS = ("kl", "rewards/accuracy", "rewards/margin", "logps/completion", "nll/chosen")


def on_policy_pairs(path: str, tok: Tokenizer, data_cfg: dict[str, Any]) -> Split:
    """The reward stage's pairs (prompt, chosen, rejected), tokenized like the prepared preference split."""
    rows, _ = canonical_rows(load_source(path), "preference", path)
    columns, stats = preference_split(rows, tok, int(data_cfg["max_seq_len"]), data_cfg["truncation"])
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
        raise DataError("dpo.pairs is on_policy: pass the reward stage's pairs file with --pairs")
    dataset = on_policy_pairs(args.pairs, tok, cfg["data"])
    return Batches(dataset, micro, preference_collate(tok.pad_id), seed=cfg["seed"], rank=rank, world_size=size), [Path(args.pairs)]


def held_out_pairs(data_dir: str, tok: Tokenizer, max_len: int, seed: int) -> Split:
    """Pairs of the `eval` split's rows that carry a reference and a rejected response (possibly none)."""
    examples = [ex for batch in prompt_batches(data_dir, 256, seed=seed, split="eval", shuffle=False, loop=False)
                for ex in batch["examples"]]
    return Split.from_columns(eval_pairs(examples, tok, max_len))


def likelihood_accuracy(logps: PairLogps, per_token: bool) -> float:
    """Share of pairs whose chosen completion the model finds more likely (ties count as wrong)."""
    chosen, rejected = logps.chosen.double(), logps.rejected.double()
    if per_token:
        chosen, rejected = chosen / logps.chosen_tokens.clamp(min=1), rejected / logps.rejected_tokens.clamp(min=1)
    return float((chosen > rejected).double().mean())


def pair_loss(dpo: dict[str, Any], policy: PairLogps,
              ref: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`preference_loss` for the configured loss type (reference log-probs None for SimPO and ORPO; KTO's
    pairs by its implicit reward)."""
    ref_chosen, ref_rejected = ref if ref is not None else (None, None)
    return preference_loss(
        pair_reward_type(dpo["loss"]), policy.chosen, policy.rejected, policy.chosen_tokens, policy.rejected_tokens,
        ref_chosen, ref_rejected, beta=float(dpo["beta"]), label_smoothing=float(dpo["label_smoothing"]),
        simpo_gamma=float(dpo["simpo_gamma"]), chosen_nll_weight=float(dpo["chosen_nll_weight"]),
    )


def kto_point(run: StageRun, model: Transformer, head: OutputHead, batches: list[dict[str, torch.Tensor]],
              refs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """KTO's z0 over the step's rows (all micro-batches and ranks): the policy's mismatched completions, no gradient."""
    policy_sum = ref_sum = 0.0
    with torch.no_grad(), head.context():
        for batch, (_, ref_mismatched) in zip(batches, refs):
            mismatched, _ = completion_logprobs(model, head, batch["rejected_input_ids"], batch["rejected_labels"])
            policy_sum += float(mismatched.double().sum())
            ref_sum += float(ref_mismatched.double().sum())
    reshard(model)
    policy_total, ref_total = data_parallel_sum([policy_sum, ref_sum], run.mesh, run.device)
    return kto_reference_point(torch.tensor(policy_total), torch.tensor(ref_total), int(run.section["batch_size"]))


def kto_row_loss(dpo: dict[str, Any], model: Transformer, head: OutputHead, batch: dict[str, torch.Tensor],
                 ref: tuple[torch.Tensor, torch.Tensor], z0: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO on a micro-batch of unpaired rows (their own completions), plus the desirable rows' NLL weight."""
    policy, tokens = completion_logprobs(model, head, batch["chosen_input_ids"], batch["chosen_labels"])
    desirable = batch["desirable"]
    loss, metrics = kto_loss(policy, ref[0], desirable, z0.to(policy.device), beta=float(dpo["beta"]),
                             desirable_weight=float(dpo["desirable_weight"]),
                             undesirable_weight=float(dpo["undesirable_weight"]))
    nll = torch.where(desirable, -policy / tokens.clamp(min=1), torch.zeros_like(policy)).sum() / len(policy)
    metrics["nll/chosen"] = nll.detach()
    return loss + float(dpo["chosen_nll_weight"]) * nll, metrics


def reference_scores(run: StageRun, model: Transformer, head: OutputHead, train: Batches, held_out: Split,
                     pair_files: list[Path], precompute: bool) -> dict[str, torch.Tensor]:
    """The starting model's log-probs of the held-out pairs (and, with `precompute`, of every training pair).

    Runs before any checkpoint is loaded, so the weights are the starting model's; cached in the
    resume state, so a resumed run does not score again.
    """
    dpo = run.section
    cache_path = reference_cache_path(run.out)
    expected = fingerprint(key=run.cfg["key"], model=model_files(run.start_model()), pairs=file_stats(pair_files),
                           rows=len(train.dataset), held_out=len(held_out), loss=dpo["loss"], reference=dpo["reference"],
                           mixed_precision=run.memory["mixed_precision"])
    cached = load_cache(cache_path, expected)
    if cached is not None:
        return cached
    rows_per_rank = run.micro_batch_size() // run.dp_size
    splits = {"eval": (held_out, "reference: held-out pairs")} if len(held_out) else {}
    if precompute:
        splits["train"] = (train.dataset, "reference: training pairs")
    cached = {}
    with disable_adapters(model):
        for name, (dataset, desc) in splits.items():
            ref = score_pairs(model, head, dataset, train.collate, rows_per_rank, run.device, desc, run.is_main)
            cached.update({f"{name}_chosen": ref.chosen, f"{name}_rejected": ref.rejected,
                           f"{name}_chosen_tokens": ref.chosen_tokens, f"{name}_rejected_tokens": ref.rejected_tokens})
    if run.is_main and cached:
        save_cache(cache_path, cached, expected)
    barrier()
    return cached


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model", "pairs"))
    cfg, dpo, args = run.cfg, run.section, run.args
    start = run.start_model()
    accum = int(dpo["grad_accum"])
    uses_reference = dpo["loss"] not in REFERENCE_FREE
    per_token = dpo["loss"] in ("ipo", "simpo", "orpo")
    hf_config = model_config(start, run.tokenizer)
    model = run.build_model(start, hf_config, dpo["method"], dpo["lora"])
    head = OutputHead(model, run.mesh, run.memory)

    micro = run.micro_batch_size()
    train, pair_files = training_pairs(args, cfg, run.tokenizer, micro, run.dp_rank, run.dp_size)
    held_out = held_out_pairs(args.data, run.tokenizer, int(cfg["data"]["max_seq_len"]), cfg["seed"])
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

    run.resume(model, optimization, train)
    before = run.measure_before(lambda: {} if held_out_ref is None else {
        "eval/likelihood_acc": likelihood_accuracy(held_out_ref, per_token)})

    record: dict[str, Any] = {}
    metric_names = KTO_METRICS if dpo["loss"] in UNPAIRED else STEP_METRICS
    for step in run.steps():
        batches = [to_device(next(train), run.device) for _ in range(accum)]
        with head.context():
            refs = [reference(batch) if reference is not None else None for batch in batches]
        z0 = kto_point(run, model, head, batches, refs) if dpo["loss"] in UNPAIRED else None
        sums = dict.fromkeys(("loss", *metric_names), 0.0)
        for batch, ref in zip(batches, refs):
            with head.context():
                loss, pair_metrics = kto_row_loss(dpo, model, head, batch, ref, z0) if z0 is not None \
                    else pair_loss(dpo, pair_logprobs(model, head, batch), ref)
                # Each rank's mean over its rows, counted accum x dp times in the step: the mean over the step's rows.
                optimization.backward(loss, per=accum * run.dp_size)
            pairs = len(batch["chosen_input_ids"])
            sums["loss"] += float(loss.detach()) * pairs
            for name in metric_names:
                sums[name] += float(pair_metrics[name]) * pairs
        useful = sum(non_pad_tokens(b[f"{side}_input_ids"], run.tokenizer.pad_id)
                     for b in batches for side in ("chosen", "rejected"))
        totals = data_parallel_sum([*sums.values(), useful], run.mesh, run.device)
        record = {name: value / int(dpo["batch_size"]) for name, value in zip(sums, totals)}
        record.update(optimization.step(step, record["loss"]))
        record["tokens_per_s"] = totals[-1] / run.seconds()
        run.log_step(record, postfix={"loss": ".4f", "rewards/accuracy": ".2f"})

    summary: dict[str, Any] = {"steps": run.total_steps, "reference": dpo["reference"] if uses_reference else None,
                               "train_loss_last": record.get("loss"), "train_reward_acc_last": record.get("rewards/accuracy")}
    if held_out_ref is not None:
        policy = score_pairs(model, head, held_out, train.collate, micro // run.dp_size, run.device, "held-out pairs",
                             run.is_main)
        _, pair_metrics = pair_loss(dpo, policy, (held_out_ref.chosen, held_out_ref.rejected) if uses_reference else None)
        evaluation = {"pref_acc": float(pair_metrics["rewards/accuracy"]), "pref_margin": float(pair_metrics["rewards/margin"]),
                      "likelihood_acc": likelihood_accuracy(policy, per_token)}
        run.log(run.total_steps, {f"eval/{k}": v for k, v in evaluation.items()})
        summary.update(evaluation, likelihood_acc_sft=before["eval/likelihood_acc"], pref_pairs=len(held_out))
    else:
        summary.update(pref_acc=None, pref_acc_note=f"{args.data}: no eval row carries response and rejected_response")
    run.finish(model, hf_config, summary, base_model=start)


if __name__ == "__main__":
    run_main(STAGE, main)
