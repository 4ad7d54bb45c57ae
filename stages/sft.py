"""sft: supervised fine-tuning of the policy on the prepared SFT split (full, LoRA or QLoRA).

    python stages/sft.py --config RESOLVED.json --out results/sft/<key> --data results/data/<key>
    torchrun --nproc-per-node N stages/sft.py ...

Reads the config keys in `READS` (and its run settings: loggers, `sft.log_every`, `sft.checkpoint_every`).
`sft.batch_size` rows (all processes together) make one optimizer step, split into
`sft.grad_accum` micro-batches: grad_accum trades memory for time and leaves the result alone.
Every token of the step weighs the same: the summed cross-entropy is divided by the loss-token
count of the whole step (all micro-batches, all ranks).

Held-out loss on `sft_eval` is measured before and after training. Resume state lives in
`<out>.resume/` (checkpoint every `sft.checkpoint_every` steps and on SIGTERM); rerunning the
same command continues from it. The output is an HF model folder (LoRA merged, adapters also
in PEFT format under `adapter/`) with `metrics.jsonl` and `posttrain.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from posttrain.config import load_stage_config
from posttrain.data.loader import Batches, length_multiple, sft_batches
from posttrain.losses.ce import full_cross_entropy, linear_cross_entropy, num_loss_tokens
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.models import Transformer
from posttrain.optim import OptimizerInBackward, clip_grad_norm_
from posttrain.parallel import (
    build_mesh,
    data_parallel_rank,
    destroy,
    init_distributed,
    loss_context,
    mesh_size,
    uses_tensor_parallel,
)
from posttrain.tokenizer import Tokenizer
from posttrain.training.export import save_final_model
from posttrain.training.faults import (
    NonFiniteLossGuard,
    exit_on_known_errors,
    explain_out_of_memory,
    kill_if_requested,
)
from posttrain.training.resume import Checkpointer, StopOnSignal
from posttrain.training.setup import build_model, build_optimizer_and_scheduler, max_grad_norm, model_config, seed_everything
from posttrain.training.stats import data_parallel_sum, local_value, non_pad_tokens
from posttrain.utils.metrics import (
    MetricsLogger,
    first_value,
    peak_memory_mb,
    progress_bar,
    reset_peak_memory,
    truncate_after,
)

STAGE = "sft"
READS = ("seed", "model.policy", "model.dtype", "memory", "parallel", "sft")  # what its key covers


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved config (JSON)")
    parser.add_argument("--out", required=True, help="output model folder (results/sft/<key>)")
    parser.add_argument("--data", required=True, help="prepared data folder (results/data/<key>)")
    return parser.parse_args()


def micro_batch_size(sft: dict[str, Any], dp_size: int) -> int:
    """Global rows per micro-batch; refuses sizes that do not split evenly."""
    batch, accum = int(sft["batch_size"]), int(sft["grad_accum"])
    if batch % (accum * dp_size):
        raise ValueError(
            f"sft.batch_size ({batch}) must be divisible by sft.grad_accum ({accum}) x data-parallel processes ({dp_size})"
        )
    return batch // accum


def summed_loss(model: Transformer, batch: dict[str, torch.Tensor], mesh: DeviceMesh | None, memory: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy summed over the batch's loss tokens.

    Chunked (no [B, S, V] logits) by default; the full-logits path under tensor parallelism
    (loss parallel on vocabulary-sharded logits) or with memory.chunked_ce off.
    """
    hidden = model(batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"])
    if uses_tensor_parallel(mesh) or not memory["chunked_ce"]:
        return full_cross_entropy(hidden, model.lm_head, batch["labels"], reduction="sum")
    return linear_cross_entropy(hidden, model.lm_head, batch["labels"], num_chunks=memory["ce_chunks"], reduction="sum")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def at_least_one_row(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An evaluation batch a rank can run: the last batch of a split may leave a rank no rows, but
    every rank must take part in each sharded forward. The stand-in row has no loss tokens."""
    rows, seq_len = batch["input_ids"].shape
    if rows:
        return batch
    return {
        "input_ids": torch.zeros(1, seq_len, dtype=torch.long),
        "labels": torch.full((1, seq_len), IGNORE_INDEX, dtype=torch.long),
        "document_ids": torch.zeros(1, seq_len, dtype=torch.long),
        "position_ids": torch.arange(seq_len)[None],
    }


@torch.no_grad()
def held_out_loss(model: Transformer, batches: Batches, mesh: DeviceMesh | None, memory: dict[str, Any], device: torch.device) -> float:
    """Mean cross-entropy per loss token over a whole evaluation split (all ranks together)."""
    model.eval()
    total, tokens = 0.0, 0
    for batch in batches:
        batch = to_device(at_least_one_row(batch), device)
        with loss_context(mesh):
            total += float(local_value(summed_loss(model, batch, mesh, memory)))
        tokens += int(num_loss_tokens(batch["labels"]))
    model.train()
    total, tokens = data_parallel_sum([total, tokens], mesh, device)
    return total / max(tokens, 1)


def main() -> None:
    args = parse_args()
    started = time.time()
    cfg = load_stage_config(args.config, READS, __file__)
    sft, memory = cfg["sft"], cfg["memory"]
    steps = int(sft["steps"])

    # --- setup: processes, model, optimizer, data, resume state, logging ---
    info = init_distributed()
    mesh = build_mesh(info, tp=cfg["parallel"]["tp"], dp_replicate=cfg["parallel"]["dp_replicate"])
    dp_rank, dp_size = data_parallel_rank(mesh)
    seed_everything(cfg["seed"])
    tokenizer = Tokenizer(Path(args.data) / "tokenizer")
    hf_config = model_config(cfg["model"]["policy"], tokenizer)
    model = build_model(cfg["model"]["policy"], hf_config, info, mesh, cfg, sft["method"], sft["lora"])
    optimizer, scheduler = build_optimizer_and_scheduler(model, sft, memory)
    in_backward = isinstance(optimizer, OptimizerInBackward)
    clip = max_grad_norm(sft)

    micro = micro_batch_size(sft, dp_size)
    multiple = length_multiple(bool(memory["compile"]), cfg["parallel"]["tp"])
    train = sft_batches(args.data, micro, seed=cfg["seed"], rank=dp_rank, world_size=dp_size, multiple=multiple)

    def evaluate() -> float:
        """Held-out loss: one pass over `sft_eval`, from its start each time."""
        held_out = sft_batches(args.data, micro, seed=cfg["seed"], split="sft_eval", rank=dp_rank,
                               world_size=dp_size, shuffle=False, loop=False, multiple=multiple)
        return held_out_loss(model, held_out, mesh, memory, info.device)

    checkpointer = Checkpointer(args.out, every=sft["checkpoint_every"], key=cfg["key"])
    resumed = checkpointer.load(model, optimizer, scheduler)
    start_step, last_checkpoint = 0, None
    if resumed is not None:
        train.load_state_dict(resumed.data_state)
        start_step, last_checkpoint = resumed.step, resumed.path
        if info.is_main:
            truncate_after(checkpointer.metrics_path, start_step)
            print(f"resuming from {resumed.path} at step {start_step}", flush=True)
    metrics = MetricsLogger(
        checkpointer.metrics_path,
        enabled=info.is_main,
        loggers=cfg["loggers"],
        run_name=f"{STAGE}-{cfg['key']}",
        config=cfg,
    )
    stop = StopOnSignal()
    guard = NonFiniteLossGuard(sft["skip_nonfinite"], "sft.skip_nonfinite", skip_possible=not in_backward)

    if resumed is None:
        eval_before = evaluate()
        metrics.log(0, {"eval_loss": eval_before})
    else:
        eval_before = first_value(checkpointer.metrics_path, "eval_loss") if info.is_main else float("nan")

    # --- training loop ---
    bar = progress_bar(steps, start_step, info.is_main, STAGE)
    last_loss = float("nan")
    with explain_out_of_memory(STAGE):
        for step in range(start_step + 1, steps + 1):
            t0 = time.perf_counter()
            reset_peak_memory(info.device)
            batches = [to_device(next(train), info.device) for _ in range(int(sft["grad_accum"]))]
            loss_tokens, useful_tokens = data_parallel_sum(
                [sum(num_loss_tokens(b["labels"]) for b in batches),
                 sum(non_pad_tokens(b["input_ids"], tokenizer.pad_id) for b in batches)],
                mesh, info.device,
            )
            # FSDP2 averages gradients over the data-parallel replicas: scale by their number so
            # the gradient is that of (sum of token losses) / (loss tokens of the whole step).
            scale = mesh_size(mesh, "dp_replicate") * mesh_size(mesh, "dp_shard") / max(loss_tokens, 1)
            step_loss = 0.0
            for batch in batches:
                with loss_context(mesh):
                    loss = summed_loss(model, batch, mesh, memory)
                    (loss * scale).backward()
                step_loss += float(local_value(loss.detach()))
            (step_loss,) = data_parallel_sum([step_loss], mesh, info.device)
            last_loss = step_loss / max(loss_tokens, 1)

            lr = scheduler.get_last_lr()[0]
            grad_norm = None if in_backward else clip_grad_norm_(model.parameters(), clip)
            if guard.should_skip(step, last_loss, grad_norm, last_checkpoint):
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()

            seconds = time.perf_counter() - t0
            record = {"loss": last_loss, "lr": lr, "loss_tokens": int(loss_tokens), "step_s": seconds,
                      "tokens_per_s": useful_tokens / seconds, "peak_memory_mb": peak_memory_mb(info.device)}
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            metrics.log(step, record)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            if info.is_main and step % sft["log_every"] == 0:
                bar.write(f"step {step}/{steps} " + json.dumps({k: round(v, 6) for k, v in record.items()}))

            stopping = step < steps and stop.requested()
            if checkpointer.due(step, steps) or stopping:
                last_checkpoint = checkpointer.save(step, model, optimizer, scheduler, train.state_dict())
            if stopping:
                bar.close()
                metrics.close()
                stop.exit(step, last_checkpoint)
            kill_if_requested(step)
    bar.close()

    # --- held-out loss after training, final HF folder, resume state removed ---
    eval_after = evaluate()
    metrics.log(steps, {"eval_loss": eval_after})
    metrics.close()
    summary = {"eval_loss_before": eval_before, "eval_loss_after": eval_after, "train_loss_last": last_loss,
               "steps": steps}
    save_final_model(
        args.out, model, hf_config=hf_config, tokenizer=tokenizer, cfg=cfg, started=started, summary=summary,
        metrics_path=checkpointer.metrics_path, is_main=info.is_main, base_model=cfg["model"]["policy"],
    )
    checkpointer.remove()
    stop.restore()
    if info.is_main:
        print(json.dumps({"out": args.out, **summary}), flush=True)
    destroy()


if __name__ == "__main__":
    with exit_on_known_errors(STAGE):
        main()
