"""What a stage would refuse when it starts is refused when the plan is built, naming the config key
(and the ablation row), so that nothing fails after waiting in a cluster's queue."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.workflow.ablations import load_variants
from posttrain.workflow.schema import ConfigError, load_config, validate_config

REPO = Path(__file__).resolve().parents[2]
BASE = load_config(REPO / "config" / "config.yaml")


def _problems(**sections) -> str:
    cfg = copy.deepcopy(BASE)
    for section, values in sections.items():
        for key, value in values.items():
            if isinstance(value, dict):
                cfg[section][key].update(value)
            else:
                cfg[section][key] = value
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, where="test.yaml")
    return str(err.value)


def test_optimizer_in_backward_with_clipping_or_accumulation_is_refused_per_stage():
    text = _problems(memory={"optimizer_in_backward": True}, sft={"grad_accum": 2, "batch_size": 16})
    assert "sft.grad_accum: 2: memory.optimizer_in_backward steps every parameter during backward" in text
    for stage in ("sft", "dpo", "grpo", "distill"):
        assert f"{stage}.max_grad_norm: 1.0: memory.optimizer_in_backward frees each gradient" in text
    assert "grpo.micro_batch_size: 64: memory.optimizer_in_backward steps during backward, so a step must be one " \
           "micro-batch: at least 128" in text
    # null turns clipping off (the schema used to refuse the value the error message advised)
    fixed = copy.deepcopy(BASE)
    fixed["memory"]["optimizer_in_backward"] = True
    for stage in ("sft", "dpo", "grpo", "distill"):
        fixed[stage]["max_grad_norm"] = None
    fixed["grpo"]["micro_batch_size"] = 128
    assert validate_config(fixed)["sft"]["max_grad_norm"] is None


def test_batches_that_do_not_split_over_the_processes_are_refused():
    text = _problems(sft={"resources": {"procs": 3}}, grpo={"resources": {"nodes": 2, "procs": 3}})
    assert "sft.batch_size: 16 is not divisible by sft.grad_accum (1) x 3 data-parallel processes" in text
    assert "grpo.prompts_per_step: 16 does not split over 6 data-parallel processes" in text
    text = _problems(parallel={"tp": 2}, dpo={"method": "lora"})
    assert "dpo.method: lora: tensor parallelism does not support LoRA/QLoRA adapters" in text
    assert "sft.resources: 1 processes: parallel.tp (2) x parallel.cp (1) x parallel.dp_replicate (1) = 2 does not " \
           "divide the world size 1" in text


def test_the_rules_of_a_stage_the_pipeline_leaves_out_refuse_nothing():
    """Tensor parallelism over SFT's two processes, as a one-stage pipeline: the other stages' one-process resources
    and their settings are not refused, since they do not run; in the default pipeline they are, by name."""
    one_stage = copy.deepcopy(BASE)
    one_stage.update(pipeline=["sft"])
    one_stage["parallel"]["tp"] = 2
    one_stage["sft"]["resources"]["procs"] = 2
    one_stage["dpo"]["method"] = "lora"  # refused with tp, but DPO does not run
    assert validate_config(one_stage)["pipeline"] == ["sft"]
    text = _problems(parallel={"tp": 2}, sft={"resources": {"procs": 2}}, dpo={"method": "lora"})
    assert "sft.resources" not in text and "dpo.resources: 1 processes: parallel.tp (2)" in text
    assert "dpo.method: lora: tensor parallelism does not support LoRA/QLoRA adapters" in text


def test_expert_and_context_parallel_layouts_the_mesh_refuses_are_refused():
    text = _problems(parallel={"cp": 2, "ep": 2}, sft={"resources": {"procs": 4}})
    assert "parallel.ep: parallel.ep (2) and parallel.cp (2): expert and context parallelism do not combine yet" in text
    text = _problems(parallel={"ep": 4}, sft={"resources": {"procs": 2}})
    assert "sft.resources: 2 processes: parallel.ep (4) must divide the 2 FSDP shards" in text
    text = _problems(parallel={"cp": 2}, sft={"resources": {"procs": 2}, "batch_size": 3})
    assert "sft.batch_size" not in text  # context-parallel ranks read the same rows: one data-parallel process
    assert "dpo.resources: 1 processes: parallel.tp (1) x parallel.cp (2)" in text


def test_ppo_and_kto_settings_the_stages_refuse_are_refused_at_plan_time():
    text = _problems(grpo={"advantage": "gae", "ratio": "sequence", "critic_init": "reward_model",
                           "resources": {"procs": 2}}, dpo={"loss": "kto", "pairs": "on_policy"}, parallel={"tp": 2})
    assert "parallel.tp: 2: PPO (grpo.advantage: gae) shards its critic with data parallelism only" in text
    assert "grpo.ratio: sequence: PPO's advantages are per token" in text
    assert "grpo.critic_init: reward_model: there is no reward model; set reward_model.source: train" in text
    assert "grpo.rm_weight: 0.5: there is no reward model to weigh" in _problems(grpo={"rm_weight": 0.5})
    assert "dpo.pairs: on_policy: KTO (dpo.loss: kto) trains on the prepared unpaired split" in text


def test_missing_model_and_data_sources_are_named(tmp_path, monkeypatch):
    text = _problems(model={"policy": "/nonexistent/model", "student": str(tmp_path / "student")},
                     data={"sources": [{"path": str(tmp_path / "rows.jsonl"), "kind": "sft"}]})
    assert "model.policy: /nonexistent/model: no such folder" in text
    assert f"model.student: {tmp_path / 'student'}: no such folder" in text
    assert f"data.sources[0].path: {tmp_path / 'rows.jsonl'}: no such file" in text
    import datasets

    folder = tmp_path / "saved"  # a datasets.save_to_disk folder, by an absolute path: read, and its rows are good
    datasets.Dataset.from_list([{"prompt": "Q", "completion": "A"}]).save_to_disk(str(folder))
    assert "data.sources" not in _problems(model={"policy": "/nonexistent/model"},
                                           data={"sources": [{"path": str(folder), "kind": "sft"}]})
    empty = tmp_path / "empty"
    assert f"data.sources[0]: data source {empty} (local dataset folder" in _problems(
        data={"sources": [{"path": str(empty.mkdir() or empty), "kind": "sft"}]})
    assert f"data.sources[0].path: {tmp_path / 'gone'}: no such file or folder" in _problems(
        data={"sources": [{"path": str(tmp_path / "gone"), "kind": "sft"}]})
    monkeypatch.chdir(tmp_path)  # a relative `folder/name` beside that folder is a path, not a hub id to fetch
    (tmp_path / "models").mkdir()
    assert ("model.student: models/pruned: no such folder (models/ is a folder here, so this names a path in it, "
            "not a hub id)") in _problems(model={"student": "models/pruned"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    text = _problems(model={"policy": "Qwen/Qwen3-0.6B"})
    assert "model.policy: Qwen/Qwen3-0.6B: HF_HUB_OFFLINE is set and this hub id is not in the local cache" in text


def test_an_ablation_row_that_breaks_a_stage_rule_is_named_by_line_and_column(tmp_path):
    table = tmp_path / "ablations.tsv"
    table.write_text("variant\tmemory.optimizer_in_backward\tsft.max_grad_norm\n"
                     "ok\tfalse\t\n"
                     "bad\ttrue\t\n")
    cfg = {**copy.deepcopy(BASE), "ablations": str(table)}
    with pytest.raises(ConfigError) as err:
        load_variants(cfg, REPO / "workflow" / "schemas")
    text = str(err.value)
    assert "line 3 (variant 'bad')" in text and "sft.max_grad_norm: 1.0: memory.optimizer_in_backward" in text
    assert "variant 'ok'" not in text


def test_a_dry_run_stops_on_a_missing_model_folder_before_any_job(tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model: {policy: /nonexistent/model}\n")
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", "config/smoke.yaml", str(overlay)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "model.policy: /nonexistent/model: no such folder" in proc.stdout + proc.stderr


def test_generator_nodes_are_for_async_grpo_and_leave_the_trainer_a_node():
    text = _problems(grpo={"resources": {"nodes": 2, "generator_nodes": 1}}, sft={"resources": {"generator_nodes": 1}})
    assert "grpo.resources.generator_nodes: 1: only async GRPO (grpo.mode: async)" in text
    assert "sft.resources.generator_nodes: 1: only async GRPO" in text
    text = _problems(grpo={"mode": "async", "resources": {"nodes": 2, "generator_nodes": 2}})
    assert "grpo.resources.generator_nodes: 2 of 2 nodes leaves none to train on" in text
    ok = copy.deepcopy(BASE)
    ok["grpo"]["mode"] = "async"
    ok["grpo"]["resources"].update(nodes=2, generator_nodes=1)
    assert validate_config(ok)["grpo"]["resources"]["generator_nodes"] == 1


def _model_folder(root: Path, model_type: str = "qwen3", template: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(f'{{"model_type": "{model_type}", "vocab_size": 512}}')
    (root / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}' if template else "{}")
    return root


BAD_INPUTS = {
    "preset typo": ("model: {policy: tinyy}\n", "model.policy: 'tinyy' is not a preset (did you mean 'tiny'?)"),
    # gpt2 runs on the transformers backend (model.backend: auto); backend: native has no port for it.
    "architecture": ("model: {policy: gpt2-large, backend: native}\n",
                     "model.policy: gpt2-large: model_type 'gpt2' has no native port"),
    "reward module": ("reward: {verifiers: ['no_such_module:score']}\n",
                      "reward.verifiers[0]: no_such_module:score: cannot import 'no_such_module'"),
    "data row": ("data: {sources: [{kind: preference, path: pairs.jsonl}]}\n",
                 "data.sources[0]: pairs.jsonl: row 1: field rejected is missing"),
}
GOOD_PAIR = {"prompt": "Q", "chosen": "A", "rejected": "B"}
BAD_PAIRS = {  # a file whose row 1 is malformed -> what the dry run says of it
    "missing field": ({"prompt": "Q", "chosen": "A"}, "row 1: field rejected is missing"),
    "wrong type": ({"prompt": "Q", "chosen": "A", "rejected": 3},
                   "row 1: field rejected must be a string or a non-empty list of messages, got int"),
    "prompt not prefixing chosen": (
        {"prompt": [{"role": "user", "content": "Q"}],
         "chosen": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "A"}],
         "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]},
        "row 1: field chosen does not start with the prompt: its message 0 is user 'other', the prompt's is user 'Q'"),
    "tool call not JSON": ({"prompt": "Q", "chosen": [{"role": "assistant", "content": None, "tool_calls": "call f"}],
                           "rejected": "B"}, "row 1: field chosen message 0 tool_calls is a string but not JSON"),
    "not JSON": ("{oops", "line 2: invalid JSON"),
}


@pytest.mark.parametrize("name", BAD_PAIRS)
def test_a_dry_run_reads_local_rows_and_names_file_row_and_field(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row, expected = BAD_PAIRS[name]
    Path("pairs.jsonl").write_text(json.dumps(GOOD_PAIR) + "\n" + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    text = _problems(data={"sources": [{"kind": "preference", "path": "pairs.jsonl"}]})
    lines = [line for line in text.splitlines() if "pairs.jsonl" in line]
    assert len(lines) == 1 and "data.sources[0]: " in lines[0] and f"pairs.jsonl: {expected}" in lines[0], text
    if name != "not JSON":  # a row data prep would skip is no problem with on_bad_row: skip
        ok = copy.deepcopy(BASE)
        ok["data"].update(sources=[{"kind": "preference", "path": "pairs.jsonl"}], on_bad_row="skip")
        validate_config(ok)


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_a_dry_run_names_each_bad_input_in_one_line(name, tmp_path):
    """From a working directory of the user's own, as a researcher runs it: `snakemake -s <checkout>/Snakefile`."""
    _model_folder(tmp_path / "gpt2-large", "gpt2")
    (tmp_path / "pairs.jsonl").write_text(json.dumps(GOOD_PAIR) + "\n" + json.dumps({"prompt": "Q", "chosen": "A"}) + "\n")
    overlay, expected = BAD_INPUTS[name]
    (tmp_path / "overlay.yaml").write_text(overlay)
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"), "--configfile",
                           str(REPO / "config/smoke.yaml"), "overlay.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if expected in line]
    assert len(lines) == 1 and lines[0].startswith("config (config/config.yaml"), proc.stdout + proc.stderr


