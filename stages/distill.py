"""distill: knowledge distillation of a trained teacher into a smaller student.

    python stages/distill.py --config RESOLVED.json --data DATA --teacher TEACHER_DIR --out DIR
    torchrun --nproc-per-node N stages/distill.py ...

Reads the config keys in `READS` (and its run settings: loggers, `distill.log_every`,
`distill.checkpoint_every`). The teacher is a model folder (the workflow passes the output of
`distill.teacher_stage`, GRPO's by default), loaded frozen, in eval mode, run without gradients,
and parallelized like the student (FSDP2 / TP) but given no optimizer. The student is
`model.student`: a preset (random init, its vocabulary sized to the teacher's output), or an HF
folder / hub id. Teacher, student and data must share one tokenizer and vocabulary; a mismatch
stops the stage naming both sides.

Loss (`posttrain.losses.kd_loss`): `(1 - ce_weight) * D + ce_weight * CE` with D the `distill.loss`
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
held-out divergence on `sft_eval` before and after training; all go to the `posttrain.json` summary.
Resume state, metrics and the HF output folder as in SFT.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer as HFTokenizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from posttrain.checkpoint import load_state_into, resolve_model_source
from posttrain.config import load_stage_config
from posttrain.data.chat import shifted_labels
from posttrain.data.loader import Batches, length_multiple, prompt_batches, sft_batches
from posttrain.data.packing import build_rows
from posttrain.evaluation import is_correct
from posttrain.generation import SamplingParams
from posttrain.generation.backend import NativeBackend
from posttrain.losses.ce import num_loss_tokens
from posttrain.losses.kd import kd_loss
from posttrain.models import Transformer, document_positions, is_preset
from posttrain.optim import OptimizerInBackward, clip_grad_norm_
from posttrain.parallel import (
    build_mesh,
    data_parallel_rank,
    destroy,
    init_distributed,
    mesh_size,
    uses_tensor_parallel,
)
from posttrain.rewards.verifiers import load_verifiers, score
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
from posttrain.training.stats import data_parallel_sum, non_pad_tokens
from posttrain.utils.metrics import MetricsLogger, first_value, peak_memory_mb, progress_bar, reset_peak_memory, truncate_after

STAGE = "distill"
READS = ("seed", "model.student", "model.dtype", "data.max_seq_len", "memory", "parallel", "reward.verifiers",
         "distill")
GENERATION_BATCH = 64  # prompts per generate() call
SAMPLING_TEMPERATURE = 1.0  # on-policy completions come from the student's own distribution


class VocabularyMismatchError(ValueError):
    """Teacher, student and data do not share one tokenizer and output vocabulary."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved config (JSON)")
    parser.add_argument("--out", required=True, help="output model folder (results/distill/<key>)")
    parser.add_argument("--data", required=True, help="prepared data folder (results/data/<key>)")
    parser.add_argument("--teacher", required=True, help="teacher model folder (the output of distill.teacher_stage)")
    return parser.parse_args()


# --- teacher and student: one vocabulary ---


def _vocab(folder: Path) -> dict[str, int] | None:
    """Token -> id of a folder's tokenizer (added tokens included); None when it has no tokenizer.json."""
    path = folder / "tokenizer.json"
    return HFTokenizer.from_file(str(path)).get_vocab(with_added_tokens=True) if path.is_file() else None


def _vocab_difference(a: dict[str, int], b: dict[str, int]) -> str | None:
    if a == b:
        return None
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} token ids"
    token = next(t for t in sorted(a) if b.get(t) != a[t])
    return f"both have {len(a)} ids, but token {token!r} is id {a[token]} vs {b.get(token)}"


def check_same_vocabulary(
    data_tokenizer: Tokenizer,
    teacher_dir: Path,
    teacher_config: Mapping[str, Any],
    student_source: str,
    student_config: Mapping[str, Any],
) -> None:
    """Refuse a teacher and student whose tokenizers or output vocabularies differ.

    The divergence compares the two models' distributions id by id, and both read the data's
    token ids: the teacher's and a folder student's tokenizers must equal the data tokenizer, and
    both output heads must have the same width.
    """
    data_vocab = _vocab(data_tokenizer.folder)
    sides = [("teacher", teacher_dir)]
    if not is_preset(student_source):
        sides.append(("student", resolve_model_source(student_source)))
    for role, folder in sides:
        vocab = _vocab(folder)
        difference = None if vocab is None or data_vocab is None else _vocab_difference(vocab, data_vocab)
        if difference:
            raise VocabularyMismatchError(
                f"the {role}'s tokenizer ({folder}) differs from the data tokenizer ({data_tokenizer.folder}): "
                f"{difference}. Teacher and student must share one tokenizer and vocabulary"
            )
    teacher_width, student_width = int(teacher_config["vocab_size"]), int(student_config["vocab_size"])
    if teacher_width != student_width:
        student_where = f"preset {student_source!r}" if is_preset(student_source) else str(resolve_model_source(student_source))
        raise VocabularyMismatchError(
            f"teacher {teacher_dir} has a vocabulary of {teacher_width} ids (config.json vocab_size), student "
            f"{student_where} has {student_width}: distillation compares their output distributions id by id, "
            "so teacher and student must share one tokenizer and vocabulary"
        )


