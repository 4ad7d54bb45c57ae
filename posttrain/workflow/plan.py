"""Stage keys and the job graph of all variants.

A stage's key is a hash of what its output depends on: the config keys it reads (`USES`, with
each section's `resources` left out) and the keys of the outputs it reads. Its output lives at
`<results>/<stage dir>/<key>/`, so variants that agree up to a stage share that output, and a
changed value moves exactly the stages downstream of it to new paths.

The config a stage script receives (`RESOLVED.json`) holds the keys its own key covers plus
everything its upstream stages received: a pure function of the key, identical for every variant
that shares the output.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.workflow.ablations import Variant, load_variants
from posttrain.workflow.config import SCHEMA_DIR, get_dotted, set_dotted
from posttrain.workflow.layout import MODEL_STAGES, STAGE_DIRS, pipeline_order

__all__ = ["MODEL_STAGES", "STAGE_DIRS", "Job", "Plan", "VariantPlan", "build_plan", "pipeline_order", "stage_key"]

KEY_VERSION = 1  # bump when the key recipe changes, so old outputs are not reused by mistake
KEY_LENGTH = 12
KEY_PATTERN = f"[0-9a-f]{{{KEY_LENGTH}}}"

_TRAINING = ("seed", "model.policy", "model.tokenizer", "model.dtype", "data", "memory", "parallel")
# Config keys each stage reads itself (besides what its inputs carry). `<section>.resources` is
# never part of a key: it changes how a job runs, not what it computes.
USES: dict[str, tuple[str, ...]] = {
    "prepare_data": ("seed", "model.policy", "model.tokenizer", "data"),
    "sft": (*_TRAINING, "sft"),
    "dpo": (*_TRAINING, "dpo"),
    "reward": (*_TRAINING, "reward"),
    "grpo": (*_TRAINING, "grpo"),
    "distill": (*_TRAINING, "model.student", "reward.verifiers", "distill"),  # verifiers: its greedy eval
    "evaluate": ("seed", "eval", "reward.verifiers"),  # verifiers decide what counts as correct
    "export": ("export",),
}
RESOURCES_FROM = {"prepare_data": "data", "evaluate": "eval"}  # stage -> section holding its resources


def canonical_json(value: Any) -> str:
    """The one JSON text of a value: sorted keys, no spaces, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def stage_key(stage: str, settings: Mapping[str, Any], upstream: Mapping[str, str]) -> str:
    """12 hex digits of sha256 over the stage name, its settings and its inputs' keys."""
    payload = canonical_json({"v": KEY_VERSION, "stage": stage, "config": settings, "upstream": upstream})
    return hashlib.sha256(payload.encode()).hexdigest()[:KEY_LENGTH]


