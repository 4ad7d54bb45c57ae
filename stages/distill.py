"""distill: knowledge distillation of a trained teacher into a smaller student.

    python stages/distill.py --config RESOLVED.json --data DATA --teacher TEACHER_DIR --out DIR
    torchrun --nproc-per-node N stages/distill.py ...

Reads the config keys in `READS` (and its run settings: loggers, `distill.log_every`,
`distill.checkpoint_every`). The teacher is a model folder (the workflow passes the output of
`distill.teacher_stage`, GRPO's by default), loaded frozen, in eval mode, run without gradients,
and parallelized like the student (FSDP2 / TP) but given no optimizer. The student is
`model.student`: a preset (random init, its vocabulary sized to the teacher's output), or an HF
folder / hub id, trained in full or with LoRA/QLoRA adapters (`distill.method`, `distill.lora`). Teacher, student and data must share one tokenizer and vocabulary; a mismatch
stops the stage naming both sides.

Loss (`posttrain.losses.kd.kd_loss`): `(1 - ce_weight) * D + ce_weight * CE` with D the `distill.loss`
divergence (forward_kl | reverse_kl | jsd with `jsd_beta`) at `distill.temperature` and CE the
student's cross-entropy against the responses (the SFT split's, or the teacher's samples; on-policy
the loss is D alone, as in GKD, since CE on the student's own samples would reinforce them), over the
trained tokens, chunk by chunk from both models' hidden states and output heads: neither model's
[batch, seq, vocab] logits exist (`memory.chunked_ce: false` computes them whole, for comparison).
Like SFT, the summed loss of a step is divided by the step's trained-token count (all
micro-batches, all ranks), and `distill.grad_accum` splits `distill.batch_size` rows into micro-batches.

Data (`distill.data`):
- off_policy: the prepared SFT split (teacher-forced on the reference responses);
- on_policy (GKD, Agarwal et al. 2024): completions the student samples (temperature 1, at most
  `distill.max_new_tokens` tokens) for the `prompts` split, scored token by token by the teacher.
  Every `distill.on_policy_every` steps the student's current weights sample the prompts of the
  next `on_policy_every` steps in one batch: 1 is strictly on-policy; larger values trade
  freshness for fewer, larger generation calls. Pending completions are part of the resume state.
- teacher_samples: completions the teacher samples the same way for the `prompts` split, which
  has no reference responses: what the teacher learned beyond the labelled split (from preference
  pairs, from rewards) reaches the student on unlabelled prompts. CE (weight `ce_weight`) is then
  on the teacher's sampled tokens: sequence-level KD (Kim & Rush 2016) beside the token divergence.

At the end, greedy accuracy on the first `distill.eval_prompts` rows of the `eval` split is measured
for teacher and student (by the first of `reward.verifiers`, as `evaluate` counts it), and the
held-out divergence on `sft_eval` before and after training (and every `distill.eval_every` steps, for
`keep: best` and early stopping); all go to the `posttrain.json` summary.
Resume state, metrics and the HF output folder as in SFT.
"""

from __future__ import annotations

from posttrain.data.loader import Batches, eval_split_rows, length_multiple, prompt_batches, sft_batches, to_device
from posttrain.distill import (
    SampledBatches,
    VocabularyMismatchError,
    check_same_vocabulary,
    distill_loss,
    parameter_count,
    sampling_model,
    student_config,
)
from posttrain.distill.step import distill_step
from posttrain.evaluation.greedy import model_greedy_accuracy
from posttrain.losses.head import OutputHead
from posttrain.model_files import resolve_model_source
from posttrain.models import Transformer
from posttrain.training.faults import run_main
from posttrain.training.harness import StageRun
from posttrain.training.held_out import held_out_means
from posttrain.training.setup import model_config

