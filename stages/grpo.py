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
   (their weighted sum, batched functions once per batch; the first decides correctness) plus
   `grpo.rm_weight` x the reward model's score, standardized within each prompt's group with
   `reward_model.normalize: group` (the reward_model stage's folder, or a pretrained one named by
   `reward_model.source`). Each function's mean value is logged as `reward/<name>` (and the reward
   model's as `reward/rm`, `reward/rm_norm`). `sync`: generated now with the current weights, every
   process its share of prompts.
   `async`: taken from the bounded-staleness buffer that `grpo.generators` Ray actors fill while
   the previous step trains, at most `grpo.max_staleness` policy versions old
   (`posttrain.rl.ray_collector`).
2. Advantages by `grpo.advantage`: group-relative (GRPO, Dr. GRPO, RLOO, REINFORCE++), or PPO's
   (`gae`): a critic (`posttrain.rl.critic`, started from the policy or the reward model, its own
   AdamW at `grpo.critic_lr`) values every completion token, GAE (`grpo.gamma`, `grpo.gae_lambda`)
   spreads the completion's reward over its tokens, whitened over the step (`grpo.std_normalize`),
   and each pass also takes one step on the clipped value loss (`grpo.value_clip`). The critic is
   checkpointed and resumed with the policy; under data parallelism it is sharded like the policy
   (PPO refuses tp, cp and ep).
3. `grpo.inner_epochs` passes over the rollouts, `grpo.micro_batch_size` completions per forward,
   one optimizer step per pass, PPO-clipped at `grpo.clip_eps`, token-level (DAPO) or
   per-sequence normalization (`grpo.token_level`), optional k3 KL to the frozen starting model
   (`grpo.kl_coef` > 0; the reference is built and sharded like the policy, or, with `grpo.method` lora or
   qlora, is the policy with its adapters disabled: no second copy). The policy trains in full, or with
   LoRA/QLoRA adapters (`grpo.lora`; the generators get the merged weights); PPO's critic trains in full.
   Old log-probs: the PPO ratio is taken against the trainer's own log-probs at the weights that
   start the step, which the first pass computes anyway (the ratio is exactly 1 there), so no
   extra forward is spent. The generator's log-probs enter only the truncated importance weight
   min(exp(old - generator), `grpo.tis_cap`), which corrects for what the trainer's policy and
   the sampling policy disagree on: a stale version in async mode, a different engine (vLLM).
4. The new weights go to the generators as policy version step (the version a batch was sampled
   with is logged next to the trainer's: `policy_version`, `generator_version`, `staleness`).

Greedy accuracy on the first `grpo.eval_prompts` rows of the `eval` split is measured before and
after training (`posttrain.json` summary: `eval_accuracy_before`, `eval_accuracy_after`), and every
`grpo.eval_every` steps (`keep: best`, early stopping: `posttrain.training.selection`). Resume
state lives in `<out>.resume/` (every `grpo.checkpoint_every` steps and on SIGTERM) and holds the
policy version and the prompt feed position; rerunning the same command continues from it and
ends with the uninterrupted run's weights and per-step metrics, bitwise. An async run's checkpoint
also holds the work its generators had in flight: each ticket (prompt batch) dispatched and not
yet trained on, with the policy version sampling it, and the weights of those versions (at most
`grpo.max_staleness` of them, in `generator-weights/`). The resumed run dispatches those tickets
again first, each with its own version's weights (its prompts and sampling seed follow from the
ticket alone), so it trains on exactly the batches the uninterrupted run sampled
(`tests/rl/test_async_resume.py`). The output is an HF model folder with `metrics.jsonl` and
`posttrain.json`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from posttrain.losses.head import OutputHead
from posttrain.rewards.specs import pretrained_source
from posttrain.rewards.verifiers import VerifierError
from posttrain.rl.collection import build_collection
from posttrain.rl.critic import build_critic
from posttrain.rl.prompts import eval_prompts, prompt_count, training_prompts
from posttrain.rl.rollout import EpisodeSettings, WorkerSpec
from posttrain.rl.step import CriticBaseline, GRPOStep, GroupBaseline
from posttrain.rl.weights import WeightSyncError, check_logprob_gap
from posttrain.rules import ppo_problems, prompt_split_problem
from posttrain.training.faults import SettingError, run_main
from posttrain.training.harness import StageRun
from posttrain.training.setup import backend_of, model_config

STAGE = "grpo"
READS = ("seed", "model.policy", "model.dtype", "model.backend", "data.max_seq_len", "memory", "parallel",
         "reward.verifiers", "environment",
         "reward_model.source", "reward_model.normalize", "grpo")
