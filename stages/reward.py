"""reward: sample the policy, score the samples, keep the prompts GRPO can learn from, pair best vs worst.

    python stages/reward.py --config RESOLVED.json --data DATA_DIR [--model POLICY_DIR] [--reward_model RM_DIR] --out DIR

Reads the config keys in `READS`, in this order:

1. `reward.samples_per_prompt` completions are sampled for each of the first `reward.n_prompts`
   rows of the `prompts` split (chat template with the generation prompt, stopping at the
   end-of-turn token) at `reward.temperature`, with the `reward.backend` (`native`: the KV-cache
   sampler; `vllm`: vLLM where installed) from the policy GRPO starts from (`--model`, or
   `model.policy` when GRPO comes first in `pipeline`). Call c of the backend is seeded `seed + c`.
   With `environment.fn`, each sample is a multi-turn episode, run as GRPO runs it (`posttrain.rollouts`:
   the environment's opening is the prompt, and the model's last message is what the verifiers score,
   with the environment's reward in its row), so the pass rates and pairs describe what GRPO trains on.
2. Each sample is scored as GRPO scores it (`posttrain.rollouts.RewardFunction`): by every verifier in
   `reward.verifiers` (batched functions once over all samples) and by the reward model: `--reward_model` (the reward_model stage's output, on the
   policy's token ids) or a pretrained one named by `reward_model.source` (a folder or hub id, on
   the conversation its own chat template renders). Its reward is the weighted sum of the verifiers
   (each entry's `weight`) plus the reward model's score normalized per prompt
   (`reward_model.normalize`: `group` standardizes each prompt's samples; weight 1 here, so that a
   sweep over `grpo.rm_weight` shares this stage). A sample is correct when the first verifier gives
   it full credit (>= 1, as `evaluate` counts it), and a prompt's pass rate is its share of correct
   samples. A verifier that fails names the prompt's index in the `prompts` split.
3. GRPO prompts: those with `low < pass rate < high` for `reward.pass_rate_band: [low, high]`.
   Both ends are exclusive, so the default [0, 1] drops prompts the policy never or always solves
   (every sample gets the same reward: no group-relative signal). When no prompt is inside the
   band (a weak policy in a short pipeline), every prompt is kept so the pipeline goes on, and a
   warning on stderr and `grpo_prompts_fallback` in stats.json say so and why.
4. On-policy pairs: for each prompt whose samples' rewards differ, the best sample (chosen) and the
   worst (rejected); ties go to the earliest sample. An episode pair is the environment's opening
   (prompt) and every message after it on each side, with the episode's tools.

One process (`reward.resources`: one node, at most one GPU). Resume state lives in `<out>.resume/`:
every finished sampling call (each call is seeded on its own, so a rerun skips the finished ones
and gives the same output); rerunning the same command continues from it.

Output (written to a temporary sibling and renamed when complete; identical for the same seed):
    rollouts.parquet      one row per sample: prompt_index, prompt_id, sample, prompt (rendered
                          text), completion, prompt_ids, completion_ids, logprobs, finish_reason,
                          reward/<verifier> (its own value), with a reward model reward/rm (its raw
                          score) and reward/rm_norm (normalized), reward, correct, policy_key; for
                          episodes also episode (every token after the prompt, rendered), mask (the
                          model's tokens) and messages (the conversation, JSON)
    pass_rates.parquet    one row per prompt: prompt_index, prompt_id, task, samples, correct,
                          pass_rate, reward_mean, reward_std
    grpo_prompts.parquet  the kept prompts, with the `prompts` split's columns (prompt_ids, id,
                          task, answer, example) plus prompt_index and pass_rate
    pairs.jsonl           prompt (messages), chosen, rejected (completion texts, or an episode's messages,
                          with tools), their rewards, prompt_index, prompt_id: the `preference`
                          source format DPO reads
    stats.json            counts and means
    posttrain.json        provenance, with throughput (rollouts/s) and wall times
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

from posttrain.data.store import load_split
from posttrain.envs.episodes import EpisodeSettings, episode_metrics
from posttrain.generation import SamplingParams
from posttrain.generation.backend import build_backend
from posttrain.rewards import VerifierError
from posttrain.rewards.specs import pretrained_source
from posttrain.rollouts import GENERATION_BATCH, RewardFunction, Sample, Sampler, sample_in_calls
from posttrain.rl.curation import as_messages, best_vs_worst, grpo_prompts, pass_rates, rollout_table, write_pairs
from posttrain.training.faults import kill_if_requested, run_main
from posttrain.training.harness import StageRun
from posttrain.training.result_log import ResultLog
from posttrain.training.setup import backend_of, model_config
from posttrain.workflow.lineage import read_provenance

STAGE = "reward"
# data.max_seq_len: the vLLM context; environment: episodes; reward_model.source: a pretrained reward model; .normalize: its scale
READS = ("seed", "model.policy", "model.backend", "data.max_seq_len", "reward", "environment", "reward_model.source",
         "reward_model.normalize")
VLLM_BATCH = 1024  # sequences per vLLM call: its scheduler batches them itself
INPUTS = {
    "data": "prepare_data output (results/data/<key>)",
    "model": "the policy grpo starts from (absent: model.policy)",
    "reward_model": "the reward_model stage's output, when reward_model.source is train (a pretrained source is "
                    "read from the config)",
}


def policy_key(model_dir: str) -> str | None:
    """The `key` of the policy folder's `posttrain.json` (None for a folder from elsewhere)."""
    try:
        return read_provenance(model_dir).get("key")
    except FileNotFoundError:
        return None


