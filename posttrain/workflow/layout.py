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
    "reward": "reward",
    "grpo": "grpo",
    "distill": "distill",
    "evaluate": "eval",
    "export": "export",
}
MODEL_STAGES = ("sft", "dpo", "grpo", "distill")  # stages that write a model, in pipeline order; each is evaluated


def pipeline_order(stages: Iterable[str]) -> list[str]:
    """`stages` in the order the pipeline runs them (not alphabetical); an unknown stage is an error."""
    stages = list(stages)
    unknown = sorted(set(stages) - set(STAGE_DIRS))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; the pipeline's stages are {', '.join(STAGE_DIRS)}")
    order = list(STAGE_DIRS)
    return sorted(stages, key=order.index)
