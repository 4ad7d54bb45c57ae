"""evaluate: task accuracy, pass@k, reward, held-out NLL and preference accuracy of one model.

    python stages/evaluate.py --config RESOLVED.json --data DATA_DIR [--model MODEL_DIR] --out DIR [--reference DIR]

Without `--model` it evaluates stage zero (`base`): `model.policy` as SFT starts from it (the
folder's weights, or a preset's seeded random init sized to the data's tokenizer). The workflow scores
the student before distillation the same way, with a config whose `model.policy` is `model.student`.

On the first `eval.n_prompts` rows of the data's `eval` split (problems never trained on):
- greedy completions -> `accuracy` (pass@1 of greedy decoding), `reward`, `response_len`;
- `eval.samples` completions per prompt at `eval.temperature` -> `pass@k` for k in `eval.pass_k`
  (unbiased estimator, `posttrain.evaluation.passk`);
- with `environment.fn`, each of these is a multi-turn episode (`posttrain.envs`; its last model message is
  scored, with the environment's reward in the row) and `turns_mean`, `tool_calls_mean` and
  `invalid_tool_call_rate` of the greedy episodes are added;
- a completion is correct when the first of `reward.verifiers` gives it full credit; `reward` is
  the weighted sum of all of them (`posttrain.evaluation.task_metrics`, `posttrain.rewards.verifiers`:
  built-ins, `module:function`, `path/file.py:function` relative to the working directory, batched ones
  called once per batch of completions).
On `sft_eval`: `nll` per trained token and `ppl`. For a DPO model: `pref_acc`, the share of
held-out pairs (eval rows' reference response vs. plausible mistake) whose implicit reward prefers
the reference, against the DPO run's reference model (its upstream model, next to it under
results/, or `--reference`); `null` with `pref_acc_note` for other models. Optional
`eval.lm_eval_tasks` via lm-evaluation-harness (`lm_eval`: results or `{"skipped": reason}`).
Weights are evaluated in float32, in one process (GPU if there is one).

Output (written to a temporary sibling and renamed when complete):
    metrics.json    the numbers above, overall and under `per_task`
    samples.jsonl   the first prompts' greedy and sampled completions with their scores (with an environment, each
                    episode whole: the prompt it opened with, every turn, the messages)
    lm_eval.log     the harness's output, when it ran
    posttrain.json  provenance
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from posttrain.training.faults import run_main
from posttrain.model_files import load_hf_model, resolve_model_source
from posttrain.data.loader import eval_split_rows, length_multiple, sft_batches
from posttrain.evaluation import PromptResult, eval_pairs, heldout_nll, implicit_preference_accuracy, task_metrics
from posttrain.envs.episodes import EpisodeSettings, episode_metrics
from posttrain.evaluation.lm_eval import LmEvalError, run_lm_eval
from posttrain.losses.dpo import REFERENCE_FREE
from posttrain.generation import SamplingParams
from posttrain.generation.backend import NativeBackend
from posttrain.models import Transformer, is_preset
from posttrain.models.hf_backend import HFCausalLM
from posttrain.rewards.verifiers import Rewards, VerifierError
from posttrain.rollouts import GENERATION_BATCH, Sample, Sampler, sample_in_calls, verifier_values
from posttrain.tokenizer import Tokenizer
from posttrain.training.harness import StageRun
from posttrain.training.setup import initial_model, model_config
from posttrain.workflow.layout import BASE, MODEL_STAGES
from posttrain.workflow.lineage import read_provenance, upstream_folder

STAGE = "evaluate"
# verifiers decide what counts as correct; model.policy is the base model (stage zero)
READS = ("seed", "model.policy", "model.backend", "data.max_seq_len", "reward.verifiers", "environment", "eval.n_prompts", "eval.max_new_tokens",
         "eval.pass_k", "eval.samples", "eval.temperature", "eval.lm_eval_tasks", "eval.lm_eval_optional")
INPUTS = {
    "data": "prepare_data output folder",
    "model": "model folder (HF layout with posttrain.json); absent: model.policy before training",
    "reference": "reference model of a DPO model (default: its upstream model folder)",
}
SCORING_BATCH = 16  # rows per forward pass for NLL and preference pairs
LOGGED_PROMPTS = 16  # prompts written to samples.jsonl


def eval_rows(data_dir: Path, n: int) -> list[dict[str, Any]]:
    """The first `n` rows of the `eval` split, in data order: prompt ids, task, verifier example."""
    batch = eval_split_rows(data_dir, n)
    rows = [{"prompt_ids": ids, "task": task, "example": example}
            for ids, task, example in zip(batch["prompt_ids"], batch["tasks"], batch["examples"])]
    if not rows:
        raise ValueError(f"{data_dir}: the eval split is empty")
    if len(rows) < n:
        print(f"evaluate: eval.n_prompts={n} but the eval split has {len(rows)} rows; evaluating all of them")
    return rows[:n]


def reference_folder(model_dir: Path, record: dict[str, Any], override: str | None, policy: str) -> Path:
    """The DPO run's reference: `--reference`, else its upstream model stage's folder next to it, or `policy`
    (model.policy) for a DPO run that started the pipeline."""
    if override:
        return Path(override)
    models = [(stage, key) for stage, key in record.get("upstream", {}).items() if stage in MODEL_STAGES]
    if not models:
        return resolve_model_source(policy)
    if len(models) != 1:
        raise ValueError(f"{model_dir}/posttrain.json: expected one upstream model stage, found {models}")
    return upstream_folder(model_dir, *models[0])


def evaluated_model(model_arg: str | None, cfg: dict[str, Any], tok: Tokenizer,
                    device: torch.device) -> tuple[Transformer | HFCausalLM, dict[str, Any], Path | None]:
    """The model (on the code `model.backend` picks), its provenance record and its folder: `--model`, else stage
    zero (`model.policy`, no folder for a preset)."""
    backend = cfg["model"]["backend"]
    if model_arg:
        model_dir = Path(model_arg)
        return load_hf_model(model_dir, device, backend=backend).eval(), read_provenance(model_dir), model_dir
    source = cfg["model"]["policy"]
    model = initial_model(source, model_config(source, tok), cfg["seed"], backend).to(device).eval()
    record = {"stage": BASE, "key": None, "source": source}
    return model, record, None if is_preset(source) else resolve_model_source(source)


def preference_metrics(model: Transformer | HFCausalLM, model_dir: Path | None, record: dict[str, Any],
                       rows: list[dict[str, Any]], tok: Tokenizer, max_len: int, reference_override: str | None,
                       device: torch.device, backend: str) -> dict[str, Any]:
    """`pref_acc` (+ margin, pairs) for a DPO model, its reference on the code `backend` (`model.backend`) picks, as
    the DPO run's was; otherwise `pref_acc: None` and the reason."""
    if record["stage"] != "dpo":
        return {"pref_acc": None, "pref_acc_note": f"a {record['stage']} model has no implicit preference reward (dpo only)"}
    pairs = eval_pairs([r["example"] for r in rows], tok, max_len)
    if not pairs["chosen_input_ids"]:
        return {"pref_acc": None, "pref_acc_note": "no eval row carries response and rejected_response to pair"}
    dpo_cfg = record["config"]["dpo"]
    reference = None
    if dpo_cfg["loss"] not in REFERENCE_FREE:
        folder = reference_folder(model_dir, record, reference_override, record["config"]["model"]["policy"])
        if not folder.is_dir():
            return {"pref_acc": None, "pref_acc_note": f"reference model {folder} not found (pass --reference)"}
        reference = load_hf_model(folder, device, backend=backend).eval()
    metrics = implicit_preference_accuracy(model, reference, pairs, dpo_cfg, tok.pad_id, SCORING_BATCH)
    metrics["pref_reference"] = None if reference is None else str(folder)
    return metrics


