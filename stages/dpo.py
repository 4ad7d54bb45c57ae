"""dpo: preference optimization of the SFT model (sigmoid DPO, IPO or SimPO; full, LoRA or QLoRA).

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
adapters disabled (LoRA/QLoRA). SimPO needs no reference.

Held-out pairs come from the `eval` split (each task's answer vs. its plausible mistake). Before
training the starting model's likelihood ranking of them is measured (`likelihood_acc_sft`: share of
pairs whose chosen completion it finds more likely, per token for IPO/SimPO); after training the
DPO model's implicit-reward accuracy (`pref_acc`) and its own likelihood ranking
(`likelihood_acc`). Resume state lives in `<out>.resume/`; rerunning the same command continues
from it. The output is an HF model folder with `metrics.jsonl` and `posttrain.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config import load_stage_config
from posttrain.data.loader import Batches, preference_batches, preference_collate, prompt_batches
from posttrain.data.sources import DataError, canonical_rows, load_source
from posttrain.data.store import Split
from posttrain.data.tokenize import preference_split
from posttrain.dpo import (
    OnlineReference,
    PairLogps,
    PrecomputedReference,
    file_stats,
    fingerprint,
    load_cache,
    model_files,
    pair_logprobs,
    reference_cache_path,
    save_cache,
    score_pairs,
)
from posttrain.evaluation import eval_pairs
from posttrain.losses.dpo import preference_loss
from posttrain.models.lora import disable_adapters
from posttrain.optim import OptimizerInBackward, clip_grad_norm_
from posttrain.parallel import barrier, build_mesh, data_parallel_rank, destroy, init_distributed, loss_context
from posttrain.tokenizer import Tokenizer
from posttrain.training.export import save_final_model
from posttrain.training.faults import NonFiniteLossGuard, exit_on_known_errors, explain_out_of_memory, kill_if_requested
from posttrain.training.resume import Checkpointer, StopOnSignal
from posttrain.training.setup import build_model, build_optimizer_and_scheduler, max_grad_norm, model_config, seed_everything
from posttrain.training.stats import data_parallel_sum, non_pad_tokens
from posttrain.utils.metrics import MetricsLogger, peak_memory_mb, progress_bar, reset_peak_memory, truncate_after

STAGE = "dpo"
READS = ("seed", "model.dtype", "data.max_seq_len", "data.truncation", "memory", "parallel", "dpo")
STEP_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin", "logps/chosen", "logps/rejected",
                "nll/chosen")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved config (JSON)")
    parser.add_argument("--out", required=True, help="output model folder (results/dpo/<key>)")
    parser.add_argument("--data", required=True, help="prepared data folder (results/data/<key>)")
    parser.add_argument("--model", required=True, help="starting model: the SFT output folder (also the reference)")
    parser.add_argument("--pairs", help="on-policy pairs file of the reward stage (needed with dpo.pairs: on_policy)")
    return parser.parse_args()


def micro_batch_size(dpo: dict[str, Any], dp_size: int) -> int:
    """Global pairs per micro-batch; refuses sizes that do not split evenly."""
    batch, accum = int(dpo["batch_size"]), int(dpo["grad_accum"])
    if batch % (accum * dp_size):
        raise ValueError(
            f"dpo.batch_size ({batch}) must be divisible by dpo.grad_accum ({accum}) x data-parallel processes ({dp_size})"
        )
    return batch // accum


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
        batches = preference_batches(args.data, micro, seed=cfg["seed"], rank=rank, world_size=size)
        return batches, sorted((Path(args.data) / "preference").glob("data-*.arrow"))
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
    """`preference_loss` for the configured loss type (reference log-probs None for SimPO)."""
    ref_chosen, ref_rejected = ref if ref is not None else (None, None)
    return preference_loss(
        dpo["loss"], policy.chosen, policy.rejected, policy.chosen_tokens, policy.rejected_tokens,
        ref_chosen, ref_rejected, beta=float(dpo["beta"]), label_smoothing=float(dpo["label_smoothing"]),
        simpo_gamma=float(dpo["simpo_gamma"]), chosen_nll_weight=float(dpo["chosen_nll_weight"]),
    )


def main() -> None:
    args = parse_args()
    started = time.time()
    cfg = load_stage_config(args.config, READS, __file__)
    dpo, memory = cfg["dpo"], cfg["memory"]
    steps, accum = int(dpo["steps"]), int(dpo["grad_accum"])
    uses_reference = dpo["loss"] != "simpo"
    per_token = dpo["loss"] in ("ipo", "simpo")

    # --- setup: processes, model, optimizer, data ---
    info = init_distributed()
    mesh = build_mesh(info, tp=cfg["parallel"]["tp"], dp_replicate=cfg["parallel"]["dp_replicate"])
    dp_rank, dp_size = data_parallel_rank(mesh)
    seed_everything(cfg["seed"])
    tokenizer = Tokenizer(Path(args.data) / "tokenizer")
    hf_config = model_config(args.model, tokenizer)
    model = build_model(args.model, hf_config, info, mesh, cfg, dpo["method"], dpo["lora"])

    micro = micro_batch_size(dpo, dp_size)
    rows_per_rank = micro // dp_size
    train, pair_files = training_pairs(args, cfg, tokenizer, micro, dp_rank, dp_size)
    held_out = held_out_pairs(args.data, tokenizer, int(cfg["data"]["max_seq_len"]), cfg["seed"])
    optimizer, scheduler = build_optimizer_and_scheduler(model, dpo, memory)
    in_backward = isinstance(optimizer, OptimizerInBackward)
    clip = max_grad_norm(dpo)
    checkpointer = Checkpointer(args.out, every=dpo["checkpoint_every"], key=cfg["key"])

    # --- reference pass: runs before any checkpoint is loaded, so the weights are the starting model's ---
    cache_path = reference_cache_path(args.out)
    expected = fingerprint(key=cfg["key"], model=model_files(args.model), pairs=file_stats(pair_files),
                           rows=len(train.dataset), held_out=len(held_out), loss=dpo["loss"], reference=dpo["reference"],
                           mixed_precision=memory["mixed_precision"])
    cached = load_cache(cache_path, expected)
    if cached is None:
        def score(dataset: Split, desc: str) -> PairLogps:
            return score_pairs(model, dataset, train.collate, rows_per_rank, mesh, memory, info.device, desc,
                               info.is_main)

        cached = {}
        with disable_adapters(model):
            if len(held_out):
                ref = score(held_out, "reference: held-out pairs")
                cached.update(eval_chosen=ref.chosen, eval_rejected=ref.rejected,
                              eval_chosen_tokens=ref.chosen_tokens, eval_rejected_tokens=ref.rejected_tokens)
            if uses_reference and dpo["reference"] == "precompute":
                ref = score(train.dataset, "reference: training pairs")
                cached.update(train_chosen=ref.chosen, train_rejected=ref.rejected)
        if info.is_main and cached:
            save_cache(cache_path, cached, expected)
        barrier()
    held_out_ref = (PairLogps(cached["eval_chosen"], cached["eval_rejected"], cached["eval_chosen_tokens"],
                              cached["eval_rejected_tokens"]) if len(held_out) else None)

    reference: PrecomputedReference | OnlineReference | None = None
    if uses_reference and dpo["reference"] == "precompute":
        reference = PrecomputedReference(cached["train_chosen"], cached["train_rejected"])
    elif uses_reference and dpo["method"] == "full":
        frozen = build_model(args.model, hf_config, info, mesh, cfg, "full").requires_grad_(False).eval()
        reference = OnlineReference(frozen, mesh, memory, release=True)
    elif uses_reference:
        reference = OnlineReference(model, mesh, memory)  # LoRA/QLoRA: the policy with its adapters disabled

    # --- resume state, logging ---
    resumed = checkpointer.load(model, optimizer, scheduler)
    start_step = 0
    if resumed is not None:
        train.load_state_dict(resumed.data_state)
        start_step = resumed.step
        if info.is_main:
            truncate_after(checkpointer.metrics_path, start_step)
            print(f"resuming from {resumed.path} at step {start_step}", flush=True)
    metrics = MetricsLogger(checkpointer.metrics_path, enabled=info.is_main, loggers=cfg["loggers"],
                            run_name=f"{STAGE}-{cfg['key']}", config=cfg)
    stop = StopOnSignal()
    guard = NonFiniteLossGuard(dpo["skip_nonfinite"], "dpo.skip_nonfinite", skip_possible=not in_backward)
    likelihood_acc_sft = likelihood_accuracy(held_out_ref, per_token) if held_out_ref is not None else None
    if resumed is None and likelihood_acc_sft is not None:
        metrics.log(0, {"eval/likelihood_acc": likelihood_acc_sft})

    # --- training loop ---
    bar = progress_bar(steps, start_step, info.is_main, STAGE)
    record: dict[str, float] = {}
    with explain_out_of_memory(STAGE):
        for step in range(start_step + 1, steps + 1):
            t0 = time.perf_counter()
            reset_peak_memory(info.device)
            batches = [{k: v.to(info.device, non_blocking=True) for k, v in next(train).items()} for _ in range(accum)]
            sums = dict.fromkeys(("loss", *STEP_METRICS), 0.0)
            for batch in batches:
                with loss_context(mesh):
                    ref = reference(batch) if reference is not None else None
                    policy = pair_logprobs(model, batch, mesh, memory)
                    loss, pair_metrics = pair_loss(dpo, policy, ref)
                    # FSDP2 averages gradients over data-parallel ranks: each rank's mean over its
                    # pairs, averaged over micro-batches and ranks, is the mean over the step's pairs.
                    (loss / accum).backward()
                pairs = len(policy.chosen)
                sums["loss"] += float(loss.detach()) * pairs
                for name in STEP_METRICS:
                    sums[name] += float(pair_metrics[name]) * pairs
            useful = sum(non_pad_tokens(b[f"{side}_input_ids"], tokenizer.pad_id)
                         for b in batches for side in ("chosen", "rejected"))
            totals = data_parallel_sum([*sums.values(), useful], mesh, info.device)
            global_pairs = int(dpo["batch_size"])
            record = {name: value / global_pairs for name, value in zip(sums, totals)}

            lr = scheduler.get_last_lr()[0]
            grad_norm = None if in_backward else clip_grad_norm_(model.parameters(), clip)
            if guard.should_skip(step, record["loss"], grad_norm, checkpointer.latest()):
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()

            seconds = time.perf_counter() - t0
            record.update(lr=lr, tokens_per_s=totals[-1] / seconds, peak_memory_mb=peak_memory_mb(info.device))
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            metrics.log(step, record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['rewards/accuracy']:.2f}", refresh=False)
            if info.is_main and step % dpo["log_every"] == 0:
                bar.write(f"step {step}/{steps} " + json.dumps({k: round(v, 6) for k, v in record.items()}))

            saved = checkpointer.save(step, model, optimizer, scheduler, train.state_dict()) if checkpointer.due(step, steps) else None
            if step < steps and stop.requested():
                saved = saved or checkpointer.save(step, model, optimizer, scheduler, train.state_dict())
                bar.close()
                metrics.close()
                stop.exit(step, saved)
            kill_if_requested(step)
    bar.close()

    # --- held-out preference accuracy, final HF folder, resume state removed ---
    summary: dict[str, Any] = {"steps": steps, "reference": dpo["reference"] if uses_reference else None,
                               "train_loss_last": record.get("loss"), "train_reward_acc_last": record.get("rewards/accuracy")}
    if held_out_ref is not None:
        policy = score_pairs(model, held_out, train.collate, rows_per_rank, mesh, memory, info.device,
                             "held-out pairs", info.is_main)
        _, pair_metrics = pair_loss(dpo, policy, (held_out_ref.chosen, held_out_ref.rejected) if uses_reference else None)
        evaluation = {"pref_acc": float(pair_metrics["rewards/accuracy"]), "pref_margin": float(pair_metrics["rewards/margin"]),
                      "likelihood_acc": likelihood_accuracy(policy, per_token)}
        metrics.log(steps, {f"eval/{k}": v for k, v in evaluation.items()})
        summary.update(evaluation, likelihood_acc_sft=likelihood_acc_sft, pref_pairs=len(held_out))
    else:
        summary.update(pref_acc=None, pref_acc_note=f"{args.data}: no eval row carries response and rejected_response")
    metrics.close()
    save_final_model(
        args.out, model, hf_config=hf_config, tokenizer=tokenizer, cfg=cfg, started=started, summary=summary,
        metrics_path=checkpointer.metrics_path, is_main=info.is_main, base_model=args.model,
    )
    checkpointer.remove()
    stop.restore()
    if info.is_main:
        print(json.dumps({"out": args.out, **summary}), flush=True)
    destroy()


if __name__ == "__main__":
    with exit_on_known_errors(STAGE):
        main()
