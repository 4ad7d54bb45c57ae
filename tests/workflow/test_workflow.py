"""The workflow's Python side: config schema, ablation table, stage keys, launcher, views.

Fast (no Snakemake run); tests/workflow/test_workflow_snakemake.py drives the Snakefile itself.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from posttrain.workflow.ablations import parse_cell, read_ablations
from posttrain.workflow.schema import ConfigError, load_config, load_yaml, merge, schema_at, validate_config
from posttrain.workflow.launch import LaunchSpec, command_prefix, job_resources, spec_from_resources
from posttrain.workflow.plan import KEY_LENGTH, MODEL_STAGES, build_plan, pipeline_order
from posttrain.workflow.views import write_json, write_plan_files, write_variant_view

REPO = Path(__file__).resolve().parents[2]
BASE = load_config()


def cfg_with(**sections) -> dict:
    """The default config with `sections` deep-merged over it, no ablation table."""
    return validate_config(merge(BASE, {"ablations": None}, sections))


def error_text(cfg: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, where="test.yaml")
    return str(err.value)


def instruct_folder(tmp_path: Path, name: str = "instruct") -> str:
    """A stand-in for an instruct model's folder: planning reads its config.json and its chat template."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 512}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return str(folder)


def write_table(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ablations.tsv"
    path.write_text(textwrap.dedent(text).lstrip("\n").replace("|", "\t"))
    return path


# --- config schema ----------------------------------------------------------------------------


def test_schema_defaults_equal_the_default_config():
    assert validate_config({}) == BASE


@pytest.mark.parametrize("overlay", ["config/smoke.yaml", *sorted(str(p.relative_to(REPO)) for p in (REPO / "config/examples").glob("*.yaml"))])
def test_shipped_configs_validate(overlay):
    cfg = load_config(REPO / "config/config.yaml", REPO / overlay)
    build_plan(cfg)  # and plan (their ablations are null or a shipped table)


def test_example_is_real_scale():
    cfg = load_config(REPO / "config/config.yaml", REPO / "config/examples/qwen3-0.6b-8gpu.yaml")
    assert cfg["model"]["policy"] == "Qwen/Qwen3-0.6B"
    assert cfg["sft"]["resources"]["gpus"] == 8 and cfg["memory"]["mixed_precision"]
    assert any(s["path"] == "openai/gsm8k" and s["columns"] for s in cfg["data"]["sources"])


def test_unknown_key_names_path_and_suggests():
    text = error_text(merge(BASE, {"sft": {"lrr": 1e-3}}))
    assert "test.yaml: sft.lrr: unknown key (did you mean 'lr'?)" in text
    assert "allowed keys under 'sft':" in text and "warmup_steps" in text


def test_unknown_top_level_section():
    assert "grp: unknown key (did you mean 'grpo'?)" in error_text(merge(BASE, {"grp": {}}))


def test_bad_choice_lists_allowed_values():
    text = error_text(merge(BASE, {"grpo": {"mode": "asyncc"}}))
    assert 'grpo.mode: "asyncc" is not allowed; allowed values: "sync", "async"' in text


def test_null_is_listed_among_allowed_values():
    text = error_text(merge(BASE, {"memory": {"low_bit_optimizer": "adamw2bit"}}))
    assert 'allowed values: null, "adamw8bit", "adamw4bit"' in text


def test_every_problem_is_reported_at_once():
    text = error_text(merge(BASE, {"sft": {"lr": -1, "steps": "many"}, "dpo": {"loss": "hinge"}}))
    assert "3 problems" in text
    assert "sft.lr: -1 must be > 0" in text
    assert 'sft.steps: "many" is not of type integer' in text
    assert "dpo.loss" in text


def test_task_keys_are_checked_per_task():
    text = error_text(merge(BASE, {"data": {"tasks": [{"name": "sort", "lenght": 4}, {"name": "parity"}]}}))
    assert "data.tasks[0].lenght: unknown key (did you mean 'length'?)" in text
    assert 'data.tasks[1].name: "parity" is not allowed' in text


def test_cross_key_rules():
    text = error_text(merge(BASE, {
        "sft": {"resources": {"gpus": 2, "procs": 2}},
        "eval": {"pass_k": [1, 8], "samples": 4},
        "data": {"tasks": [], "sources": []},
    }))
    assert "sft.resources.procs" in text and "eval.pass_k: [8] exceed eval.samples = 4" in text
    assert "data.tasks: is empty and so is data.sources" in text


def test_defaults_fill_missing_keys_without_sharing_objects():
    a = validate_config({"sft": {"steps": 5}})
    b = validate_config({})
    assert a["sft"]["steps"] == 5 and a["sft"]["lr"] == BASE["sft"]["lr"]
    a["sft"]["lora"]["targets"].append("x")
    assert "x" not in b["sft"]["lora"]["targets"] and "x" not in validate_config({})["sft"]["lora"]["targets"]


def test_numbers_are_normalized_so_equal_configs_hash_equally():
    cfg = validate_config(merge(BASE, {"sft": {"lr": 1, "steps": 300.0}}))
    assert cfg["sft"]["lr"] == 1.0 and isinstance(cfg["sft"]["lr"], float)
    assert cfg["sft"]["steps"] == 300 and isinstance(cfg["sft"]["steps"], int)
    one = build_plan(cfg_with(sft={"lr": 1}))
    one_float = build_plan(cfg_with(sft={"lr": 1.0}))
    assert one.variants["default"].stages["sft"].key == one_float.variants["default"].stages["sft"].key


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft: {lr: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML"):
        load_yaml(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: must be a mapping"):
        load_yaml(bad)


# --- ablation table ---------------------------------------------------------------------------


def test_no_table_or_empty_table_is_one_default_variant(tmp_path):
    assert list(build_plan(cfg_with()).variants) == ["default"]
    header_only = write_table(tmp_path, "variant|sft.lr\n")
    assert list(build_plan(cfg_with(ablations=str(header_only))).variants) == ["default"]
    assert list(build_plan(cfg_with(ablations="")).variants) == ["default"]


def test_default_table_plans():
    plan = build_plan(BASE)
    assert list(plan.variants) == ["default", "distill_rkl"]
    assert plan.variants["distill_rkl"].overrides == {"distill.loss": "reverse_kl"}


def test_example_sweep_table_shares_the_prefix():
    plan = build_plan(cfg_with(ablations=str(REPO / "config/examples/ablations-grpo.tsv")))
    assert list(plan.variants) == ["g4", "g8", "g16"]
    assert len(plan.jobs["dpo"]) == 1 and len(plan.jobs["reward"]) == 1 and len(plan.jobs["grpo"]) == 3


def test_rl_methods_table_plans_one_sft_dpo_and_reward_job():
    plan = build_plan(cfg_with(ablations=str(REPO / "config/examples/ablations-rl.tsv")))
    assert list(plan.variants) == ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo", "ppo"]
    assert {stage: len(plan.jobs[stage]) for stage in ("prepare_data", "sft", "dpo", "reward", "grpo")} == {
        "prepare_data": 1, "sft": 1, "dpo": 1, "reward": 1, "grpo": 7}
    dapo = plan.variants["dapo"].stages["grpo"].resolved["grpo"]
    assert dapo["clip_eps_high"] == 0.28 and dapo["dynamic_sampling"] is True
    assert plan.variants["grpo"].stages["grpo"].resolved["grpo"]["dynamic_sampling"] is False


def test_rl_methods_at_three_seeds_share_each_seeds_prefix():
    overlay = load_yaml(REPO / "config/examples/rl-methods.yaml")
    plan = build_plan(cfg_with(**{**overlay, "ablations": str(REPO / overlay["ablations"])}))
    assert len(plan.variants) == 21
    assert {stage: len(plan.jobs[stage]) for stage in plan.jobs} == {
        "prepare_data": 3, "sft": 3, "dpo": 3, "reward": 3, "grpo": 21, "distill": 3, "export": 3, "evaluate": 30}
    groups = {}
    for name, variant in plan.variants.items():
        groups.setdefault(name.rsplit("-s", 1)[0], set()).add(variant.stages["grpo"].resolved["seed"])
    assert groups == {m: {1234, 1, 2} for m in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo", "ppo")}


def test_seed_table_replicates_the_default_pipeline(tmp_path):
    plan = build_plan(cfg_with(ablations=str(REPO / "config/seeds.tsv")))
    assert list(plan.variants) == ["seed1234", "seed1", "seed2"]
    assert [v.overrides for v in plan.variants.values()] == [{"seed": 1234}, {"seed": 1}, {"seed": 2}]
    assert [v.stages["sft"].resolved["seed"] for v in plan.variants.values()] == [1234, 1, 2]
    assert len(plan.jobs["prepare_data"]) == 3 and len(plan.jobs["distill"]) == 3  # the seed reaches every stage
    default = build_plan(cfg_with()).variants["default"]
    assert plan.variants["seed1234"].manifest()["stages"] == default.manifest()["stages"]  # 1234: config.yaml's
    assert "-1 must be >= 0" in table_error(tmp_path, "variant|seed\nneg|-1\n")


def test_manifest_names_each_models_previous_stage():
    assert build_plan(cfg_with()).variants["default"].manifest()["previous"] == {
        "sft": None, "dpo": "sft", "grpo": "dpo", "distill": "grpo"}
    taught_by_dpo = build_plan(cfg_with(distill={"teacher_stage": "dpo"})).variants["default"]
    assert taught_by_dpo.previous()["distill"] == "dpo"


def test_eval_base_evaluates_the_policy_before_sft_and_the_student_before_distillation():
    without, plan = build_plan(cfg_with()), build_plan(cfg_with(eval={"base": True}))
    default = plan.variants["default"]
    base, student = default.evals["base"], default.evals["student"]
    assert list(base.inputs) == ["data"] and base.resolved["model"]["policy"] == "tiny"
    # The student is evaluated as the stage zero of its own lineage: the policy it is scored as is model.student.
    assert list(student.inputs) == ["data"] and student.resolved["model"]["policy"] == "tiny-student"
    assert student.key != base.key
    assert len(plan.jobs["evaluate"]) == len(without.jobs["evaluate"]) + 2
    assert default.previous() == {"base": None, "student": None, "sft": "base", "dpo": "sft", "grpo": "dpo",
                                  "distill": "student"}
    assert default.evals["sft"].key == without.variants["default"].evals["sft"].key  # eval.base enters no other key
    no_distill = build_plan(cfg_with(eval={"base": True}, pipeline=["sft", "dpo"])).variants["default"]
    assert "student" not in no_distill.evals and "student" not in no_distill.previous()


def test_pipeline_order_is_the_dag_order():
    assert pipeline_order(["distill", "dpo", "grpo", "sft"]) == list(MODEL_STAGES) == ["sft", "dpo", "grpo", "distill"]
    assert pipeline_order(["grpo", "reward", "prepare_data"]) == ["prepare_data", "reward", "grpo"]
    assert pipeline_order(["sft", "base"]) == ["base", "sft"]
    with pytest.raises(ValueError, match="unknown stage.*rlhf"):
        pipeline_order(["sft", "rlhf"])


def test_cells_are_parsed_to_schema_types(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    instruct_folder(tmp_path, "1.5")  # a model folder whose name YAML would read as a number
    table = write_table(tmp_path, """
        # comment lines and blank lines are skipped
        variant|sft.lr|data.packing|eval.pass_k|model.policy|export.push_to_hub|grpo.group_size

        a|3e-4|false|[1, 2]|1.5|null|4
        b||||||
    """)
    variants = read_ablations(table, BASE)
    a = variants["a"]
    assert a.overrides == {"sft.lr": 3e-4, "data.packing": False, "eval.pass_k": [1, 2],
                           "model.policy": "1.5", "export.push_to_hub": None, "grpo.group_size": 4}
    assert a.config["sft"]["lr"] == 3e-4 and a.config["model"]["policy"] == "1.5"
    assert variants["b"].overrides == {} and variants["b"].config == BASE


def test_parse_cell_keeps_strings_for_string_keys():
    assert parse_cell("true", schema_at("model.student")) == "true"
    assert parse_cell("1e-5", schema_at("grpo.lr")) == 1e-5
    assert parse_cell("8.0", schema_at("grpo.group_size")) == 8
    with pytest.raises(ValueError, match="cannot parse"):
        parse_cell("[1, 2", schema_at("eval.pass_k"))


def table_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        read_ablations(write_table(tmp_path, text), BASE)
    return str(err.value)


def test_bad_value_names_line_variant_and_column(tmp_path):
    text = table_error(tmp_path, """
        variant|sft.lr|grpo.mode
        ok|1e-3|sync
        bad|-1|asyncc
    """)
    assert "ablations.tsv: 2 problems" in text
    assert "line 3 (variant 'bad'), column 'sft.lr': -1 must be > 0" in text
    assert "line 3 (variant 'bad'), column 'grpo.mode': \"asyncc\" is not allowed; allowed values: \"sync\", \"async\"" in text


def test_unknown_column_names_column_and_suggests(tmp_path):
    text = table_error(tmp_path, "variant|sft.lrr|grpo.group_size\na|1|4\n")
    assert "ablations.tsv line 1: column 2 'sft.lrr': is not a config key (did you mean 'sft.lr'?)" in text


@pytest.mark.parametrize("column", ["results", "ablations", "Sft.lr", "sft..lr", "sft.lr;x"])
def test_forbidden_or_malformed_columns(tmp_path, column):
    text = table_error(tmp_path, f"variant|{column}\na|1\n")
    assert f"column 2 {column!r}" in text


def test_first_column_must_be_variant_and_columns_unique(tmp_path):
    assert "the first column must be 'variant'" in table_error(tmp_path, "name|sft.lr\na|1\n")
    assert "column 3 'sft.lr': appears twice" in table_error(tmp_path, "variant|sft.lr|sft.lr\na|1|2\n")


@pytest.mark.parametrize("name", ["x; rm -rf ~", "..", ".hidden", "-rf", "a/b", "$(id)", "a b", "x" * 101])
def test_bad_variant_names_are_rejected(tmp_path, name):
    text = table_error(tmp_path, f"variant|sft.lr\nok|1\n{name}|2\n")
    assert f"line 3, column 'variant': variant name {name!r} must be" in text


def test_empty_variant_name_and_duplicates(tmp_path):
    assert "variant name '' must be" in table_error(tmp_path, "variant|sft.lr\n|1\n")
    assert "line 3 (variant 'a'): duplicate variant name (first on line 2)" in table_error(tmp_path, "variant|sft.lr\na|1\na|2\n")


def test_row_with_too_many_cells(tmp_path):
    assert "line 2: 3 cells but the header has 2 columns" in table_error(tmp_path, "variant|sft.lr\na|1|2\n")


def test_cross_key_problem_caused_by_a_variant(tmp_path):
    text = table_error(tmp_path, "variant|eval.samples\nfew|1\n")
    assert "line 2 (variant 'few'): eval.pass_k: [4] exceed eval.samples = 1" in text


def test_missing_table_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.tsv: cannot read the ablation table"):
        build_plan(cfg_with(ablations=str(tmp_path / "nope.tsv")))


# --- stage keys and the plan ------------------------------------------------------------------


def grpo_sweep(tmp_path: Path, sizes=(4, 8, 16)) -> dict:
    rows = "".join(f"g{s}|{s}\n" for s in sizes)
    return cfg_with(ablations=str(write_table(tmp_path, "variant|grpo.group_size\n" + rows)))


def test_variants_differing_in_grpo_share_the_prefix(tmp_path):
    plan = build_plan(grpo_sweep(tmp_path))
    counts = {stage: len(jobs) for stage, jobs in plan.jobs.items()}
    assert counts == {"prepare_data": 1, "sft": 1, "dpo": 1, "reward": 1, "grpo": 3, "distill": 3,
                      "evaluate": 1 + 1 + 3 + 3, "export": 3}
    keys = {name: {s: j.key for s, j in v.stages.items()} for name, v in plan.variants.items()}
    assert keys["g4"]["sft"] == keys["g16"]["sft"] and keys["g4"]["grpo"] != keys["g16"]["grpo"]


def stage_keys(cfg: dict) -> dict[str, str]:
    v = build_plan(cfg).variants["default"]
    return {**{s: j.key for s, j in v.stages.items()}, **{f"eval_{s}": j.key for s, j in v.evals.items()},
            "export": v.export.key}


def changed(a: dict, b: dict) -> set[str]:
    return {stage for stage in a if a[stage] != b[stage]}


def test_a_change_moves_exactly_the_downstream_keys():
    base = stage_keys(cfg_with())
    everything_after_sft = set(base) - {"prepare_data"}
    assert changed(base, stage_keys(cfg_with(sft={"lr": 1e-3}))) == everything_after_sft
    evals = {"eval_sft", "eval_dpo", "eval_grpo", "eval_distill", "export"}  # export quotes its eval
    assert changed(base, stage_keys(cfg_with(eval={"max_new_tokens": 16}))) == evals
    assert changed(base, stage_keys(cfg_with(grpo={"group_size": 4}))) == {"grpo", "distill", "eval_grpo", "eval_distill", "export"}
    assert changed(base, stage_keys(cfg_with(model={"student": "tiny"}))) == {"distill", "eval_distill", "export"}
    assert changed(base, stage_keys(cfg_with(export={"dtype": "float32"}))) == {"export"}
    assert changed(base, stage_keys(cfg_with(data={"n_sft": 100}))) == set(base)
    assert changed(base, stage_keys(cfg_with(seed=7))) == set(base)


RUN_SETTINGS = {"loggers": ["tensorboard"], "sft": {"resources": {"gpus": 8, "cpus": 32}, "log_every": 3, "checkpoint_every": 7},
                "data": {"resources": {"mem_mb": 1}}, "grpo": {"log_every": 2, "checkpoint_every": 3}}


def test_run_settings_are_not_part_of_keys_or_configs():
    base = build_plan(cfg_with())
    cfg = cfg_with(**RUN_SETTINGS)
    more = build_plan(cfg)
    assert stage_keys(cfg_with()) == stage_keys(cfg)
    sft = more.variants["default"].stages["sft"]
    assert sft.resources["gpus"] == 8 and base.variants["default"].stages["sft"].resources["gpus"] == 0
    own = {name: cfg["sft"][name] for name in ("resources", "log_every", "checkpoint_every")}
    assert sft.run == {"loggers": ["tensorboard"], "sft": own}  # loggers and its own section's
    assert more.variants["default"].stages["prepare_data"].run["data"]["resources"]["mem_mb"] == 1
    assert more.variants["default"].evals["sft"].run["eval"]["resources"] == BASE["eval"]["resources"]
    for jobs in more.jobs.values():
        for job in jobs.values():
            assert "loggers" not in job.resolved
            assert all(not {"resources", "log_every", "checkpoint_every"} & set(section)
                       for section in job.resolved.values() if isinstance(section, dict))


def test_resolved_config_contract(tmp_path):
    plan = build_plan(grpo_sweep(tmp_path))
    g4, g8 = plan.variants["g4"], plan.variants["g8"]
    sft, grpo = g4.stages["sft"], g4.stages["grpo"]
    assert len(sft.key) == KEY_LENGTH and all(c in "0123456789abcdef" for c in sft.key)
    assert sft.path == f"results/sft/{sft.key}" and sft.config_path == f"results/sft/{sft.key}.config.json"
    assert sft.resolved["stage"] == "sft" and sft.resolved["key"] == sft.key
    assert sft.resolved["upstream"] == {"prepare_data": g4.stages["prepare_data"].key}
    assert set(sft.resolved) == {"seed", "model", "data", "memory", "parallel", "sft", "stage", "key", "upstream", "code", "files"}
    assert sft.resolved["files"] == {}  # a preset model and built-in tasks: no file of the user's
    assert "student" not in sft.resolved["model"]  # only distill reads the student
    assert grpo.resolved["upstream"] == {"prepare_data": g4.stages["prepare_data"].key, "dpo": g4.stages["dpo"].key,
                                         "reward": g4.stages["reward"].key}
    assert grpo.resolved["grpo"]["group_size"] == 4 and grpo.resolved["reward"] == g4.stages["reward"].resolved["reward"]
    assert g4.evals["sft"].resolved["reward"]["verifiers"] == ["task"]  # evaluate scores with the verifiers
    sft_taught = build_plan(cfg_with(distill={"teacher_stage": "sft"})).variants["default"].stages["distill"]
    assert sft_taught.resolved["reward"] == {"verifiers": ["task"]}  # and so does distill's greedy eval
    assert g4.stages["sft"].resolved == g8.stages["sft"].resolved  # a pure function of the key
    assert set(g4.export.inputs) == {"model", "eval"} and g4.export.inputs["model"].stage == "distill"
    assert json.loads(json.dumps(sft.resolved)) == sft.resolved


def test_distill_teacher_and_export_stage_follow_the_config():
    v = build_plan(cfg_with(distill={"teacher_stage": "dpo"}, export={"stage": "grpo"})).variants["default"]
    assert v.stages["distill"].inputs["teacher"] is v.stages["dpo"]
    assert v.export.inputs["model"] is v.stages["grpo"] and v.export.inputs["eval"] is v.evals["grpo"]
    assert v.manifest()["export"]["stage"] == "grpo"


def test_on_policy_dpo_trains_on_pairs_sampled_from_the_model_it_starts_from():
    v = build_plan(cfg_with(dpo={"pairs": "on_policy"})).variants["default"]
    dpo, pairs = v.stages["dpo"], v.stages["dpo"].inputs["pairs"]
    assert pairs.stage == "reward" and pairs.inputs["model"] is dpo.inputs["model"] is v.stages["sft"]
    assert dpo.resolved["upstream"]["reward"] == pairs.key
    assert v.stages["grpo"].inputs["reward"].inputs["model"] is dpo  # grpo's prompts still come from its own start
    manifest = v.manifest()["stages"]  # both scorings, each under its own name
    assert manifest["dpo_pairs"] == {"stage": "reward", "key": pairs.key, "path": pairs.path}
    assert manifest["reward"]["key"] == v.stages["grpo"].inputs["reward"].key != pairs.key
    offline = build_plan(cfg_with()).variants["default"].stages["dpo"]
    assert "pairs" not in offline.inputs


def job_counts(plan) -> dict[str, int]:
    return {stage: len(jobs) for stage, jobs in plan.jobs.items()}




@pytest.mark.parametrize("pipeline, counts", [
    (["sft"], {"prepare_data": 1, "sft": 1, "evaluate": 1, "export": 1}),
    (["dpo"], {"prepare_data": 1, "dpo": 1, "evaluate": 1, "export": 1}),
    (["grpo"], {"prepare_data": 1, "reward": 1, "grpo": 1, "evaluate": 1, "export": 1}),
    (["sft", "grpo"], {"prepare_data": 1, "sft": 1, "reward": 1, "grpo": 1, "evaluate": 2, "export": 1}),
    (["sft", "dpo", "grpo", "distill"], {"prepare_data": 1, "sft": 1, "dpo": 1, "reward": 1, "grpo": 1, "distill": 1,
                                         "evaluate": 4, "export": 1}),
])
def test_pipeline_plans_its_stages_each_from_the_one_before(pipeline, counts, tmp_path):
    v = build_plan(cfg_with(pipeline=pipeline, model={"policy": instruct_folder(tmp_path)})).variants["default"]
    assert job_counts(build_plan(cfg_with(pipeline=pipeline, model={"policy": instruct_folder(tmp_path)}))) == counts
    first = v.stages[pipeline[0]]
    assert "model" not in first.inputs and "teacher" not in first.inputs  # the first starts from model.policy
    for before, stage in zip(pipeline, pipeline[1:]):
        assert v.stages[stage].inputs.get("model", v.stages[stage].inputs.get("teacher")) is v.stages[before]
    if "grpo" in pipeline:  # reward scoring samples the policy grpo starts from
        grpo, reward = v.stages["grpo"], v.stages["reward"]
        assert grpo.inputs["reward"] is reward and reward.inputs.get("model") is grpo.inputs.get("model")
    assert set(v.evals) == set(pipeline) and v.export.inputs["model"] is v.stages[pipeline[-1]]
    assert v.previous()[pipeline[0]] is None and all(v.previous()[b] == a for a, b in zip(pipeline, pipeline[1:]))


def test_a_trained_reward_model_is_its_own_stage_before_reward_scoring_and_grpo():
    v = build_plan(cfg_with(reward_model={"source": "train"})).variants["default"]
    rm, reward, grpo = (v.stages[s] for s in ("reward_model", "reward", "grpo"))
    assert rm.inputs == {"data": v.stages["prepare_data"], "model": v.stages["dpo"]}  # from grpo's starting policy
    assert reward.inputs["reward_model"] is rm and grpo.inputs["reward_model"] is rm
    assert "reward_model" not in build_plan(cfg_with()).variants["default"].stages  # source null: no such job
    assert rm.resolved["reward_model"]["source"] == "train" and "reward_model" not in v.stages["sft"].resolved


def test_shipped_pipeline_examples_plan_their_shapes():
    shapes = {"sft-only.yaml": ["sft"], "dpo-only.yaml": ["dpo"], "grpo-from-instruct.yaml": ["grpo"],
              "sft-grpo.yaml": ["sft", "grpo"]}
    for name, pipeline in shapes.items():
        plan = build_plan(load_config(REPO / "config/config.yaml", REPO / "config/examples" / name))
        assert [s for s in plan.variants["default"].stages if s not in ("prepare_data", "reward")] == pipeline, name
        assert job_counts(plan)["evaluate"] == len(pipeline) + ("base" in plan.variants["default"].evals)


def test_pipeline_column_varies_the_stage_graph_and_shares_the_prefix(tmp_path):
    table = REPO / "config/examples/ablations-pipeline.tsv"  # with_dpo, without_dpo, grpo_only
    plan = build_plan(cfg_with(ablations=str(table), model={"policy": instruct_folder(tmp_path)}))
    # One SFT (and its eval) shared by the two variants that start with it; grpo_only starts grpo (and its
    # reward scoring) from model.policy; each grpo starts from another model, so three of each.
    assert job_counts(plan) == {"prepare_data": 1, "sft": 1, "dpo": 1, "reward": 3, "grpo": 3, "evaluate": 5, "export": 3}
    with_dpo, without, alone = (plan.variants[n] for n in ("sft_dpo_grpo", "sft_grpo", "grpo_only"))
    assert with_dpo.stages["sft"] is without.stages["sft"] and "sft" not in alone.stages
    assert with_dpo.stages["grpo"].inputs["model"] is with_dpo.stages["dpo"]
    assert without.stages["grpo"].inputs["model"] is without.stages["sft"] and "model" not in alone.stages["grpo"].inputs
    assert without.previous()["grpo"] == "sft" and alone.previous()["grpo"] is None


@pytest.mark.parametrize("sections, key, words", [
    ({"pipeline": ["sft", "distill"], "distill": {"teacher_stage": "grpo"}}, "distill.teacher_stage", "not listed before distill"),
    ({"pipeline": ["distill", "sft"], "distill": {"teacher_stage": "sft"}}, "distill.teacher_stage", "not listed before distill"),
    ({"pipeline": ["sft", "dpo"], "export": {"stage": "grpo"}}, "export.stage", "is not in pipeline"),
    ({"pipeline": ["grpo"]}, "pipeline", "a preset (random weights)"),
    ({"pipeline": ["sft", "sft"]}, "pipeline", "unique"),
    ({"pipeline": []}, "pipeline", ""),
])
def test_pipeline_errors_name_the_key(sections, key, words):
    text = error_text(merge(BASE, {"ablations": None}, sections))
    assert key in text and words in text, text


def test_results_root_is_configurable():
    v = build_plan(cfg_with(results="/scratch/me/runs/")).variants["default"]
    assert v.stages["sft"].path.startswith("/scratch/me/runs/sft/")
    assert "results: " in error_text(merge(BASE, {"results": "a b"}))


def test_report_config_lists_every_variant(tmp_path):
    plan = build_plan(grpo_sweep(tmp_path))
    report = plan.report_config()
    assert plan.files()[f"report.{report['key']}.config.json"] == report
    assert plan.report_config_path == f"results/report.{report['key']}.config.json"
    assert report["stage"] == "report" and list(report["variants"]) == ["g4", "g8", "g16"]
    manifest = report["variants"]["g8"]
    assert manifest["overrides"] == {"grpo.group_size": 8}
    assert manifest["stages"]["grpo"]["path"] == plan.variants["g8"].stages["grpo"].path
    assert set(manifest["eval"]) == {"sft", "dpo", "grpo", "distill"}
    assert plan.eval_paths() == sorted({j.path for v in plan.variants.values() for j in v.evals.values()})


# --- launcher ---------------------------------------------------------------------------------

ENV = "PYTHONPATH=/repo${PYTHONPATH:+:$PYTHONPATH}"
TORCHRUN = "python -m torch.distributed.run"  # torchrun from the same interpreter


@pytest.mark.parametrize(("spec", "expected"), [
    (LaunchSpec(threads=2), f"{ENV} OMP_NUM_THREADS=2 python"),
    (LaunchSpec(procs=2, threads=2), f"{ENV} OMP_NUM_THREADS=1 {TORCHRUN} --standalone --nnodes 1 --nproc-per-node 2"),
    (LaunchSpec(gpus=1, threads=8), f"{ENV} OMP_NUM_THREADS=8 {TORCHRUN} --standalone --nnodes 1 --nproc-per-node 1"),
    (LaunchSpec(gpus=8, threads=64), f"{ENV} OMP_NUM_THREADS=8 {TORCHRUN} --standalone --nnodes 1 --nproc-per-node 8"),
])
def test_single_node_commands(spec, expected):
    assert command_prefix(spec, "/repo") == expected


def test_multi_node_command():
    words = shlex.split(command_prefix(LaunchSpec(nodes=4, gpus=8, threads=64), "/repo"))
    assert words[:2] == ["PYTHONPATH=/repo${PYTHONPATH:+:$PYTHONPATH}", "OMP_NUM_THREADS=8"]
    assert words[2:9] == ["srun", "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--cpus-per-task=64",
                          "--gres=gpu:8", "--kill-on-bad-exit=1"]
    assert words[9:11] == ["sh", "-c"] and words[12] == "torchrun"
    assert words[11].startswith(f'exec {TORCHRUN} --nnodes 4 --nproc-per-node 8 --node-rank "$SLURM_NODEID"')


def test_stages_start_with_the_interpreter_given():
    """The workflow passes the interpreter Snakemake runs in: a venv's, whether or not it is activated."""
    prefix = command_prefix(LaunchSpec(procs=2, threads=2), "/repo", python="/opt/my venv/bin/python")
    assert shlex.split(prefix)[2:5] == ["/opt/my venv/bin/python", "-m", "torch.distributed.run"]


def test_multi_node_command_runs_one_torchrun_per_node(tmp_path):
    """Fake srun/scontrol/python on PATH: node k's torchrun is node rank k, every node gets the first
    node's address (its NodeAddr, not its name) and a port offset by the job id, and the script's
    arguments arrive intact (quoting survives `sh -c`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        # srun: run the command once per node with the variables srun sets for its tasks
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                'for node in 0 1; do SLURM_JOB_NODELIST="gpu[07-08]" SLURM_NODEID=$node "$@" || exit 1; done',
        "scontrol": 'case "$*" in\n'
                    '  "show hostnames gpu[07-08]") printf "gpu07\\ngpu08\\n" ;;\n'
                    '  "show node gpu07 -o") echo "NodeName=gpu07 Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName=gpu07" ;;\n'
                    '  *) exit 1 ;;\n'
                    'esac',
        # python -m torch.distributed.run (torchrun from the workflow's interpreter)
        "python": '[ "$1 $2" = "-m torch.distributed.run" ] || exit 1; shift 2\n'
                  'printf "%s\\n" "node=$SLURM_NODEID" "$@" >> "$TORCHRUN_LOG"',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    prefix = command_prefix(LaunchSpec(nodes=2, gpus=4, threads=16), "/repo with space")
    log = tmp_path / "torchrun.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "TORCHRUN_LOG": str(log)}
    subprocess.run(["bash", "-c", f"{prefix} stages/sft.py --config {shlex.quote('cfg dir/x.json')} --out o"],
                   env=env, check=True)
    def args(rank: int) -> list[str]:
        return ["--nnodes", "2", "--nproc-per-node", "4", "--node-rank", str(rank), "--master-addr", "10.0.0.7",
                "--master-port", str(29500 + 4242), "stages/sft.py", "--config", "cfg dir/x.json", "--out", "o"]

    assert log.read_text().splitlines() == ["node=0", *args(0), "node=1", *args(1)]


def test_generator_nodes_run_ray_workers_and_the_first_node_a_ray_head(tmp_path):
    """Fake srun/scontrol/python: with generator_nodes 1 of 3, nodes 0 and 1 run torchrun over two
    nodes, node 2 a Ray worker; node 0 starts the Ray head first and stops it after; all see one RAY_ADDRESS."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                'for node in 0 1 2; do SLURM_JOB_NODELIST="c[1-3]" SLURM_NODEID=$node "$@" || exit 1; done',
        "scontrol": 'case "$*" in\n'
                    '  "show hostnames c[1-3]") printf "c1\\nc2\\nc3\\n" ;;\n'
                    '  "show node c1 -o") echo "NodeName=c1 NodeAddr=10.0.0.1" ;;\n'
                    '  *) exit 1 ;;\n'
                    'esac',
        "python": 'if [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2\n'
                  '  echo "node=$SLURM_NODEID torchrun $RAY_ADDRESS $*" >> "$LOG"; exit 0; fi\n'
                  'echo "node=$SLURM_NODEID python $*" >> "$LOG"; [ "$3" = head ] && exec sleep 30; exit 0',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    prefix = command_prefix(LaunchSpec(nodes=3, procs=1, threads=2, generator_nodes=1), "/repo")
    log = tmp_path / "launch.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "LOG": str(log)}
    subprocess.run(["bash", "-c", f"{prefix} stages/grpo.py --out o"], env=env, check=True, timeout=20)
    lines = log.read_text().splitlines()
    ray = "--address 10.0.0.1:39507"
    assert f"node=0 python -m posttrain.rl.ray_node head {ray} --temp-dir /tmp/posttrain-ray-7-0" in lines
    assert "node=0 torchrun 10.0.0.1:39507 --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 10.0.0.1 " \
           "--master-port 29507 stages/grpo.py --out o" in lines
    assert any(line.startswith("node=1 torchrun 10.0.0.1:39507 --nnodes 2") and "--node-rank 1" in line for line in lines)
    assert f"node=2 python -m posttrain.rl.ray_node worker {ray} --temp-dir /tmp/posttrain-ray-7-2 --cpus 2" in lines
    assert not any(line.startswith("node=2 torchrun") for line in lines) and len(lines) == 4
    with pytest.raises(ValueError, match="leaves none of the 2 nodes to train on"):
        LaunchSpec(nodes=2, generator_nodes=2)


def test_launch_spec_rejects_bad_values():
    for bad in ({"nodes": 0}, {"gpus": -1}, {"procs": "2; rm -rf ~"}, {"threads": True}, {"gpus": 2, "procs": 2}):
        with pytest.raises(ValueError, match="launch:"):
            LaunchSpec(**bad)
    with pytest.raises(ValueError, match="gres"):
        spec_from_resources({"gres": "gpu:8;id"}, threads=1)


def test_job_resources_round_trip_to_the_launch_spec():
    for res in ({"nodes": 1, "gpus": 0, "procs": 2}, {"nodes": 1, "gpus": 8, "procs": 1}, {"nodes": 3, "gpus": 4, "procs": 1}):
        resources = {k: v for k, v in job_resources({**res, "mem_mb": 1000, "runtime": 5}).items() if v is not None}
        spec = spec_from_resources(resources, threads=4)
        assert (spec.nodes, spec.gpus, spec.procs) == (res["nodes"], res["gpus"], res["procs"])
    assert spec_from_resources({"gres": "gpu:a100:2", "nodes": 2}, 1).gpus == 2


class _Resources(dict):
    """Enough of Snakemake's job resources for the slurm plugin: `.get` and attribute access."""

    __getattr__ = dict.__getitem__


def sbatch_flags(res: dict, threads: int) -> str:
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    resources = _Resources({k: v for k, v in job_resources({**res, "mem_mb": 8000, "runtime": 60}).items() if v is not None})
    job = SimpleNamespace(resources=resources, threads=threads)
    params = {"run_uuid": "u", "slurm_logfile": "l", "comment_str": "c", "account": "", "partition": "", "workdir": ""}
    return get_submit_command(job, params) + set_gres_string(job)


def test_slurm_plugin_reads_the_job_resources():
    cpu = sbatch_flags({"nodes": 1, "gpus": 0, "procs": 1}, threads=2)
    assert "--nodes=1" in cpu and "--ntasks=1" in cpu and "--cpus-per-task=2" in cpu and "--mem 8000" in cpu
    assert "-t 60" in cpu and "gpu" not in cpu
    one_node = sbatch_flags({"nodes": 1, "gpus": 8, "procs": 1}, threads=64)
    assert "--gpus=8" in one_node and "--ntasks" not in one_node and "--cpus-per-task=64" in one_node
    multi = sbatch_flags({"nodes": 2, "gpus": 8, "procs": 1}, threads=64)
    assert "--nodes=2" in multi and "--ntasks=2" in multi and "--gres=gpu:8" in multi
    assert "--gpus=" not in multi and "--ntasks-per-gpu" not in multi


# --- views ------------------------------------------------------------------------------------


def test_write_json_leaves_identical_files_alone(tmp_path):
    path = tmp_path / "a" / "x.json"
    assert write_json(path, {"b": 1, "a": [1]})
    os.utime(path, (1, 1))
    assert not write_json(path, {"a": [1], "b": 1}) and path.stat().st_mtime == 1
    assert write_json(path, {"a": 2}) and json.loads(path.read_text()) == {"a": 2}


def test_plan_files_and_variant_view(tmp_path):
    plan = build_plan(grpo_sweep(tmp_path))
    results = str(tmp_path / "results")
    assert write_plan_files(results, plan.files()) == len(plan.files())
    assert write_plan_files(results, plan.files()) == 0
    sft = plan.variants["g4"].stages["sft"]
    written = json.loads((tmp_path / "results" / "sft" / f"{sft.key}.config.json").read_text())
    assert written == sft.resolved
    assert json.loads((tmp_path / "results" / "sft" / f"{sft.key}.run.json").read_text()) == sft.run
    manifest = copy.deepcopy(plan.variants["g4"].manifest())
    for group in ("stages", "eval"):
        for ref in manifest[group].values():
            ref["path"] = ref["path"].replace("results", results, 1)
            Path(ref["path"]).mkdir(parents=True, exist_ok=True)
    manifest["export"]["path"] = manifest["export"]["path"].replace("results", results, 1)
    out = tmp_path / "results" / "variants" / "g4"
    write_variant_view(out, manifest)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert os.readlink(out / "sft") == f"../../sft/{sft.key}" and (out / "sft").is_dir()
    assert (out / "eval-grpo").is_dir() and os.readlink(out / "export").startswith("../../export/")


# --- environments -----------------------------------------------------------------------------


def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.strip()
        if line and not line.startswith(("#", "-")) and "==" in line:
            name, version = line.split("==")
            out[name.lower()] = version
    return out


def test_environment_pins_agree():
    cpu = pins((REPO / "envs/cpu.txt").read_text().splitlines())
    lock = pins((REPO / "envs/cuda-lock.txt").read_text().splitlines())
    conda = yaml.safe_load((REPO / "envs/cuda.yaml").read_text())
    conda_pip = pins(next(d for d in conda["dependencies"] if isinstance(d, dict))["pip"])
    assert cpu["torch"] == lock["torch"] + "+cpu"
    assert {k: v for k, v in cpu.items() if k in lock and k != "torch"} == {k: v for k, v in lock.items() if k != "torch"}
    assert conda_pip.items() <= lock.items() and "torch" in conda_pip
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"snakemake=={cpu["snakemake"]}"' in pyproject and f'"torch=={lock["torch"]}"' in pyproject
    # every runtime dependency is in each cluster environment (a stage imports it: math-verify for `math`)
    required = {re.split(r"[<>=!~\[ ;]", d)[0].lower().replace("_", "-")
                for d in tomllib.loads(pyproject)["project"]["dependencies"]}
    for name, env in (("envs/cpu.txt", cpu), ("envs/cuda-lock.txt", lock), ("envs/cuda.yaml", conda_pip)):
        listed = {k.replace("_", "-") for k in env}
        assert required - {"snakemake", "snakemake-executor-plugin-slurm"} <= listed | {"torch"}, (name, sorted(required - listed))
