"""grpo: reinforcement learning from verifiable rewards (GRPO) on the DPO policy, sync or async (Ray).

    python stages/grpo.py --config RESOLVED.json --data DATA --model DPO_MODEL --reward REWARD_DIR --out DIR
    torchrun --nproc-per-node N stages/grpo.py ...

Reads the config keys in `READS` (and its run settings: loggers, `grpo.log_every`,
`grpo.checkpoint_every`, `grpo.resources.cpus` for the Ray generators). Prompts:
`REWARD_DIR/grpo_prompts.parquet` (the reward stage's prompts whose pass rate lies inside its
band, so every group can carry signal); without `--reward`, the data's `prompts` split.

Each step:
1. Rollouts: `grpo.prompts_per_step` prompts (all processes together), `grpo.group_size`
   completions each at `grpo.temperature`, up to `grpo.max_new_tokens` tokens or the end-of-turn
   token, from the `grpo.backend` (native KV-cache sampler or vLLM), scored by `reward.verifiers`
   (their sum; the first decides correctness) plus `grpo.rm_weight` x the reward stage's reward
   model. `sync`: generated now with the current weights, every process its share of prompts.
   `async`: taken from the bounded-staleness buffer that `grpo.generators` Ray actors fill while
   the previous step trains, at most `grpo.max_staleness` policy versions old
   (`posttrain.rl.ray_collect`).
2. Group-relative advantages (`grpo.std_normalize`).
3. `grpo.inner_epochs` passes over the rollouts, `grpo.micro_batch_size` completions per forward,
   one optimizer step per pass, PPO-clipped at `grpo.clip_eps`, token-level (DAPO) or
   per-sequence normalization (`grpo.token_level`), optional k3 KL to the frozen starting model
   (`grpo.kl_coef` > 0; the reference is built and sharded like the policy).
   Old log-probs: the PPO ratio is taken against the trainer's own log-probs at the weights that
   start the step, which the first pass computes anyway (the ratio is exactly 1 there), so no
   extra forward is spent. The generator's log-probs enter only the truncated importance weight
   min(exp(old - generator), `grpo.tis_cap`), which corrects for what the trainer's policy and
   the sampling policy disagree on: a stale version in async mode, a different engine (vLLM).
4. The new weights go to the generators as policy version step (the version a batch was sampled
   with is logged next to the trainer's: `policy_version`, `generator_version`, `staleness`).

Greedy accuracy on the first `grpo.eval_prompts` rows of the `eval` split is measured before and
after training (`posttrain.json` summary: `eval_accuracy_before`, `eval_accuracy_after`). Resume
state lives in `<out>.resume/` (every `grpo.checkpoint_every` steps and on SIGTERM) and holds the
policy version and the prompt feed position; rerunning the same command continues from it (an
async run regenerates the batches it had in flight). The output is an HF model folder with
`metrics.jsonl` and `posttrain.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from posttrain.config import load_stage_config
from posttrain.data.loader import Batches, prompt_batches, prompt_collate
from posttrain.data.store import Split
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.grpo import grpo_loss
from posttrain.losses.logprobs import token_logprobs_and_entropy
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
from posttrain.rl.batch import MicroBatch, advantages, micro_batches
from posttrain.rl.collect import PromptFeed, SyncCollector
from posttrain.rl.ray_collect import RayCollector, split_groups, start_ray
from posttrain.rl.rollout import PromptBatch, RolloutWorker, WorkerSpec, build_worker, greedy_accuracy, rollout_stats
from posttrain.rl.weights import policy_weights
from posttrain.tokenizer import Tokenizer
from posttrain.training.export import save_final_model
from posttrain.training.faults import NonFiniteLossGuard, exit_on_known_errors, explain_out_of_memory, kill_if_requested
from posttrain.training.resume import Checkpointer, StopOnSignal
from posttrain.training.setup import build_model, build_optimizer_and_scheduler, max_grad_norm, model_config, seed_everything
from posttrain.training.stats import data_parallel_sum, local_value
from posttrain.utils.metrics import MetricsLogger, progress_bar, truncate_after

STAGE = "grpo"
READS = ("seed", "model.dtype", "data.max_seq_len", "memory", "parallel", "reward.verifiers", "reward.reward_model",
         "grpo")
GENERATION_BATCH = 256  # sequences per native generate() call
PROMPT_COLUMNS = ("prompt_ids", "answer", "task", "example")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved config (JSON)")
    parser.add_argument("--out", required=True, help="output model folder (results/grpo/<key>)")
    parser.add_argument("--data", required=True, help="prepared data folder (results/data/<key>)")
    parser.add_argument("--model", required=True, help="starting policy, an HF folder (the dpo stage's output)")
    parser.add_argument("--reward", help="reward stage output (grpo_prompts.parquet, rm/); default: the data's prompts split")
    return parser.parse_args()


def prompt_loader(args: argparse.Namespace, batch_size: int, seed: int, rank: int, world_size: int) -> Batches:
    """Training prompts: the reward stage's filtered set, or the data's `prompts` split without --reward."""
    if args.reward is None:
        return prompt_batches(args.data, batch_size, seed=seed, rank=rank, world_size=world_size)
    path = Path(args.reward) / "grpo_prompts.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the reward stage writes the GRPO prompt set there")
    missing = [c for c in PROMPT_COLUMNS if c not in pq.read_schema(path).names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {', '.join(missing)} (expected {', '.join(PROMPT_COLUMNS)})")
    dataset = Split(pq.read_table(path, columns=list(PROMPT_COLUMNS)))
    if len(dataset) < batch_size:
        raise ValueError(f"{path}: {len(dataset)} prompts, fewer than grpo.prompts_per_step ({batch_size})")
    return Batches(dataset, batch_size, prompt_collate, seed=seed, rank=rank, world_size=world_size)


def eval_prompts(data_dir: str, n: int, rank: int, world_size: int) -> PromptBatch:
    """This data-parallel rank's share of the first `n` rows of the `eval` split."""
    batch = next(prompt_batches(data_dir, n, seed=0, split="eval", shuffle=False, loop=False))
    prompts = PromptBatch.from_loader(batch)
    return PromptBatch(prompts.prompt_ids[rank::world_size], prompts.examples[rank::world_size], prompts.index[rank::world_size])


