"""The pipeline's stages and where their outputs live: `<results>/<stage dir>/<key>/`.

A leaf module (no imports from `posttrain`): the planner, the lineage reader and the report all
need the stage order, and a stage that imports it should not depend on the planner's code (the
planner is part of no stage's code fingerprint).
"""

from __future__ import annotations

from collections.abc import Iterable

# Stage (rule and script name) -> directory under results/, in pipeline (DAG) order: the one order
# the report, its tables and figures follow.
STAGE_DIRS = {
    "prepare_data": "data",
    "sft": "sft",
    "dpo": "dpo",
    "reward_model": "reward_model",
    "reward": "reward",
    "grpo": "grpo",
    "distill": "distill",
    "evaluate": "eval",
    "export": "export",
}
MODEL_STAGES = ("sft", "dpo", "grpo", "distill")  # stages that write a model, in pipeline order; each is evaluated
# Stage zero: `model.policy` as every stage starts from it, evaluated (with `eval.base`) but never written.
BASE = "base"
# `model.student` as distillation starts from it, evaluated (with `eval.base`) but never written.
STUDENT = "student"
ORDER = (BASE, *(name for stage in STAGE_DIRS for name in ((STUDENT, stage) if stage == "distill" else (stage,))))


def pipeline_order(stages: Iterable[str]) -> list[str]:
    """`stages` in the order the pipeline runs them (not alphabetical); an unknown stage is an error."""
    stages = list(stages)
    unknown = sorted(set(stages) - set(ORDER))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; the pipeline's stages are {', '.join(ORDER)}")
    return sorted(stages, key=ORDER.index)
