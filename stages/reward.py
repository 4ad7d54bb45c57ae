"""reward: sample the policy, score the samples, keep the prompts GRPO can learn from, pair best vs worst.

    python stages/reward.py --config RESOLVED.json --data DATA_DIR [--model POLICY_DIR] [--reward_model RM_DIR] --out DIR

Reads the config keys in `READS`, in this order:

1. `reward.samples_per_prompt` completions are sampled for each of the first `reward.n_prompts`
   rows of the `prompts` split (chat template with the generation prompt, stopping at the
   end-of-turn token) at `reward.temperature`, with the `reward.backend` (`native`: the KV-cache
   sampler; `vllm`: vLLM where installed) from the policy GRPO starts from (`--model`, or
   `model.policy` when GRPO comes first in `pipeline`). Call c of the backend is seeded `seed + c`.
2. Each sample is scored by every verifier in `reward.verifiers` (batched functions once over all
   samples) and by the reward model: `--reward_model` (the reward_model stage's output, on the
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
   worst (rejected); ties go to the earliest sample.

One process (`reward.resources`: one node, at most one GPU). Resume state lives in `<out>.resume/`:
every finished sampling call (each call is seeded on its own, so a rerun skips the finished ones
and gives the same output); rerunning the same command continues from it.

Output (written to a temporary sibling and renamed when complete; identical for the same seed):
    rollouts.parquet      one row per sample: prompt_index, prompt_id, sample, prompt (rendered
                          text), completion, prompt_ids, completion_ids, logprobs, finish_reason,
                          reward/<verifier> (its own value), with a reward model reward/rm (its raw
                          score) and reward/rm_norm (normalized), reward, correct, policy_key
    pass_rates.parquet    one row per prompt: prompt_index, prompt_id, task, samples, correct,
                          pass_rate, reward_mean, reward_std
    grpo_prompts.parquet  the kept prompts, with the `prompts` split's columns (prompt_ids, id,
                          task, answer, example) plus prompt_index and pass_rate
    pairs.parquet         prompt (messages), chosen, rejected (completion texts), their rewards,
                          prompt_index, prompt_id: the `preference` source format DPO reads
    stats.json            counts and means
    posttrain.json        provenance, with throughput (rollouts/s) and wall times
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import pandas as pd
from tqdm.auto import tqdm

from posttrain.data.store import load_split
from posttrain.generation import GenerationBackend, SamplingParams
from posttrain.generation.backend import build_backend
from posttrain.rewards import Rewards, VerifierError
from posttrain.rewards.sample_rewards import add_reward_model_scores, verifier_rewards
from posttrain.rewards.specs import pretrained_source
from posttrain.rl.curation import as_messages, best_vs_worst, grpo_prompts, pass_rates, rollout_table
from posttrain.training.faults import kill_if_requested, run_main
from posttrain.training.harness import StageRun
from posttrain.training.result_log import ResultLog
from posttrain.training.setup import backend_of, model_config
from posttrain.utils.io import atomic_dir
from posttrain.utils.provenance import write_provenance
from posttrain.workflow.lineage import read_provenance

STAGE = "reward"
# data.max_seq_len: the vLLM context; reward_model.source: a pretrained reward model; .normalize: its scale
READS = ("seed", "model.policy", "model.backend", "data.max_seq_len", "reward", "reward_model.source", "reward_model.normalize")
GENERATION_BATCH = 64  # sequences per native generate() call
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


def sample(run: StageRun, model_dir: str, prompt_ids: list[list[int]], params: SamplingParams
           ) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """`k` completions per prompt, prompt after prompt (sample j of prompt i at index i * k + j).

    Call c of the backend is seeded `seed + c`; finished calls are kept in the resume state, so
    a rerun after SIGTERM (or a kill) continues with the next one.
    """
    reward, seed = run.cfg["reward"], run.cfg["seed"]
    k = reward["samples_per_prompt"]
    per_call = VLLM_BATCH if reward["backend"] == "vllm" else GENERATION_BATCH
    prompts_per_call = max(1, per_call // k)
    starts = range(0, len(prompt_ids), prompts_per_call)
    log = ResultLog(run.out, "samples.jsonl", run.cfg["key"])
    backend: GenerationBackend | None = None
    with tqdm(total=len(prompt_ids), desc="sample", unit="prompt", dynamic_ncols=True, mininterval=1.0) as bar:
        for call, start in enumerate(starts):
            chunk = prompt_ids[start : start + prompts_per_call]
            if call not in log.done:
                if backend is None:  # only when a call is left (vLLM takes a while to start)
                    max_len = run.cfg["data"]["max_seq_len"] + reward["max_new_tokens"]
                    backend = build_backend(reward["backend"], model_dir, model_backend=run.cfg["model"]["backend"],
                                            pad_id=run.tokenizer.pad_id, decode=run.tokenizer.decode, device=run.device,
                                            seed=seed,
                                            max_model_len=max_len, max_batch_size=GENERATION_BATCH,
                                            setting="reward.backend")
                out = backend.generate([p for p in chunk for _ in range(k)], params, seed + call)
                log.add(call, [out.tokens, out.logprobs, out.finish_reasons])
                if call + 1 < len(starts) and run.stop.requested():
                    run.stop.exit(call, log.path)
                kill_if_requested(call + 1)  # tests: sampling call c is "step" c + 1
            bar.update(len(chunk))
    done = [log.done[call] for call in range(len(starts))]
    return [t for d in done for t in d[0]], [lp for d in done for lp in d[1]], [r for d in done for r in d[2]]


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

    rewards = Rewards(reward["verifiers"])

    # 1./2. samples and their rewards
    params = SamplingParams(max_new_tokens=reward["max_new_tokens"], temperature=reward["temperature"],
                            stop_token_ids=tok.eos_ids)
    prompt_ids = [list(r["prompt_ids"]) for r in rows]
    t0 = time.perf_counter()
    tokens, logprobs, reasons = sample(run, start, prompt_ids, params)
    timing["sample_s"] = time.perf_counter() - t0
    completions = tok.decode_batch(tokens)
    components = verifier_rewards(completions, examples, k, rewards)
    totals = [rewards.total(c) for c in components]
    correct = [rewards.correct(c) for c in components]
    add_reward_model_scores(components, prompt_ids, tokens, completions, examples, k, args.reward_model,
                            pretrained_source(cfg["reward_model"]["source"]), cfg["reward_model"]["normalize"],
                            tok.pad_id, run.device)
    if "rm_norm" in components[0]:  # weight 1: the reward model's normalized score
        totals = [t + c["rm_norm"] for t, c in zip(totals, components)]
    rollouts = rollout_table(rows, prompt_ids, tokens, logprobs, reasons, completions, components, totals, correct,
                             k, tok, key)

    # 3./4. GRPO prompts and on-policy pairs
    rates = pass_rates(rollouts, rows, k)
    keep, fallback = grpo_prompts(rates, band)
    if fallback:
        print(f"{STAGE}: warning: {fallback}", file=sys.stderr, flush=True)
    kept = pd.DataFrame(rows)[keep.to_numpy()].assign(prompt_index=rates["prompt_index"][keep], pass_rate=rates["pass_rate"][keep])
    pairs = best_vs_worst(rollouts, {i: as_messages(examples[i]["prompt"]) for i in range(n)})

    lengths = [len(t) for t in tokens]
    stats = {
        "policy_key": key,
        "backend": reward["backend"],
        "n_prompts": n,
        "samples_per_prompt": k,
        "rollouts": len(tokens),
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
        "truncated": statistics.fmean(r == "length" for r in reasons),
    }
    timing["rollouts_per_s"] = len(tokens) / timing["sample_s"]
    timing["generated_tokens_per_s"] = sum(lengths) / timing["sample_s"]
    with atomic_dir(args.out) as out:
        rollouts.to_parquet(out / "rollouts.parquet", index=False)
        rates.to_parquet(out / "pass_rates.parquet", index=False)
        kept.reset_index(drop=True).to_parquet(out / "grpo_prompts.parquet", index=False)
        pairs.to_parquet(out / "pairs.parquet", index=False)
        (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        write_provenance(out, cfg, STAGE, run.started, {**stats, **timing, "model_backend": sampler_code(run, start)})
    run.done()
    print(json.dumps({"out": args.out, **{k_: stats[k_] for k_ in ("rollouts", "pass_rate_mean", "grpo_prompts", "pairs")},
                      "rollouts_per_s": round(timing["rollouts_per_s"], 2)}), flush=True)


if __name__ == "__main__":
    run_main(STAGE, main, extra_errors=(VerifierError,))