def held_out_accuracy(worker: RolloutWorker, prompts: PromptBatch, mesh: DeviceMesh | None, device: torch.device) -> float:
    correct, _ = greedy_accuracy(worker, prompts)
    correct, total = data_parallel_sum([correct, len(prompts)], mesh, device)
    return correct / max(total, 1)


def broadcast_from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank (async mode: the step's rollouts come to rank 0 only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(value: float, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def policy_logprobs(model: Transformer, batch: MicroBatch, mesh: DeviceMesh | None, memory: dict[str, Any],
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs and entropies [b, L] of the completions under logits / temperature, as sampled.

    Chunked (no [b, L, V] logits) by default; whole logits under tensor parallelism (vocabulary-
    sharded, inside `loss_context`) or with memory.chunked_ce off.
    """
    hidden = model(batch.input_ids)
    if not uses_tensor_parallel(mesh) and memory["chunked_ce"]:
        return token_logprobs_and_entropy(hidden, model.lm_head, batch.targets, num_chunks=memory["ce_chunks"],
                                          temperature=temperature)
    logits = model.lm_head(hidden).float() / temperature
    logp = -F.cross_entropy(logits.flatten(0, -2), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    mask = batch.mask
    return local_value(logp).view(mask.shape), local_value(entropy) * mask


def main() -> None:
    args = parse_args()
    started = time.time()
    cfg = load_stage_config(args.config, READS, __file__)
    grpo, memory = cfg["grpo"], cfg["memory"]
    steps, k, temperature = int(grpo["steps"]), int(grpo["group_size"]), float(grpo["temperature"])
    is_async = grpo["mode"] == "async"

    # --- setup: processes, policy (+ frozen reference), optimizer, generators, prompts, resume state ---
    info = init_distributed()
    mesh = build_mesh(info, tp=cfg["parallel"]["tp"], dp_replicate=cfg["parallel"]["dp_replicate"])
    dp_rank, dp_size = data_parallel_rank(mesh)
    if grpo["prompts_per_step"] % dp_size:
        raise ValueError(f"grpo.prompts_per_step ({grpo['prompts_per_step']}) must be divisible by the "
                         f"data-parallel processes ({dp_size})")
    rows_per_rank = grpo["prompts_per_step"] // dp_size * k
    micro = int(grpo["micro_batch_size"])
    if memory["optimizer_in_backward"] and micro < rows_per_rank:
        raise ValueError(f"memory.optimizer_in_backward steps during backward, so a step must be one micro-batch: "
                         f"set grpo.micro_batch_size >= {rows_per_rank} (prompts per process x group_size)")
    seed_everything(cfg["seed"])
    tokenizer = Tokenizer(Path(args.data) / "tokenizer")
    hf_config = model_config(args.model, tokenizer)
    model = build_model(args.model, hf_config, info, mesh, cfg)
    reference = None
    if grpo["kl_coef"] > 0:
        reference = build_model(args.model, hf_config, info, mesh, cfg).requires_grad_(False).eval()
    optimizer, scheduler = build_optimizer_and_scheduler(model, grpo, memory)
    in_backward = isinstance(optimizer, OptimizerInBackward)
    clip = max_grad_norm(grpo)

    reward_model = Path(args.reward) / "rm" if args.reward and cfg["reward"]["reward_model"] else None
    spec = WorkerSpec(
        backend=grpo["backend"], model_dir=args.model, tokenizer_dir=str(Path(args.data) / "tokenizer"), group_size=k,
        temperature=temperature, max_new_tokens=int(grpo["max_new_tokens"]), verifiers=tuple(cfg["reward"]["verifiers"]),
        reward_model_dir=str(reward_model) if reward_model else None, rm_weight=float(grpo["rm_weight"]),
        max_batch_size=GENERATION_BATCH, max_model_len=int(cfg["data"]["max_seq_len"]) + int(grpo["max_new_tokens"]),
        seed=int(cfg["seed"]), device=str(info.device),
    )
    # Sync: every rank samples its own prompts with its own generator. Async: rank 0 drives the
    # Ray generators over the whole step batch and hands each rank its share.
    collector: SyncCollector | RayCollector | None = None
    feed: PromptFeed | None = None
    if not is_async:
        feed = PromptFeed(prompt_loader(args, grpo["prompts_per_step"], cfg["seed"], dp_rank, dp_size), cfg["seed"], dp_rank)
        worker = build_worker(spec)
        collector = SyncCollector(worker, feed)
        eval_worker = worker
    else:
        if info.is_main:
            feed = PromptFeed(prompt_loader(args, grpo["prompts_per_step"], cfg["seed"], 0, 1), cfg["seed"])
            threads = int(grpo["generator_threads"])
            ray = start_ray(grpo["ray_address"], num_cpus=max(int(grpo["resources"]["cpus"]), grpo["generators"] * threads))
            actor_spec = dataclasses.replace(spec, device="cuda" if grpo["generator_gpus"] else "cpu")
            collector = RayCollector(ray, actor_spec, feed, num_generators=int(grpo["generators"]),
                                     max_staleness=int(grpo["max_staleness"]), threads_per_generator=threads,
                                     gpus_per_generator=float(grpo["generator_gpus"]))
        eval_worker = build_worker(dataclasses.replace(spec, backend="native"))
    held_out = eval_prompts(args.data, int(grpo["eval_prompts"]), dp_rank, dp_size)

    checkpointer = Checkpointer(args.out, every=grpo["checkpoint_every"], key=cfg["key"])
    resumed = checkpointer.load(model, optimizer, scheduler)
    start_step, version = 0, 0
    if resumed is not None:
        start_step, version = resumed.step, int(resumed.data_state["policy_version"])
        if feed is not None:
            feed.load_state_dict(resumed.data_state["feed"])
        weights = policy_weights(model, every_rank=not is_async)
        if collector is not None:
            (collector.worker if isinstance(collector, SyncCollector) else collector).start_at(weights, version)
        if info.is_main:
            truncate_after(checkpointer.metrics_path, start_step)
            print(f"resuming from {resumed.path} at step {start_step} (policy version {version})", flush=True)
    metrics = MetricsLogger(checkpointer.metrics_path, enabled=info.is_main, loggers=cfg["loggers"],
                            run_name=f"{STAGE}-{cfg['key']}", config=cfg)
    stop = StopOnSignal()
    guard = NonFiniteLossGuard(grpo["skip_nonfinite"], "grpo.skip_nonfinite", skip_possible=not in_backward)

    if resumed is None:
        eval_before = held_out_accuracy(eval_worker, held_out, mesh, info.device)
        metrics.log(0, {"eval_accuracy": eval_before, "policy_version": 0})
    else:
        eval_before = float(resumed.data_state["eval_accuracy_before"])

    # --- training loop ---
    generator_start_s = collector.wait_ready() if isinstance(collector, RayCollector) else 0.0  # overlaps the eval above
    bar = progress_bar(steps, start_step, info.is_main, STAGE)
    dp_scale = mesh_size(mesh, "dp_replicate") * mesh_size(mesh, "dp_shard")  # FSDP2 averages over replicas
    history: list[dict[str, float]] = []
    try:
        with explain_out_of_memory(STAGE):
            for step in range(start_step + 1, steps + 1):
                t0 = time.perf_counter()

                # 1. rollouts sampled by policy version `rollouts.version` <= `version`
                if is_async:
                    rollouts, wait_s = broadcast_from_main(collector.next(version) if info.is_main else None)
                    stats = rollout_stats(rollouts.payload)
                    groups = split_groups(rollouts.payload, dp_rank, dp_size)
                else:
                    rollouts, wait_s = collector.next(version)
                    groups = rollouts.payload
                    stats = rollout_stats(groups)
                    stats = dict(zip(stats, (v / dp_size for v in data_parallel_sum(list(stats.values()), mesh, info.device))))

                # 2. advantages and micro-batches; the loss divides by the whole step's count
                t_train = time.perf_counter()
                batches = micro_batches(groups, advantages(groups, grpo["std_normalize"]), micro, tokenizer.pad_id,
                                        length_multiple=mesh_size(mesh, "tp"))
                step_tokens, step_rows = data_parallel_sum(
                    [sum(int(b.mask.sum()) for b in batches), sum(len(b.advantages) for b in batches)], mesh, info.device)
                denominator = step_tokens if grpo["token_level"] else step_rows

                # 3. inner epochs: one optimizer step per pass over the rollouts
                old: list[torch.Tensor] = []
                ref: list[torch.Tensor | None] = []
                sums = dict.fromkeys(("loss", "entropy", "clip_frac", "kl", "generator_kl", "tis_weight"), 0.0)
                grad_norm = None
                skipped = False
                gap_max = 0.0  # largest |trainer - generator| token log-prob at the step's starting weights
                for epoch in range(int(grpo["inner_epochs"])):
                    for i, batch in enumerate(batches):
                        batch = batch.to(info.device)
                        tokens = float(batch.mask.sum())
                        with loss_context(mesh):
                            logp, entropy = policy_logprobs(model, batch, mesh, memory, temperature)
                            if epoch == 0:
                                old.append(logp.detach())
                                with torch.no_grad():
                                    ref.append(None if reference is None else
                                               policy_logprobs(reference, batch, mesh, memory, temperature)[0])
                            loss, m = grpo_loss(
                                logp, old[i], batch.advantages, batch.mask, clip_eps=float(grpo["clip_eps"]),
                                token_level=bool(grpo["token_level"]), denominator=denominator, ref_logprobs=ref[i],
                                kl_coef=float(grpo["kl_coef"]), generator_logprobs=batch.generator_logprobs,
                                tis_cap=float(grpo["tis_cap"]),
                            )
                            (loss * dp_scale).backward()
                        sums["loss"] += float(local_value(loss.detach()))
                        sums["clip_frac"] += float(m["clip_frac"]) * tokens
                        sums["tis_weight"] += float(m["tis/weight_mean"]) * tokens
                        if "kl" in m:
                            sums["kl"] += float(m["kl"]) * tokens
                        if epoch == 0:
                            sums["entropy"] += float((entropy.detach() * batch.mask).sum())
                            log_gap = (batch.generator_logprobs - logp.detach()) * batch.mask
                            sums["generator_kl"] += float((log_gap.exp() - log_gap - 1).sum())
                            gap_max = max(gap_max, float(log_gap.abs().max()))
                    grad_norm = None if in_backward else clip_grad_norm_(model.parameters(), clip)
                    (step_loss,) = data_parallel_sum([sums["loss"]], mesh, info.device)
                    if guard.should_skip(step, step_loss, grad_norm, checkpointer.latest()):
                        skipped = True
                    else:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                version += 1

                # 4. the new weights to the generators, as policy `version`
                if not is_async:
                    collector.push_weights(policy_weights(model, every_rank=True), version)
                else:
                    weights = policy_weights(model, every_rank=False)
                    if info.is_main:
                        collector.push_weights(weights, version)
                train_s = time.perf_counter() - t_train

                passes = int(grpo["inner_epochs"])
                totals = data_parallel_sum([sums["loss"], sums["entropy"], sums["clip_frac"], sums["kl"],
                                            sums["generator_kl"], sums["tis_weight"]], mesh, info.device)
                loss_sum, entropy_sum, clip_sum, kl_sum, gen_kl_sum, tis_sum = totals
                seconds = time.perf_counter() - t0
                record = {
                    "loss": loss_sum / passes, **stats,
                    "entropy": entropy_sum / max(step_tokens, 1),
                    "clip_frac": clip_sum / max(step_tokens * passes, 1),
                    "generator_kl": gen_kl_sum / max(step_tokens, 1),
                    "logprob_gap_max": max_over_ranks(gap_max, info.device),
                    "tis_weight_mean": tis_sum / max(step_tokens * passes, 1),
                    "lr": lr,
                    "policy_version": version - 1, "generator_version": rollouts.version,
                    "staleness": version - 1 - rollouts.version, "ticket": rollouts.ticket,
                    "samples": int(step_rows), "samples_per_s": step_rows / seconds,
                    "trainer_idle_frac": wait_s / seconds, "generate_s": rollouts.generate_s, "train_s": train_s,
                    "step_s": seconds,
                }
                if reference is not None:
                    record["kl"] = kl_sum / max(step_tokens * passes, 1)
                if grad_norm is not None:
                    record["grad_norm"] = grad_norm
                if skipped:
                    record["skipped"] = 1
                if is_async and info.is_main:
                    record["dropped_batches"] = len(collector.buffer.dropped)
                history.append(record)
                metrics.log(step, record)
                bar.update(1)
                bar.set_postfix(reward=f"{stats['reward_mean']:.3f}", pass_rate=f"{stats['pass_rate']:.3f}", refresh=False)
                if info.is_main and step % grpo["log_every"] == 0:
                    bar.write(f"step {step}/{steps} " + json.dumps({k_: round(v, 5) if isinstance(v, float) else v
                                                                    for k_, v in record.items()}))

                data_state = {"policy_version": version, "eval_accuracy_before": eval_before,
                              "feed": feed.state_after(rollouts.ticket) if feed is not None else None}
                saved = checkpointer.save(step, model, optimizer, scheduler, data_state) if checkpointer.due(step, steps) else None
                if step < steps and stop.requested():
                    saved = saved or checkpointer.save(step, model, optimizer, scheduler, data_state)
                    bar.close()
                    metrics.close()
                    stop.exit(step, saved)
                kill_if_requested(step)
    finally:
        if isinstance(collector, RayCollector):
            collector.close()
            collector.ray.shutdown()  # stops a local cluster; disconnects from one joined by address
    bar.close()

    # --- held-out accuracy after training, final HF folder, resume state removed ---
    if is_async:
        eval_worker.start_at(policy_weights(model, every_rank=True), version)
    eval_after = held_out_accuracy(eval_worker, held_out, mesh, info.device)
    metrics.log(steps, {"eval_accuracy": eval_after, "policy_version": version})
    metrics.close()
    summary = {
        "eval_accuracy_before": eval_before, "eval_accuracy_after": eval_after,
        "eval_prompts": int(grpo["eval_prompts"]), "steps": steps, "mode": grpo["mode"], "backend": grpo["backend"],
        "policy_version": version,
    }
    if is_async:
        summary["generator_start_s"] = generator_start_s
    if history:
        summary.update(
            reward_mean_first=history[0]["reward_mean"], reward_mean_last=history[-1]["reward_mean"],
            max_staleness_seen=max(r["staleness"] for r in history),
            samples_per_s=sum(r["samples"] for r in history) / sum(r["step_s"] for r in history),
            trainer_idle_frac=sum(r["trainer_idle_frac"] * r["step_s"] for r in history) / sum(r["step_s"] for r in history),
        )
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