INPUTS = {
    "data": "prepared data folder (results/data/<key>)",
    "model": "starting policy: the output of the stage before grpo in `pipeline` (absent: model.policy)",
    "reward": "reward stage output (grpo_prompts.parquet); default: the data's prompts split",
    "reward_model": "the reward_model stage's output (grpo.rm_weight, grpo.critic_init), when reward_model.source is "
                    "train; a pretrained reward_model.source is read from the config",
}
GENERATION_BATCH = 256  # sequences per native generate() call


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model", "reward", "reward_model"))
    cfg, grpo, args = run.cfg, run.section, run.args
    start = run.start_model()
    ppo = grpo["advantage"] == "gae"
    # The dry run's rules (posttrain.rules), for the processes this run was started as.
    split = prompt_split_problem(grpo["prompts_per_step"], run.dp_size)
    problems = ([("grpo.prompts_per_step", split)] if split else []) + (ppo_problems(cfg["parallel"], grpo["ratio"]) if ppo else [])
    if problems:
        raise SettingError("; ".join(f"{key}: {why}" for key, why in problems))
    rows_per_rank = grpo["prompts_per_step"] // run.dp_size * grpo["group_size"]
    hf_config = model_config(start, run.tokenizer)
    if ppo and backend_of(start, hf_config, cfg["model"]["backend"]) == "transformers":
        raise SettingError(f"grpo.advantage: gae needs a critic, a value model on the native code only; {start} runs on "
                           "the transformers backend (model.backend), so use grpo, rloo or reinforce_pp")
    model = run.build_model(start, hf_config, grpo["method"], grpo["lora"])
    run.epoch_size(prompt_count(args.data, args.reward), grpo["prompts_per_step"])
    optimization = run.optimization(model)
    optimization.one_micro_batch(rows_per_rank, grpo["micro_batch_size"])
    head = OutputHead(model, run.mesh, run.memory)
    # The KL reference: a frozen copy (full), or the policy itself, run with its adapters disabled (LoRA/QLoRA).
    reference, ref_head = None, None
    if grpo["kl_coef"] > 0 and grpo["method"] == "full":
        reference = run.frozen_model(start, hf_config)
        ref_head = OutputHead(reference, run.mesh, run.memory)
    elif grpo["kl_coef"] > 0:
        reference, ref_head = model, head

    # --- rollouts: generators (in this process, or Ray actors) fed by the reward stage's prompts ---
    episodes = EpisodeSettings.from_config(cfg["environment"], os.getcwd())
    # vLLM's context: a prompt and its completion; an episode's first prompt (the environment's messages, its
    # tools' system text) is not bounded by the data's max_seq_len, so episodes get the model's own context.
    max_model_len = None if episodes else cfg["data"]["max_seq_len"] + grpo["max_new_tokens"]
    spec = WorkerSpec(
        backend=grpo["backend"], model_dir=start, model_backend=cfg["model"]["backend"], tokenizer_dir=f"{args.data}/tokenizer", group_size=grpo["group_size"],
        temperature=grpo["temperature"], max_new_tokens=grpo["max_new_tokens"],
        verifiers=tuple(cfg["reward"]["verifiers"]), reward_model_dir=args.reward_model, rm_weight=grpo["rm_weight"],
        pretrained_reward_model=pretrained_source(cfg["reward_model"]["source"]),
        rm_normalize=cfg["reward_model"]["normalize"], workdir=os.getcwd(),
        max_batch_size=GENERATION_BATCH, max_model_len=max_model_len,
        seed=cfg["seed"], device=str(run.device), episodes=episodes,
    )
    collection = build_collection(
        model, spec, lambda rank, size: training_prompts(args.data, args.reward, grpo["prompts_per_step"], cfg["seed"], rank, size),
        grpo, cfg["seed"], run.mesh, run.device, run.dp_rank, run.dp_size, run.is_main,
    )
    held_out = eval_prompts(args.data, grpo["eval_prompts"], run.dp_rank, run.dp_size)

    critic = build_critic(grpo, start, args.reward_model, cfg["seed"], run.device, run.mesh) if ppo else None
    baseline = CriticBaseline(critic, grpo, run.mesh, run.device) if ppo else GroupBaseline(grpo, run.mesh, run.device)
    train_step = GRPOStep(grpo, model, head, optimization, baseline, reference, ref_head, run.tokenizer.pad_id,
                          run.mesh, run.device)
    run.resume(model, optimization, collection, extra={"critic": (critic.model, critic.optimizer)} if critic else None)
    history: list[dict[str, Any]] = []
    with collection:
        before = run.measure_before(lambda: {"eval_accuracy": collection.held_out_accuracy(held_out)})
        collection.ready()  # after the evaluation above, which overlaps the generators' start
        for step in run.steps():
            rollouts = collection.next()  # sampled by policy version rollouts.version <= collection.version
            t_train = time.perf_counter()
            record = train_step(rollouts, step)
            collection.push_weights()  # the new weights to the generators, as the next policy version
            seconds = run.seconds()
            record.update(
                policy_version=collection.version - 1, generator_version=rollouts.version,
                staleness=collection.version - 1 - rollouts.version, ticket=rollouts.ticket,
                samples_per_s=record["samples"] / seconds, trainer_idle_frac=rollouts.wait_s / seconds,
                generate_s=rollouts.generate_s, train_s=time.perf_counter() - t_train, step_s=seconds,
                **collection.step_metrics(),
            )
            check_logprob_gap(record["logprob_gap_mean"], record["staleness"], grpo["max_logprob_gap"], rollouts.version)
            history.append(record)
            run.log_step(record, postfix={"reward_mean": ".3f", "pass_rate": ".3f"})
        collected = collection.summary()
    after = run.final_evaluation()  # the generators stopped
    summary = {
        "eval_accuracy_before": before["eval_accuracy"], "eval_accuracy_after": after["eval_accuracy"],
        "eval_prompts": grpo["eval_prompts"], "mode": grpo["mode"],
        "backend": grpo["backend"], "policy_version": collection.version,
    }
    summary.update(collected)
    if history:
        step_s = sum(r["step_s"] for r in history)
        summary.update(
            reward_mean_first=history[0]["reward_mean"], reward_mean_last=history[-1]["reward_mean"],
            max_staleness_seen=max(r["staleness"] for r in history),
            samples_per_s=sum(r["samples"] for r in history) / step_s,
            trainer_idle_frac=sum(r["trainer_idle_frac"] * r["step_s"] for r in history) / step_s,
        )
    run.finish(model, hf_config, summary, base_model=start)


if __name__ == "__main__":
    run_main(STAGE, main, extra_errors=(VerifierError, WeightSyncError))