STAGE = "distill"
READS = ("seed", "model.policy", "model.student", "model.dtype", "model.backend", "data.max_seq_len", "memory", "parallel", "reward.verifiers", "distill")
INPUTS = {
    "data": "prepared data folder (results/data/<key>)",
    "teacher": "teacher: distill.teacher_stage's output, or the stage before distill in `pipeline` (absent: model.policy)",
}


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("teacher",))
    cfg, distill, data_dir = run.cfg, run.section, run.args.data
    accum = distill["grad_accum"]
    on_policy = distill["data"] == "on_policy"
    sampled = on_policy or distill["data"] == "teacher_samples"
    # Cross-entropy needs reference labels: on the student's own samples it would only reinforce them.
    ce_weight = 0.0 if on_policy else distill["ce_weight"]
    verifier = cfg["reward"]["verifiers"][0]

    # --- teacher (frozen) and student: one tokenizer, one vocabulary ---
    teacher_dir = resolve_model_source(run.start_model("teacher"))
    teacher_config = model_config(str(teacher_dir), run.tokenizer)
    hf_config = student_config(cfg["model"]["student"], run.tokenizer, teacher_config)
    check_same_vocabulary(run.tokenizer, teacher_dir, teacher_config, cfg["model"]["student"], hf_config)
    teacher = run.frozen_model(str(teacher_dir), teacher_config)
    student = run.build_model(cfg["model"]["student"], hf_config, distill["method"], distill["lora"])
    heads = OutputHead(student, run.mesh, run.memory), OutputHead(teacher, run.mesh, run.memory)

    # --- data: the SFT split (teacher-forced), or completions sampled for the prompts split ---
    micro = run.micro_batch_size()
    multiple = length_multiple(run.memory["compile"] is not None, cfg["parallel"]["tp"])
    if sampled:
        prompts = prompt_batches(data_dir, micro, seed=cfg["seed"], rank=run.dp_rank, world_size=run.dp_size)
        train: Batches | SampledBatches = SampledBatches(prompts, distill["on_policy_every"] * accum,
                                                         distill["max_new_tokens"],
                                                         cfg["data"]["max_seq_len"], run.tokenizer)
    else:
        train = sft_batches(data_dir, micro, seed=cfg["seed"], rank=run.dp_rank, world_size=run.dp_size,
                            multiple=multiple)
    run.epoch_size(len((train.prompts if isinstance(train, SampledBatches) else train).dataset), distill["batch_size"])
    optimization = run.optimization(student)
    sampler: Transformer | None = None

    def evaluate() -> dict[str, float]:
        """Held-out divergence and cross-entropy: one pass over `sft_eval`, from its start each time."""
        held_out = sft_batches(data_dir, micro, seed=cfg["seed"], split="sft_eval", rank=run.dp_rank,
                               world_size=run.dp_size, shuffle=False, loop=False, multiple=multiple)
        means = held_out_means(student, held_out, lambda batch: distill_loss(student, heads[0], teacher, heads[1], batch, distill, 0.0)[1], ("kd/divergence", "kd/ce"),
                               run.mesh, run.device)
        return {"eval_divergence": means["kd/divergence"], "eval_ce": means["kd/ce"]}

    run.resume(student, optimization, train)
    before = run.measure_before(evaluate)

    train_step = distill_step(student, heads[0], teacher, heads[1], distill, ce_weight, optimization, run.mesh,
                              run.device, run.tokenizer.pad_id)
    record: dict[str, float] = {}
    for step in run.steps():
        generated = None
        if sampled and train.empty():
            # The frozen teacher's sampling copy is made once; the student's follows its weights.
            if on_policy or sampler is None:
                sampler = sampling_model(student if on_policy else teacher, run.mesh, sampler)
            generated = train.refill(sampler, seed=cfg["seed"] + step)
        record = train_step([to_device(next(train), run.device) for _ in range(accum)])
        useful = record.pop("useful_tokens")
        record.update(optimization.step(step, record["loss"]))
        if generated is not None:
            record["generated_tokens"] = generated
        run.log_step(record, postfix={"loss": ".4f", "divergence": ".4f"}, tokens=useful)

    # --- held-out divergence and greedy accuracy of teacher and student ---
    after = run.final_evaluation()
    held_out = eval_split_rows(data_dir, distill["eval_prompts"])
    prompts_eval, examples = held_out["prompt_ids"], held_out["examples"]
    if not prompts_eval:
        raise ValueError(f"{data_dir}: the eval split is empty")
    accuracy = {role: model_greedy_accuracy(sampling_model(model, run.mesh), prompts_eval, examples, run.tokenizer, verifier,
                                      distill["max_new_tokens"], run.mesh, run.device)
                for role, model in (("teacher", teacher), ("student", student))}
    run.log(run.final_step, {"teacher_accuracy": accuracy["teacher"], "student_accuracy": accuracy["student"]})
    summary = {
        "teacher_accuracy": accuracy["teacher"],
        "student_accuracy": accuracy["student"],
        "accuracy_ratio": accuracy["student"] / accuracy["teacher"] if accuracy["teacher"] else None,
        "eval_prompts": len(prompts_eval),
        "verifier": verifier,
        "eval_divergence_before": before["eval_divergence"],
        "eval_divergence_after": after["eval_divergence"],
        "eval_ce_after": after["eval_ce"],
        "train_loss_last": record["loss"],
        "teacher": str(teacher_dir),
        "teacher_params": parameter_count(teacher_config, teacher.backend),
        "student_params": parameter_count(hf_config, student.backend),
    }
    run.finish(student, hf_config, summary, base_model=cfg["model"]["student"])


if __name__ == "__main__":
    run_main(STAGE, main, extra_errors=(VocabularyMismatchError,))
