"""Stage keys and the job graph of all variants.

A stage's key is a hash of what its output depends on: the config keys its script declares it
reads (`READS` in `stages/<stage>.py`, run settings left out), the fingerprint of the code it
runs (the script and the `posttrain` modules it imports, `posttrain.workflow.fingerprint`) and
the keys of the outputs it reads. Its output lives at `<results>/<stage dir>/<key>/`, so variants
that agree up to a stage share that output, and a changed value or module moves exactly the
stages downstream of it to new paths.

The config a stage script receives (`<key>.config.json`) holds the settings its own key covers,
everything its upstream stages received, and its code record: a pure function of the key,
identical for every variant that shares the output. Its run settings (`loggers`, its section's
`resources`, `log_every`, `checkpoint_every`) go to `<key>.run.json`, which enters no key.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.stage_config import CONFIG_SUFFIX, META_KEYS, RUN_KEYS, RUN_SECTION_KEYS, RUN_SUFFIX, deep_union, is_run_setting
from posttrain.workflow.ablations import Variant, load_variants
from posttrain.workflow.schema import REPO_ROOT, SCHEMA_DIR, get_dotted, set_dotted
from posttrain.workflow.fingerprint import declared_reads, fingerprint, module_hashes, stage_script
from posttrain.workflow.inputs import ContentHashes, code_search_path, user_inputs, without_unread_policy
from posttrain.workflow.layout import BASE, MODEL_STAGES, STAGE_DIRS, STUDENT, pipeline_order
from posttrain.workflow.roles import DPO_PAIRS
from posttrain.workflow.model_names import preset_names

__all__ = ["MODEL_STAGES", "STAGE_DIRS", "Job", "Plan", "VariantPlan", "build_plan", "pipeline_order", "stage_key"]

KEY_VERSION = 3  # bump when the key recipe changes, so old outputs are not reused by mistake (2: code, 3: user files)
KEY_LENGTH = 12
KEY_PATTERN = f"[0-9a-f]{{{KEY_LENGTH}}}"
RUN_SECTION = {"prepare_data": "data", "evaluate": "eval"}  # stage -> config section of its run settings
# The CLI flag by which a model stage (and reward scoring) gets the model it starts from; absent: model.policy.
START_FLAGS = {"sft": "model", "dpo": "model", "reward_model": "model", "reward": "model", "grpo": "model",
               "distill": "teacher"}


def canonical_json(value: Any) -> str:
    """The one JSON text of a value: sorted keys, no spaces, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def stage_key(stage: str, settings: Mapping[str, Any], upstream: Mapping[str, str], code: str,
              files: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """12 hex digits of sha256 over the stage name, its settings, its code fingerprint, its inputs' keys and
    the content of the user's files it reads (`inputs.user_inputs`; where a file lies is no part of it)."""
    content = {name: {k: v for k, v in record.items() if k != "path"} for name, record in (files or {}).items()}
    payload = canonical_json({"v": KEY_VERSION, "stage": stage, "config": settings, "code": code, "upstream": upstream,
                              "files": content})
    return hashlib.sha256(payload.encode()).hexdigest()[:KEY_LENGTH]


@dataclass(frozen=True)
class StageCode:
    """What the plan reads from `stages/<stage>.py`: its declared config keys and its code record."""

    script: str
    reads: tuple[str, ...]
    modules: dict[str, str]  # path relative to the repository -> hash (`module_hashes`)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.modules)

    def record(self) -> dict[str, Any]:
        """The `code` entry of the resolved config: enough to say which modules changed."""
        return {"fingerprint": self.fingerprint, "modules": self.modules}


def stage_code(repo: str | Path, stage: str) -> StageCode:
    """The stage's `READS` and code record; a declared run setting is an error naming the script."""
    script = stage_script(repo, stage)
    reads = declared_reads(script)
    run = [key for key in reads if is_run_setting(key)]
    if run:
        raise ValueError(f"{script}: READS declares the run setting(s) {', '.join(run)}, which reach the stage "
                         "without a declaration and enter no key; remove them from READS")
    return StageCode(str(script), reads, module_hashes(script, repo))


def _settings(code: StageCode, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The nested config subset the stage declares, without run settings."""
    out: dict[str, Any] = {}
    for key in code.reads:
        try:
            value = copy.deepcopy(get_dotted(cfg, key))
        except (KeyError, TypeError):
            raise ValueError(f"{code.script}: READS names {key!r}, which is not a config key") from None
        if isinstance(value, dict) and "." not in key:
            for name in RUN_SECTION_KEYS:
                value.pop(name, None)
        set_dotted(out, key, value)
    return out


def _run_settings(stage: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`loggers` and the run settings of the stage's own section (`<key>.run.json`)."""
    section = RUN_SECTION.get(stage, stage)
    own = {name: copy.deepcopy(cfg[section][name]) for name in RUN_SECTION_KEYS if name in cfg.get(section, {})}
    return {**{name: copy.deepcopy(cfg[name]) for name in RUN_KEYS}, **({section: own} if own else {})}


@dataclass(frozen=True)
class Job:
    """One planned stage output, shared by every variant that reaches the same key."""

    stage: str
    key: str
    path: str  # <results>/<stage dir>/<key>
    inputs: dict[str, Job]  # CLI flag (data, model, teacher, reward, eval) -> upstream job
    resolved: dict[str, Any]  # <key>.config.json: config subset + stage, key, upstream, code
    run: dict[str, Any]  # <key>.run.json: the run settings of the first variant that planned this key

    @property
    def config_path(self) -> str:
        return f"{self.path}{CONFIG_SUFFIX}"

    @property
    def run_path(self) -> str:
        return f"{self.path}{RUN_SUFFIX}"

    @property
    def resources(self) -> dict[str, Any]:
        return self.run[RUN_SECTION.get(self.stage, self.stage)]["resources"]

    def ref(self) -> dict[str, str]:
        return {"stage": self.stage, "key": self.key, "path": self.path}


@dataclass(frozen=True)
class VariantPlan:
    """What one variant runs: a job per stage, an eval per model stage, the export.

    `stages` is keyed by the job's role: its stage name, except `dpo_pairs` (`DPO_PAIRS`), the reward scoring
    whose samples pair up for on-policy DPO, beside grpo's own `reward`.
    """

    name: str
    overrides: dict[str, Any]
    stages: dict[str, Job]
    evals: dict[str, Job]
    export: Job

    def jobs(self) -> list[Job]:
        return [*self.stages.values(), *self.evals.values(), self.export]

    def previous(self) -> dict[str, str | None]:
        """Evaluated stage -> the one its model started from: what the report's deltas compare to.

        The first model stage starts from the base model (None unless `eval.base` evaluates it); distill from the
        student (`eval.base` evaluates it before distillation), else the teacher it learns from.
        """
        start = BASE if BASE in self.evals else None
        inputs = {stage: job.inputs.values() for stage, job in self.stages.items() if stage in MODEL_STAGES}
        previous = {stage: next((job.stage for job in jobs if job.stage in MODEL_STAGES), start)
                    for stage, jobs in inputs.items()}
        if STUDENT in self.evals:
            previous["distill"] = STUDENT
        return {**{zero: None for zero in (BASE, STUDENT) if zero in self.evals}, **previous}

    def manifest(self) -> dict[str, Any]:
        """The human view of the variant (results/variants/<name>/manifest.json)."""
        return {
            "variant": self.name,
            "overrides": self.overrides,
            "stages": {stage: job.ref() for stage, job in self.stages.items()},
            "eval": {stage: job.ref() for stage, job in self.evals.items()},
            "previous": self.previous(),
            "export": {**self.export.ref(), "stage": self.export.inputs["model"].stage},
        }


@dataclass
class Plan:
    """All variants' jobs, deduplicated by (stage, key)."""

    results: str
    repo: Path = REPO_ROOT  # whose stages/ and posttrain/ the keys' code records come from
    hashes: ContentHashes = field(default_factory=ContentHashes)  # of the user's files, cached by path and stat
    variants: dict[str, VariantPlan] = field(default_factory=dict)
    jobs: dict[str, dict[str, Job]] = field(default_factory=dict)  # stage -> key -> job
    _code: dict[str, StageCode] = field(default_factory=dict)

    def code(self, stage: str) -> StageCode:
        """The stage's `StageCode`, read once per plan."""
        if stage not in self._code:
            self._code[stage] = stage_code(self.repo, stage)
        return self._code[stage]

    def job(self, stage: str, key: str) -> Job:
        try:
            return self.jobs[stage][key]
        except KeyError:
            known = ", ".join(sorted(self.jobs.get(stage, {}))) or "none"
            raise KeyError(f"no {stage} output with key {key!r} in this config's plan (planned: {known})") from None

    def _add(self, stage: str, cfg: Mapping[str, Any], inputs: dict[str, Job]) -> Job:
        code = self.code(stage)
        upstream = {job.stage: job.key for job in inputs.values()}
        settings = without_unread_policy(stage, _settings(code, cfg))
        files = user_inputs(stage, settings, self.hashes, preset_names(), code_search_path(self.repo))
        key = stage_key(stage, settings, upstream, code.fingerprint, files)
        planned = self.jobs.setdefault(stage, {})
        if key not in planned:
            resolved: dict[str, Any] = {}
            for job in inputs.values():
                resolved = deep_union(resolved, {k: v for k, v in job.resolved.items() if k not in META_KEYS})
            resolved = deep_union(resolved, settings)
            resolved.update(stage=stage, key=key, upstream=upstream, code=code.record(), files=files)
            path = f"{self.results}/{STAGE_DIRS[stage]}/{key}"
            planned[key] = Job(stage, key, path, inputs, json.loads(canonical_json(resolved)), _run_settings(stage, cfg))
        return planned[key]

    def add_variant(self, variant: Variant) -> VariantPlan:
        """The variant's jobs: its `pipeline` of model stages in order, each from the model before it (the
        first from `model.policy`), before grpo the reward model (`reward_model.source: train`) and reward
        scoring, both from grpo's starting model, before dpo with `dpo.pairs: on_policy` reward scoring of
        dpo's starting model (its pairs), an eval of every
        model stage (and of the base with `eval.base`), the export of `export.stage` or the last stage."""
        cfg = variant.config
        data = self._add("prepare_data", cfg, {})
        stages: dict[str, Job] = {"prepare_data": data}
        models: dict[str, Job] = {}
        previous: Job | None = None  # the model the next stage starts from; None: model.policy
        for stage in cfg["pipeline"]:
            start = previous
            if stage == "distill" and cfg["distill"]["teacher_stage"]:
                start = models[cfg["distill"]["teacher_stage"]]  # preflight: listed before distill
            inputs = {"data": data, **({START_FLAGS[stage]: start} if start else {})}
            if stage == "dpo" and cfg["dpo"]["pairs"] == "on_policy":  # pairs of samples of the model it starts from
                stages[DPO_PAIRS] = inputs["pairs"] = self._add("reward", cfg, dict(inputs))
            if stage == "grpo":  # its reward model and prompts come from the policy it starts from
                if cfg["reward_model"]["source"] == "train":
                    stages["reward_model"] = inputs["reward_model"] = self._add("reward_model", cfg, dict(inputs))
                stages["reward"] = inputs["reward"] = self._add("reward", cfg, dict(inputs))  # episodes, with an environment
            models[stage] = stages[stage] = previous = self._add(stage, cfg, inputs)
        evals: dict[str, Job] = {}
        if cfg["eval"]["base"]:
            evals[BASE] = self._add("evaluate", cfg, {"data": data})
            if "distill" in models:  # the student before distillation: stage zero of a lineage that starts from it
                student = {**cfg, "model": {**cfg["model"], "policy": cfg["model"]["student"]}}
                evals[STUDENT] = self._add("evaluate", student, {"data": data})
        evals.update({stage: self._add("evaluate", cfg, {"data": data, "model": job}) for stage, job in models.items()})
        exported = cfg["export"]["stage"] or cfg["pipeline"][-1]  # preflight: a listed stage
        export = self._add("export", cfg, {"model": models[exported], "eval": evals[exported]})  # its card quotes the eval
        plan = VariantPlan(variant.name, variant.overrides, stages, evals, export)
        self.variants[variant.name] = plan
        return plan

    def files(self) -> dict[str, dict[str, Any]]:
        """Each planned config and run settings file: path relative to results -> JSON content.

        `<stage dir>/<key>.config.json` and `.run.json`; the report's are named by its key, like
        every other: two invocations with different ablation tables never overwrite each other's.
        """
        out: dict[str, dict[str, Any]] = {}
        for jobs in self.jobs.values():
            for job in jobs.values():
                name = f"{STAGE_DIRS[job.stage]}/{job.key}"
                out[name + CONFIG_SUFFIX], out[name + RUN_SUFFIX] = job.resolved, job.run
        report = self.report_config()
        out[f"report.{report['key']}{CONFIG_SUFFIX}"] = report  # the report has no run settings
        return out

    @property
    def report_config_path(self) -> str:
        return f"{self.results}/report.{self.report_config()['key']}{CONFIG_SUFFIX}"

    def eval_paths(self) -> list[str]:
        return sorted(job.path for job in self.jobs.get("evaluate", {}).values())

    def report_config(self) -> dict[str, Any]:
        """The report's resolved config: every variant's manifest, and the report's code record."""
        code = self.code("report")
        settings = _settings(code, {"variants": {name: plan.manifest() for name, plan in self.variants.items()}})
        key = stage_key("report", settings, {}, code.fingerprint)
        return {**settings, "stage": "report", "key": key, "upstream": {}, "code": code.record()}


def build_plan(cfg: Mapping[str, Any], schema_dir: str | Path = SCHEMA_DIR, repo: str | Path = REPO_ROOT,
               hash_cache: str | Path | None = None) -> Plan:
    """The plan of a validated config and its ablation table (checked against `schema_dir`'s schemas).

    `repo` holds the stage scripts and the `posttrain` sources whose code enters the keys: the
    workflow's own directory. `hash_cache`: the file that remembers the user's files' hashes between
    plannings (the workflow's is `<results>/.posttrain/content-hashes.json`; None: this process only).
    """
    hashes = ContentHashes(Path(hash_cache) if hash_cache else None)
    plan = Plan(results=cfg["results"].rstrip("/"), repo=Path(repo).resolve(), hashes=hashes)
    for variant in load_variants(cfg, schema_dir).values():
        plan.add_variant(variant)
    hashes.save()
    return plan
