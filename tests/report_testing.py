"""Hand-written stage outputs at a real plan's paths, for the report tests: every planned job's folder
with the files the report reads (posttrain.json, metrics.jsonl with the keys the stage scripts log,
each eval's metrics.json), values a known function of the variant's seed, DPO beta and stage."""

from __future__ import annotations

import json
import time
from pathlib import Path

from posttrain.utils.provenance import write_provenance
from posttrain.workflow.layout import BASE, STUDENT
from posttrain.workflow.plan import MODEL_STAGES, Job, Plan
from posttrain.workflow.views import write_plan_files

# Four variants: seed1 and seed2 form the `default` group; again1 is seed1 again (the same outputs,
# counted once); beta changes DPO's beta and distils from DPO, sharing data and SFT with seed1.
TABLE = """\
variant\tseed\tdpo.beta\tdistill.teacher_stage
seed1\t1\t\t
seed2\t2\t\t
again1\t1\t\t
beta\t1\t0.2\tdpo
"""
BETA_GROUP = 'distill.teacher_stage="dpo";dpo.beta=0.2'


# base: stage zero; the student before distillation scores between the base and the SFT model
RANK = {BASE: 0, STUDENT: 0.5, **{stage: i + 1 for i, stage in enumerate(MODEL_STAGES)}}


def accuracy(stage: str, seed: int, beta: float | None) -> float:
    """The greedy accuracy written for a model: each stage adds 0.1 + 0.01 x seed, beta 0.2 adds 0.05 from DPO on."""
    rank = RANK[stage]
    return 0.1 * rank + 0.01 * seed * rank + (0.05 if beta == 0.2 else 0.0)


def _records(stage: str, seed: int) -> list[dict]:
    """metrics.jsonl records with the keys stages/<stage>.py logs (GRPO without `kl`: kl_coef 0)."""
    steps = range(1, 11)
    if stage == "sft":
        return [{"step": 0, "eval_loss": 5.0}, *({"step": s, "loss": 3.0 / s, "lr": 1e-3} for s in steps),
                {"step": 10, "eval_loss": 0.5 + 0.01 * seed}]
    if stage == "dpo":
        return [{"step": s, "loss": 0.7 - 0.02 * s, "rewards/accuracy": 0.5 + 0.04 * s, "rewards/margin": 0.1 * s}
                for s in steps]
    if stage == "grpo":
        return [{"step": s, "loss": 0.001, "reward_mean": 0.3 + 0.02 * s, "entropy": 1.0 - 0.05 * s, "pass_rate": 0.3}
                for s in steps]
    if stage == "distill":
        return [{"step": 0, "eval_divergence": 2.0},
                *({"step": s, "loss": 1.0 / s, "divergence": 0.8 / s, "ce": 0.2} for s in steps),
                {"step": 10, "eval_divergence": 0.3}]
    return []


def _eval_metrics(job: Job, zero: str) -> dict:
    stage = next((s for s in job.resolved["upstream"] if s in MODEL_STAGES), zero)
    seed, beta = job.resolved["seed"], job.resolved.get("dpo", {}).get("beta")
    return {"stage": stage, "model_key": job.resolved["upstream"].get(stage), "n_prompts": 16,
            "accuracy": accuracy(stage, seed, beta), "pass@1": 0.5, "pass@2": 0.6 + 0.01 * seed,
            "reward": accuracy(stage, seed, beta), "response_len": 7.0, "nll": 2.0 if stage == BASE else 1.0 / RANK[stage],
            "ppl": 2.0, "pref_acc": 0.8 + 0.01 * seed if stage == "dpo" else None}


def write_outputs(plan: Plan) -> None:
    """Every planned job's output folder, after its resolved config (so none looks older than its config)."""
    write_plan_files(plan.results, plan.files())
    students = {v.evals[STUDENT].key for v in plan.variants.values() if STUDENT in v.evals}
    for jobs in plan.jobs.values():
        for job in jobs.values():
            folder = Path(job.path)
            folder.mkdir(parents=True, exist_ok=True)
            write_provenance(folder, job.resolved, job.stage, time.time() - 5.0, {})
            records = _records(job.stage, job.resolved["seed"])
            if records:
                (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            if job.stage == "evaluate":
                (folder / "metrics.json").write_text(json.dumps(_eval_metrics(job, STUDENT if job.key in students else BASE)))