def _settings(stage: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The nested config subset `USES[stage]`, without any `resources`."""
    out: dict[str, Any] = {}
    for key in USES[stage]:
        value = copy.deepcopy(get_dotted(cfg, key))
        if isinstance(value, dict):
            value.pop("resources", None)
        set_dotted(out, key, value)
    return out


def _deep_union(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = _deep_union(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out


@dataclass(frozen=True)
class Job:
    """One planned stage output, shared by every variant that reaches the same key."""

    stage: str
    key: str
    path: str  # <results>/<stage dir>/<key>
    inputs: dict[str, Job]  # CLI flag (data, model, teacher, reward, eval) -> upstream job
    resolved: dict[str, Any]  # RESOLVED.json: config subset + stage, key, upstream
    resources: dict[str, Any]  # <section>.resources of the first variant that planned this key

    @property
    def config_path(self) -> str:
        return f"{self.path}.config.json"

    def ref(self) -> dict[str, str]:
        return {"key": self.key, "path": self.path}


@dataclass(frozen=True)
class VariantPlan:
    """What one variant runs: a job per stage, an eval per model stage, the export."""

    name: str
    overrides: dict[str, Any]
    stages: dict[str, Job]
    evals: dict[str, Job]
    export: Job

    def jobs(self) -> list[Job]:
        return [*self.stages.values(), *self.evals.values(), self.export]

    def previous(self) -> dict[str, str | None]:
        """Model stage -> the model stage it started from (None for SFT): what the report's deltas compare to."""
        inputs = {stage: self.stages[stage].inputs.values() for stage in MODEL_STAGES}
        return {stage: next((job.stage for job in jobs if job.stage in MODEL_STAGES), None) for stage, jobs in inputs.items()}

    def manifest(self) -> dict[str, Any]:
        """The human view of the variant (results/variants/<name>/manifest.json)."""
        return {
            "variant": self.name,
            "overrides": self.overrides,
            "stages": {stage: job.ref() for stage, job in self.stages.items()},
            "eval": {stage: job.ref() for stage, job in self.evals.items()},
            "previous": self.previous(),
            "export": {"stage": self.export.inputs["model"].stage, **self.export.ref()},
        }


@dataclass
class Plan:
    """All variants' jobs, deduplicated by (stage, key)."""

    results: str
    variants: dict[str, VariantPlan] = field(default_factory=dict)
    jobs: dict[str, dict[str, Job]] = field(default_factory=dict)  # stage -> key -> job

    def job(self, stage: str, key: str) -> Job:
        try:
            return self.jobs[stage][key]
        except KeyError:
            known = ", ".join(sorted(self.jobs.get(stage, {}))) or "none"
            raise KeyError(f"no {stage} output with key {key!r} in this config's plan (planned: {known})") from None

    def _add(self, stage: str, cfg: Mapping[str, Any], inputs: dict[str, Job]) -> Job:
        upstream = {job.stage: job.key for job in inputs.values()}
        settings = _settings(stage, cfg)
        key = stage_key(stage, settings, upstream)
        planned = self.jobs.setdefault(stage, {})
        if key not in planned:
            resolved: dict[str, Any] = {}
            for job in inputs.values():
                resolved = _deep_union(resolved, {k: v for k, v in job.resolved.items() if k not in ("stage", "key", "upstream")})
            resolved = _deep_union(resolved, settings)
            resolved.update(stage=stage, key=key, upstream=upstream)
            path = f"{self.results}/{STAGE_DIRS[stage]}/{key}"
            section = RESOURCES_FROM.get(stage, stage)
            planned[key] = Job(stage, key, path, inputs, json.loads(canonical_json(resolved)),
                               copy.deepcopy(cfg[section]["resources"]))
        return planned[key]

    def add_variant(self, variant: Variant) -> VariantPlan:
        cfg = variant.config
        data = self._add("prepare_data", cfg, {})
        sft = self._add("sft", cfg, {"data": data})
        dpo = self._add("dpo", cfg, {"data": data, "model": sft})
        reward = self._add("reward", cfg, {"data": data, "model": dpo})
        grpo = self._add("grpo", cfg, {"data": data, "model": dpo, "reward": reward})
        models = {"sft": sft, "dpo": dpo, "grpo": grpo}
        models["distill"] = self._add("distill", cfg, {"data": data, "teacher": models[cfg["distill"]["teacher_stage"]]})
        evals = {stage: self._add("evaluate", cfg, {"data": data, "model": models[stage]}) for stage in MODEL_STAGES}
        exported = cfg["export"]["stage"]  # the model card quotes the model's eval
        export = self._add("export", cfg, {"model": models[exported], "eval": evals[exported]})
        stages = {"prepare_data": data, "sft": sft, "dpo": dpo, "reward": reward, "grpo": grpo, "distill": models["distill"]}
        plan = VariantPlan(variant.name, variant.overrides, stages, evals, export)
        self.variants[variant.name] = plan
        return plan

    def configs(self) -> dict[str, dict[str, Any]]:
        """Config file (path relative to results, without `.config.json`) -> its JSON content.

        The report's file is named by its key, like every other: two invocations with different
        ablation tables never overwrite each other's report config.
        """
        out = {f"{STAGE_DIRS[job.stage]}/{job.key}": job.resolved for jobs in self.jobs.values() for job in jobs.values()}
        report = self.report_config()
        out[f"report.{report['key']}"] = report
        return out

    @property
    def report_config_path(self) -> str:
        return f"{self.results}/report.{self.report_config()['key']}.config.json"

    def eval_paths(self) -> list[str]:
        return sorted(job.path for job in self.jobs.get("evaluate", {}).values())

    def report_config(self) -> dict[str, Any]:
        """The report's RESOLVED.json: every variant's manifest."""
        variants = {name: plan.manifest() for name, plan in self.variants.items()}
        return {"stage": "report", "key": stage_key("report", variants, {}), "upstream": {}, "variants": variants}


def build_plan(cfg: Mapping[str, Any], schema_dir: str | Path = SCHEMA_DIR) -> Plan:
    """The plan of a validated config and its ablation table (checked against `schema_dir`'s schemas)."""
    plan = Plan(results=cfg["results"].rstrip("/"))
    for variant in load_variants(cfg, schema_dir).values():
        plan.add_variant(variant)
    return plan