def shown(sample: Sample, tok: Tokenizer) -> dict[str, Any]:
    """What samples.jsonl shows of a sample: the prompt the model saw and its completion; an episode whole (every
    turn, the model's and the environment's replies, as rendered), its messages and counts."""
    record = {"prompt": tok.decode(sample.prompt_ids, skip_special_tokens=False), "completion": sample.text}
    if sample.is_episode:
        record.update(episode=tok.decode(sample.tokens, skip_special_tokens=False), messages=sample.messages,
                      **(sample.counts or {}))
    return record


def nll_metrics(model: Transformer | HFCausalLM, data_dir: Path, seed: int) -> dict[str, Any]:
    batches = sft_batches(data_dir, SCORING_BATCH, seed=seed, split="sft_eval", shuffle=False, loop=False,
                          multiple=length_multiple(compiled=False))
    if len(batches.dataset) == 0:
        return {"nll": None, "ppl": None, "nll_note": f"{data_dir}: the sft_eval split is empty"}
    return heldout_nll(model, batches, total=len(batches))


def main() -> None:
    run = StageRun(STAGE, READS, INPUTS, __file__, optional=("model", "reference"), one_process=True, training=False,
                   section="eval", resumable=False)
    cfg, ev, seed, args, tok, device = run.cfg, run.section, run.cfg["seed"], run.args, run.tokenizer, run.device
    verifier_specs = cfg["reward"]["verifiers"]
    rewards = Rewards(verifier_specs)
    data_dir = Path(args.data)
    model, record, model_dir = evaluated_model(args.model, cfg, tok, device)
    rows = eval_rows(data_dir, ev["n_prompts"])
    prompts = [r["prompt_ids"] for r in rows]
    examples = [r["example"] for r in rows]

    greedy_params = SamplingParams(max_new_tokens=ev["max_new_tokens"], temperature=0.0, stop_token_ids=tok.eos_ids)
    sampler = Sampler(NativeBackend(model, tok.pad_id, max_batch_size=GENERATION_BATCH), tok,
                      EpisodeSettings.from_config(cfg["environment"], os.getcwd()))
    greedy = sample_in_calls(sampler, prompts, examples, greedy_params, seed, GENERATION_BATCH, "greedy")
    greedy_scores = verifier_values(rewards, greedy, examples)

    n = ev["samples"]
    sample_params = SamplingParams(max_new_tokens=ev["max_new_tokens"], temperature=ev["temperature"],
                                   stop_token_ids=tok.eos_ids)
    repeated = [ex for ex in examples for _ in range(n)]
    sampled = sample_in_calls(sampler, [p for p in prompts for _ in range(n)], repeated, sample_params, seed,
                              GENERATION_BATCH, f"sampled x{n}")
    sampled_scores = verifier_values(rewards, sampled, repeated)
    sampled_correct = [rewards.correct(s) for s in sampled_scores]

    results = [
        PromptResult(task=r["task"], correct=rewards.correct(greedy_scores[i]), rewards=greedy_scores[i],
                     length=len(greedy[i].tokens), truncated=greedy[i].finish_reason == "length",
                     sample_correct=sum(sampled_correct[i * n : (i + 1) * n]))
        for i, r in enumerate(rows)
    ]
    metrics: dict[str, Any] = {"stage": record["stage"], "model_key": record["key"], "verifiers": verifier_specs,
                               "samples": n, "temperature": ev["temperature"], "max_new_tokens": ev["max_new_tokens"]}
    if record["stage"] == BASE:
        metrics["source"] = record["source"]
    metrics.update(task_metrics(results, ev["pass_k"], n, rewards.weights))
    if sampler.episodes is not None:  # multi-turn: the greedy episodes' turns, tool calls and malformed-call rate
        metrics.update(episode_metrics([s.counts for s in greedy]))
    metrics.update(nll_metrics(model, data_dir, seed))
    metrics.update(preference_metrics(model, model_dir, record, rows, tok, cfg["data"]["max_seq_len"],
                                      args.reference, device, cfg["model"]["backend"]))

    summary = {k: metrics[k] for k in ("accuracy", *[f"pass@{k}" for k in ev["pass_k"]], "reward", "nll", "ppl", "pref_acc")}

    def write(out: Path) -> dict[str, Any]:
        metrics["lm_eval"] = (run_lm_eval(model_dir, ev["lm_eval_tasks"], out, device.type, optional=ev["lm_eval_optional"])
                              if model_dir is not None
                              else {"skipped": f"{record['source']} is a preset's random init, with no folder to load"})
        if "skipped" in metrics["lm_eval"]:
            print(f"evaluate: lm-eval skipped: {metrics['lm_eval']['skipped']}")
        with (out / "samples.jsonl").open("w", encoding="utf-8") as f:
            for i, r in enumerate(rows[:LOGGED_PROMPTS]):
                f.write(json.dumps({
                    "id": r["example"].get("id"), "task": r["task"], "answer": r["example"].get("answer"),
                    **shown(greedy[i], tok), "finish_reason": greedy[i].finish_reason, "correct": results[i].correct,
                    "rewards": greedy_scores[i],
                    "samples": [{**{k: v for k, v in shown(sampled[j], tok).items() if k != "prompt"},
                                 "correct": sampled_correct[j]} for j in range(i * n, (i + 1) * n)],
                }, ensure_ascii=False) + "\n")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
        return {**summary, "model_backend": model.backend}

    run.write_output(write)
    print(json.dumps({"out": args.out, **summary}))


if __name__ == "__main__":
    run_main(STAGE, main, extra_errors=(VerifierError, LmEvalError))
