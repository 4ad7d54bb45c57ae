"""sft: supervised fine-tuning of the policy on the prepared SFT split (full, LoRA or QLoRA).

    python stages/sft.py --config RESOLVED.json --out results/sft/<key> --data results/data/<key>
    torchrun --nproc-per-node N stages/sft.py ...

Reads the config keys in `READS` (and its run settings: loggers, `sft.log_every`, `sft.checkpoint_every`).
`sft.batch_size` rows (all processes together) make one optimizer step, split into
`sft.grad_accum` micro-batches: grad_accum trades memory for time and leaves the result alone.
Every token of the step weighs the same (`posttrain.sft.step`): the summed cross-entropy is divided
by the loss-token count of the whole step (all micro-batches, all ranks).

Held-out loss on `sft_eval` is measured before and after training, and every `sft.eval_every` steps
(`keep: best` and early stopping by it: `posttrain.training.selection`). Resume state lives in
`<out>.resume/` (checkpoint every `sft.checkpoint_every` steps and on SIGTERM); rerunning the
same command continues from it. The output is an HF model folder (LoRA merged, adapters also
in PEFT format under `adapter/`) with `metrics.jsonl` and `posttrain.json`.
"""

from __future__ import annotations

import torch

from posttrain.data.loader import Batch, length_multiple, sft_batches, to_device
from posttrain.losses.head import OutputHead, summed_lm_loss
from posttrain.sft.step import sft_step
from posttrain.training.faults import run_main
from posttrain.training.harness import StageRun
from posttrain.training.held_out import held_out_means
from posttrain.training.setup import model_config

STAGE = "sft"
READS = ("seed", "model.policy", "model.dtype", "model.backend", "memory", "parallel", "sft")  # what its key covers
INPUTS = {
    "data": "prepared data folder (results/data/<key>)",
    "model": "starting model: the output of the stage before sft in `pipeline` (absent: model.policy)",
}


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model",))
    cfg, sft, data_dir = run.cfg, run.section, run.args.data
    start = run.start_model()
    hf_config = model_config(start, run.tokenizer)
    model = run.build_model(start, hf_config, sft["method"], sft["lora"])
    head = OutputHead(model, run.mesh, run.memory)

    micro = run.micro_batch_size()
    multiple = length_multiple(run.memory["compile"] is not None, cfg["parallel"]["tp"])
    train = sft_batches(data_dir, micro, seed=cfg["seed"], rank=run.dp_rank, world_size=run.dp_size, multiple=multiple)
    run.epoch_size(len(train.dataset), sft["batch_size"])  # packed rows
    optimization = run.optimization(model)

    def evaluate() -> dict[str, float]:
        """Held-out loss: one pass over `sft_eval`, from its start each time."""
        held_out = sft_batches(data_dir, micro, seed=cfg["seed"], split="sft_eval", rank=run.dp_rank,
                               world_size=run.dp_size, shuffle=False, loop=False, multiple=multiple)

        def score(batch: Batch) -> dict[str, torch.Tensor]:
            with head.context():
                return {"eval_loss": summed_lm_loss(model, head, batch)}

        return held_out_means(model, held_out, score, ("eval_loss",), run.mesh, run.device)

    run.resume(model, optimization, train)
    before = run.measure_before(evaluate)

    train_step = sft_step(model, head, optimization, run.mesh, run.device, run.tokenizer.pad_id)
    record: dict[str, float] = {}
    for step in run.steps():
        record = train_step([to_device(next(train), run.device) for _ in range(sft["grad_accum"])])
        useful = record.pop("useful_tokens")
        record.update(optimization.step(step, record["loss"]))
        run.log_step(record, postfix={"loss": ".4f", "tokens_per_s": ".0f"}, tokens=useful)

    after = run.final_evaluation()
    summary = {"eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
               "train_loss_last": record["loss"]}
    run.finish(model, hf_config, summary, base_model=start)


if __name__ == "__main__":
    run_main(STAGE, main)