def student_config(source: str, tokenizer: Tokenizer, teacher_config: Mapping[str, Any]) -> dict[str, Any]:
    """The student's HF config; a preset's output head gets the teacher's width (padded vocabularies included)."""
    config = model_config(source, tokenizer)
    if is_preset(source):
        config["vocab_size"] = int(teacher_config["vocab_size"])
    return config


def parameter_count(hf_config: Mapping[str, Any]) -> int:
    """Parameters of the full (unsharded) model, tied embeddings counted once."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(dict(hf_config)).parameters())


# --- the loss ---


def _plain(hidden: torch.Tensor) -> torch.Tensor:
    """Hidden states as one plain tensor (under TP they are a sequence-sharded DTensor)."""
    return hidden.full_tensor() if isinstance(hidden, DTensor) else hidden


def output_head(model: Transformer, mesh: DeviceMesh | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`model.lm_head` as a function of plain hidden rows.

    Under TP the head is sharded over the vocabulary: the rows enter replicated and each chunk's
    logits are gathered whole, so one chunk's full-vocabulary logits exist at a time, as without TP.
    """
    if not uses_tensor_parallel(mesh):
        return model.lm_head
    tp = mesh["tp"]
    return lambda rows: model.lm_head(DTensor.from_local(rows, tp, [Replicate()])).full_tensor()