def test_reward_functions_are_imported_and_their_signature_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the stages find modules in the working directory
    (tmp_path / "my_reward.py").write_text(
        "def exact(completion, example):\n    return float(completion == example['answer'])\n\n"
        "def one_arg(completion):\n    return 0.0\n\nNOT_A_FUNCTION = 3\n")
    (tmp_path / "broken_reward.py").write_text("import no_such_dependency\n")
    ok = copy.deepcopy(BASE)
    ok["reward"]["verifiers"] = ["my_reward:exact"]
    validate_config(ok)
    text = _problems(reward={"verifiers": ["my_reward:one_arg", "my_reward:missing", "my_reward:NOT_A_FUNCTION",
                                           "broken_reward:score"]})
    assert "reward.verifiers[0]: my_reward:one_arg: takes (completion); a verifier is called as fn(completion: str, " \
           "example: dict) -> float" in text
    assert f"reward.verifiers[1]: my_reward:missing: module 'my_reward' ({tmp_path / 'my_reward.py'}) has no 'missing'" in text
    assert "reward.verifiers[2]: my_reward:NOT_A_FUNCTION: 'NOT_A_FUNCTION' is not callable" in text
    assert "reward.verifiers[3]: broken_reward:score: cannot import 'broken_reward' (ModuleNotFoundError: No module " \
           "named 'no_such_dependency')" in text


def test_model_folders_are_checked_for_an_architecture_and_a_chat_template(tmp_path):
    assert "model.student: " + str(tmp_path / "nocfg") + ": no config.json" in _problems(
        model={"student": str((tmp_path / "nocfg").mkdir() or tmp_path / "nocfg")})
    base = _model_folder(tmp_path / "base", template=False)
    text = _problems(model={"policy": str(base)})
    assert f"model.policy: {base}: its tokenizer has no chat template" in text
    # The tokenizer of another folder, with a template, is what data prep then uses: accepted.
    ok = copy.deepcopy(BASE)
    ok["model"].update(policy=str(base), tokenizer=str(_model_folder(tmp_path / "instruct")))
    validate_config(ok)
    assert "model.policy: 'tinyy' is not a preset (did you mean 'tiny'?)" in _problems(model={"policy": "tinyy"})