def sampler_code(run: StageRun, start: str) -> str:
    """What ran the policy: `model.backend`'s choice for the native sampler ("native" | "transformers"), or vllm."""
    if run.cfg["reward"]["backend"] == "vllm":
        return "vllm"
    return backend_of(start, model_config(start, run.tokenizer), run.cfg["model"]["backend"])


def sample(run: StageRun, sampler: Sampler, rows: list[dict[str, Any]], examples: list[dict[str, Any]],
           params: SamplingParams) -> list[Sample]:
    """`k` samples per prompt, prompt after prompt (sample j of prompt i at index i * k + j); with an environment,
    episodes.

    Call c of the backend is seeded `seed + c`; finished calls are kept in the resume state, so a rerun after
    SIGTERM (or a kill) continues with the next one.
    """
    reward, k = run.cfg["reward"], run.cfg["reward"]["samples_per_prompt"]
    per_call = max(1, (VLLM_BATCH if reward["backend"] == "vllm" else GENERATION_BATCH) // k) * k
    calls = -(-len(rows) * k // per_call)
    log = ResultLog(run.out, "samples.jsonl", run.cfg["key"])

    def logged(call: int, samples: list[Sample]) -> None:
        log.add(call, [s.to_json() for s in samples])
        if call + 1 < calls and run.stop.requested():
            run.stop.exit(call, log.path)
        kill_if_requested(call + 1)  # tests: sampling call c is "step" c + 1

    return sample_in_calls(sampler, [list(r["prompt_ids"]) for r in rows for _ in range(k)],
                           [e for e in examples for _ in range(k)], params, run.cfg["seed"], per_call, "sample",
                           done=log.done, after_call=logged)


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model", "reward_model"), one_process=True, training=False)
    start = run.start_model()
    cfg, reward, args, tok = run.cfg, run.cfg["reward"], run.args, run.tokenizer
    band = tuple(reward["pass_rate_band"])  # the schema and the dry run: [low, high], low < high
    k = reward["samples_per_prompt"]
    split = load_split(args.data, "prompts")
    n = reward["n_prompts"]
    if n > len(split):
        raise ValueError(f"reward.n_prompts is {n} but {args.data}/prompts has {len(split)} rows (data.n_prompts)")
    rows = split.select(range(n)).to_list()
    examples = [json.loads(r["example"]) for r in rows]  # row i of the split is prompt index i
    key = policy_key(start)
    timing: dict[str, float] = {}

    episodes = EpisodeSettings.from_config(cfg["environment"], os.getcwd())
    # vLLM's context: a prompt and its completion; an episode's opening is not bounded by data.max_seq_len (as GRPO)
    max_model_len = None if episodes else cfg["data"]["max_seq_len"] + reward["max_new_tokens"]
    sampler = Sampler(lambda: build_backend(
        reward["backend"], start, model_backend=cfg["model"]["backend"], pad_id=tok.pad_id, decode=tok.decode,
        device=run.device, seed=cfg["seed"], max_model_len=max_model_len, max_batch_size=GENERATION_BATCH,
        setting="reward.backend"), tok, episodes)
    pretrained = pretrained_source(cfg["reward_model"]["source"])
    score = RewardFunction(reward["verifiers"], args.reward_model, 1.0 if args.reward_model or pretrained else 0.0,
                           tok.pad_id, pretrained, cfg["reward_model"]["normalize"], device=str(run.device),
                           model_backend=cfg["model"]["backend"])

    # 1./2. samples and their rewards (the reward model's normalized score weighs 1)
    params = SamplingParams(max_new_tokens=reward["max_new_tokens"], temperature=reward["temperature"],
                            stop_token_ids=tok.eos_ids)
    t0 = time.perf_counter()
    samples = sample(run, sampler, rows, examples, params)
    timing["sample_s"] = time.perf_counter() - t0
    totals, correct, components = score.scores(samples, [e for e in examples for _ in range(k)], k, list(range(n)))
    rollouts = rollout_table(rows, samples, components, totals, correct, k, tok, key)

    # 3./4. GRPO prompts and on-policy pairs
    rates = pass_rates(rollouts, rows, k)
    keep, fallback = grpo_prompts(rates, band)
    if fallback:
        print(f"{STAGE}: warning: {fallback}", file=sys.stderr, flush=True)
    kept = pd.DataFrame(rows)[keep.to_numpy()].assign(prompt_index=rates["prompt_index"][keep], pass_rate=rates["pass_rate"][keep])
    pairs = best_vs_worst(rollouts, samples, {i: as_messages(examples[i]["prompt"]) for i in range(n)})

    lengths = [len(s.tokens) for s in samples]
    stats = {
        "policy_key": key,
        "backend": reward["backend"],
        "n_prompts": n,
        "samples_per_prompt": k,
        "rollouts": len(samples),
        "reward_mean": float(rollouts["reward"].mean()),
        "reward_mean_by_component": {name: float(rollouts[f"reward/{name}"].mean()) for name in components[0]},
        "correct_rate": float(rollouts["correct"].mean()),
        "pass_rate_mean": float(rates["pass_rate"].mean()),
        "never_solved": int((rates["pass_rate"] == 0).sum()),
        "always_solved": int((rates["pass_rate"] == 1).sum()),
        "pass_rate_band": [band[0], band[1]],
        "grpo_prompts": int(keep.sum()),
        "grpo_prompts_fallback": fallback,
        "pairs": len(pairs),
        "response_len_mean": statistics.fmean(lengths),
        "truncated": statistics.fmean(s.finish_reason == "length" for s in samples),
    }
    if sampler.episodes is not None:  # multi-turn: turns, tool calls and malformed tool calls per episode
        stats.update(episode_metrics([s.counts for s in samples]))
    timing["rollouts_per_s"] = len(samples) / timing["sample_s"]
    timing["generated_tokens_per_s"] = sum(lengths) / timing["sample_s"]

    def write(out: Path) -> dict[str, Any]:
        rollouts.to_parquet(out / "rollouts.parquet", index=False)
        rates.to_parquet(out / "pass_rates.parquet", index=False)
        kept.reset_index(drop=True).to_parquet(out / "grpo_prompts.parquet", index=False)
        write_pairs(pairs, out / "pairs.jsonl")
        (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        return {**stats, **timing, "model_backend": sampler_code(run, start)}

    run.write_output(write)
    print(json.dumps({"out": args.out, **{k_: stats[k_] for k_ in ("rollouts", "pass_rate_mean", "grpo_prompts", "pairs")},
                      "rollouts_per_s": round(timing["rollouts_per_s"], 2)}), flush=True)


if __name__ == "__main__":
    run_main(STAGE, main, extra_errors=(VerifierError,))