def distill_loss(
    student: Transformer,
    teacher: Transformer,
    batch: Mapping[str, torch.Tensor],
    distill: Mapping[str, Any],
    memory: Mapping[str, Any],
    mesh: DeviceMesh | None,
    ce_weight: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KD loss summed over the batch's trained tokens, and its summed divergence / cross-entropy.

    `ce_weight` mixes in the cross-entropy against the batch's labels. The teacher's forward runs
    without gradients.
    """
    inputs = {"position_ids": batch["position_ids"], "document_ids": batch["document_ids"]}
    student_hidden = _plain(student(batch["input_ids"], **inputs))
    with torch.no_grad():
        teacher_hidden = _plain(teacher(batch["input_ids"], **inputs))
    chunked = bool(memory["chunked_ce"])
    return kd_loss(
        student_hidden,
        output_head(student, mesh),
        teacher_hidden,
        output_head(teacher, mesh),
        batch["labels"],
        kind=distill["loss"],
        beta=float(distill["jsd_beta"]),
        temperature=float(distill["temperature"]),
        ce_weight=ce_weight,
        num_chunks=int(memory["ce_chunks"]) if chunked else 1,
        checkpoint_chunks=None if chunked else False,
        reduction="sum",
    )


# --- generation: on-policy completions and held-out accuracy ---


def sampling_model(model: Transformer, mesh: DeviceMesh | None, copy: Transformer | None = None) -> Transformer:
    """A model the KV-cache sampler can drive on each rank alone, holding `model`'s current weights.

    One process: `model` itself. Under a mesh: an unsharded copy (`copy`, refreshed in place, or a
    new one), since each rank's decode loop runs a different number of steps and cannot follow
    FSDP's collectives. Collective under a mesh (every rank gathers the full weights).
    """
    if mesh is None:
        return model
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if copy is None:
        device = next(iter(state.values())).device
        with torch.device("meta"):
            copy = Transformer(model.hf_config)
        copy.to_empty(device=device)
        copy.tie_weights()
        copy.init_weights(buffers_only=True)
    load_state_into(copy, state, "distill: gathered weights")
    return copy.eval()


def completion_batch(prompts: list[list[int]], completions: list[list[int]], max_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row per prompt + completion (cut at `max_len`), trained on the completion tokens only."""
    docs_ids, docs_labels = [], []
    for prompt, completion in zip(prompts, completions):
        ids = (prompt + completion)[:max_len]
        trained = ([False] * len(prompt) + [True] * len(completion))[:max_len]
        docs_ids.append(ids)
        docs_labels.append(shifted_labels(ids, trained))
    rows = build_rows(docs_ids, docs_labels, [[i] for i in range(len(prompts))], max_len, pad_id)
    batch = {k: torch.from_numpy(v.astype(np.int64)) for k, v in rows.items()}
    batch["position_ids"] = document_positions(batch["document_ids"])
    return batch


class SampledBatches:
    """Micro-batches of completions sampled for the `prompts` split (by the student for GKD, by the
    teacher for `teacher_samples`), `steps_ahead` micro-batches at a time.

    `refill(sampler, seed)` samples the prompts of the next `steps_ahead` micro-batches in one
    generation call; `next()` hands them out in order. The state (prompt position and the pending
    completions) makes a resumed run continue exactly.
    """

    def __init__(self, prompts: Batches, steps_ahead: int, max_new_tokens: int, max_len: int, tokenizer: Tokenizer):
        self.prompts, self.steps_ahead, self.max_len = prompts, steps_ahead, max_len
        self.pad_id = tokenizer.pad_id
        self.params = SamplingParams(max_new_tokens=max_new_tokens, temperature=SAMPLING_TEMPERATURE,
                                     stop_token_ids=tokenizer.eos_ids)
        self.pending: list[tuple[list[list[int]], list[list[int]]]] = []  # (prompts, completions) per micro-batch

    def empty(self) -> bool:
        return not self.pending

    def refill(self, sampler: Transformer, seed: int) -> int:
        """Sample the next `steps_ahead` micro-batches' completions; returns the tokens generated."""
        groups = [next(self.prompts)["prompt_ids"] for _ in range(self.steps_ahead)]
        flat = [p for group in groups for p in group]
        out = NativeBackend(sampler, self.pad_id, max_batch_size=GENERATION_BATCH).generate(flat, self.params, seed)
        start = 0
        for group in groups:
            self.pending.append((group, out.tokens[start : start + len(group)]))
            start += len(group)
        return sum(len(t) for t in out.tokens)

    def __next__(self) -> dict[str, torch.Tensor]:
        prompts, completions = self.pending.pop(0)
        return completion_batch(prompts, completions, self.max_len, self.pad_id)

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts.state_dict(), "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.pending = [(list(p), list(c)) for p, c in state["pending"]]


def first_eval_rows(data_dir: str, n: int, seed: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Prompt ids and verifier rows of the first `n` rows of the `eval` split, in data order."""
    batch = next(prompt_batches(data_dir, n, seed=seed, split="eval", shuffle=False, loop=False), None)
    if batch is None:
        raise ValueError(f"{data_dir}: the eval split is empty")
    return batch["prompt_ids"], batch["examples"]


@torch.no_grad()
def greedy_accuracy(
    sampler: Transformer,
    prompts: list[list[int]],
    examples: list[dict[str, Any]],
    tokenizer: Tokenizer,
    verifier: str,
    max_new_tokens: int,
    mesh: DeviceMesh | None,
    device: torch.device,
) -> float:
    """Share of `prompts` whose greedy completion `verifier` accepts; the data-parallel ranks split the prompts."""
    dp_rank, dp_size = data_parallel_rank(mesh)
    mine = list(range(dp_rank, len(prompts), dp_size))
    correct = 0
    if mine:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tokenizer.eos_ids)
        out = NativeBackend(sampler, tokenizer.pad_id, max_batch_size=GENERATION_BATCH).generate(
            [prompts[i] for i in mine], params, seed=0
        )
        scores = score(tokenizer.decode_batch(out.tokens), [examples[i] for i in mine], load_verifiers([verifier]))
        correct = sum(is_correct(s, verifier) for s in scores)
    total_correct, total = data_parallel_sum([correct, len(mine)], mesh, device)
    return total_correct / max(total, 1)


@torch.no_grad()
def held_out_divergence(
    student: Transformer, teacher: Transformer, batches: Batches, distill: Mapping[str, Any],
    memory: Mapping[str, Any], mesh: DeviceMesh | None, device: torch.device,
) -> tuple[float, float]:
    """Mean divergence and student cross-entropy per trained token over a whole split (all ranks together)."""
    student.eval()
    divergence, ce, tokens = 0.0, 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        _, parts = distill_loss(student, teacher, batch, distill, memory, mesh, ce_weight=0.0)
        divergence += float(parts["kd/divergence"])
        ce += float(parts["kd/ce"])
        tokens += int(num_loss_tokens(batch["labels"]))
    student.train()
    divergence, ce, tokens = data_parallel_sum([divergence, ce, tokens], mesh, device)
    return divergence / max(tokens, 1), ce / max(tokens, 1)


def micro_batch_size(distill: Mapping[str, Any], dp_size: int) -> int:
    """Global rows per micro-batch; refuses sizes that do not split evenly."""
    batch, accum = int(distill["batch_size"]), int(distill["grad_accum"])
    if batch % (accum * dp_size):
        raise ValueError(
            f"distill.batch_size ({batch}) must be divisible by distill.grad_accum ({accum}) x data-parallel processes ({dp_size})"
        )
    return batch // accum


def to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def main() -> None:
    args = parse_args()
    started = time.time()
    cfg = load_stage_config(args.config, READS, __file__)
    distill, memory = cfg["distill"], cfg["memory"]
    steps, accum = int(distill["steps"]), int(distill["grad_accum"])
    on_policy = distill["data"] == "on_policy"
    sampled = on_policy or distill["data"] == "teacher_samples"
    # Cross-entropy needs reference labels: on the student's own samples it would only reinforce them.
    ce_weight = 0.0 if on_policy else float(distill["ce_weight"])
    verifier = cfg["reward"]["verifiers"][0]

    # --- setup: processes, teacher (frozen), student, optimizer, data, resume state, logging ---
    info = init_distributed()
    mesh = build_mesh(info, tp=cfg["parallel"]["tp"], dp_replicate=cfg["parallel"]["dp_replicate"])
    dp_rank, dp_size = data_parallel_rank(mesh)
    seed_everything(cfg["seed"])
    tokenizer = Tokenizer(Path(args.data) / "tokenizer")
    teacher_dir = resolve_model_source(args.teacher)
    teacher_config = model_config(str(teacher_dir), tokenizer)
    hf_config = student_config(cfg["model"]["student"], tokenizer, teacher_config)
    check_same_vocabulary(tokenizer, teacher_dir, teacher_config, cfg["model"]["student"], hf_config)
    teacher = build_model(str(teacher_dir), teacher_config, info, mesh, cfg).requires_grad_(False).eval()
    student = build_model(cfg["model"]["student"], hf_config, info, mesh, cfg)
    optimizer, scheduler = build_optimizer_and_scheduler(student, distill, memory)
    in_backward = isinstance(optimizer, OptimizerInBackward)
    clip = max_grad_norm(distill)

    micro = micro_batch_size(distill, dp_size)
    multiple = length_multiple(bool(memory["compile"]), cfg["parallel"]["tp"])
    if sampled:
        every = int(distill["on_policy_every"])
        prompts = prompt_batches(args.data, micro, seed=cfg["seed"], rank=dp_rank, world_size=dp_size)
        train: Batches | SampledBatches = SampledBatches(
            prompts, every * accum, int(distill["max_new_tokens"]), int(cfg["data"]["max_seq_len"]), tokenizer
        )
    else:
        train = sft_batches(args.data, micro, seed=cfg["seed"], rank=dp_rank, world_size=dp_size, multiple=multiple)
    sampler: Transformer | None = None

    def evaluate() -> tuple[float, float]:
        """Held-out divergence and cross-entropy: one pass over `sft_eval`, from its start each time."""
        held_out = sft_batches(args.data, micro, seed=cfg["seed"], split="sft_eval", rank=dp_rank,
                               world_size=dp_size, shuffle=False, loop=False, multiple=multiple)
        return held_out_divergence(student, teacher, held_out, distill, memory, mesh, info.device)

    checkpointer = Checkpointer(args.out, every=distill["checkpoint_every"], key=cfg["key"])
    resumed = checkpointer.load(student, optimizer, scheduler)
    start_step = 0
    if resumed is not None:
        train.load_state_dict(resumed.data_state)
        start_step = resumed.step
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
    guard = NonFiniteLossGuard(distill["skip_nonfinite"], "distill.skip_nonfinite", skip_possible=not in_backward)

    if resumed is None:
        divergence_before, _ = evaluate()
        metrics.log(0, {"eval_divergence": divergence_before})
    else:
        divergence_before = first_value(checkpointer.metrics_path, "eval_divergence") if info.is_main else float("nan")

    # --- training loop ---
    bar = progress_bar(steps, start_step, info.is_main, STAGE)
    last_loss = float("nan")
    with explain_out_of_memory(STAGE):
        for step in range(start_step + 1, steps + 1):
            t0 = time.perf_counter()
            reset_peak_memory(info.device)
            generated = None
            if sampled and train.empty():
                # The frozen teacher's sampling copy is made once; the student's follows its weights.
                if on_policy or sampler is None:
                    sampler = sampling_model(student if on_policy else teacher, mesh, sampler)
                generated = train.refill(sampler, seed=int(cfg["seed"]) + step)
            batches = [to_device(next(train), info.device) for _ in range(accum)]
            loss_tokens, useful_tokens = data_parallel_sum(
                [sum(num_loss_tokens(b["labels"]) for b in batches),
                 sum(non_pad_tokens(b["input_ids"], tokenizer.pad_id) for b in batches)],
                mesh, info.device,
            )
            # FSDP2 averages gradients over the data-parallel replicas: scale by their number so
            # the gradient is that of (sum of token losses) / (trained tokens of the whole step).
            scale = mesh_size(mesh, "dp_replicate") * mesh_size(mesh, "dp_shard") / max(loss_tokens, 1)
            step_loss, step_divergence, step_ce = 0.0, 0.0, 0.0
            for batch in batches:
                loss, parts = distill_loss(student, teacher, batch, distill, memory, mesh, ce_weight)
                (loss * scale).backward()
                step_loss += float(loss.detach())
                step_divergence += float(parts["kd/divergence"])
                step_ce += float(parts["kd/ce"])
            step_loss, step_divergence, step_ce = (
                v / max(loss_tokens, 1) for v in data_parallel_sum([step_loss, step_divergence, step_ce], mesh, info.device)
            )
            last_loss = step_loss

            lr = scheduler.get_last_lr()[0]
            grad_norm = None if in_backward else clip_grad_norm_(student.parameters(), clip)
            if guard.should_skip(step, last_loss, grad_norm, checkpointer.latest()):
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()

            seconds = time.perf_counter() - t0
            record = {"loss": last_loss, "divergence": step_divergence, "ce": step_ce, "lr": lr,
                      "loss_tokens": int(loss_tokens), "step_s": seconds, "tokens_per_s": useful_tokens / seconds,
                      "peak_memory_mb": peak_memory_mb(info.device)}
            if grad_norm is not None:
                record["grad_norm"] = grad_norm
            if generated is not None:
                record["generated_tokens"] = generated
            metrics.log(step, record)
            bar.update(1)
            bar.set_postfix(loss=f"{last_loss:.4f}", div=f"{step_divergence:.4f}", refresh=False)
            if info.is_main and step % distill["log_every"] == 0:
                bar.write(f"step {step}/{steps} " + json.dumps({k: round(v, 6) for k, v in record.items()}))

            saved = checkpointer.save(step, student, optimizer, scheduler, train.state_dict()) if checkpointer.due(step, steps) else None
            if step < steps and stop.requested():
                saved = saved or checkpointer.save(step, student, optimizer, scheduler, train.state_dict())
                bar.close()
                metrics.close()
                stop.exit(step, saved)
            kill_if_requested(step)
    bar.close()

    # --- held-out divergence and greedy accuracy of teacher and student, final HF folder ---
    divergence_after, ce_after = evaluate()
    prompts_eval, examples = first_eval_rows(args.data, int(distill["eval_prompts"]), cfg["seed"])
    accuracy = {}
    for role, model in (("teacher", teacher), ("student", student)):
        accuracy[role] = greedy_accuracy(sampling_model(model, mesh), prompts_eval, examples, tokenizer, verifier,
                                         int(distill["max_new_tokens"]), mesh, info.device)
    metrics.log(steps, {"eval_divergence": divergence_after, "eval_ce": ce_after,
                        "teacher_accuracy": accuracy["teacher"], "student_accuracy": accuracy["student"]})
    metrics.close()
    summary = {
        "teacher_accuracy": accuracy["teacher"],
        "student_accuracy": accuracy["student"],
        "accuracy_ratio": accuracy["student"] / accuracy["teacher"] if accuracy["teacher"] else None,
        "eval_prompts": len(prompts_eval),
        "verifier": verifier,
        "eval_divergence_before": divergence_before,
        "eval_divergence_after": divergence_after,
        "eval_ce_after": ce_after,
        "train_loss_last": last_loss,
        "steps": steps,
        "teacher": str(teacher_dir),
        "teacher_params": parameter_count(teacher_config),
        "student_params": parameter_count(hf_config),
    }
    save_final_model(
        args.out, student, hf_config=hf_config, tokenizer=tokenizer, cfg=cfg, started=started, summary=summary,
        metrics_path=checkpointer.metrics_path, is_main=info.is_main, base_model=cfg["model"]["student"],
    )
    checkpointer.remove()
    stop.restore()
    if info.is_main:
        print(json.dumps({"out": args.out, **summary}), flush=True)
    destroy()


if __name__ == "__main__":
    with exit_on_known_errors(STAGE, extra=(VocabularyMismatchError,)):
        main()
