"""Reliability, reproducibility and security guarantees (issue 11) not shown by the stage tests.

Shown elsewhere, not repeated here: SFT kill/resume, SIGTERM, NaN stop and a kill during the final
save (test_resume.py); fixed-step kill/resume of DPO, GRPO and distillation (test_dpo_stage.py,
test_grpo.py, test_distill.py); config and ablation errors, bad variant names, the 20-variant plan
time (test_workflow*.py); bad model folders (test_checkpoint.py); bad data rows
(test_data_sources.py); the export's token scrubbing (test_export.py).

Here: byte-identical reruns and provenance; SIGKILL at a random step (SFT, DPO, GRPO, distillation) and
SIGTERM (DPO, GRPO) resumed bitwise, and a kill before the first checkpoint; skipping non-finite batches; the OOM hint;
one error line per bad input from the stage scripts themselves, nothing lost; source checks (no
pickle loads, no remote code, Ray on loopback, outputs written atomically); no token in any
output; Snakemake's lock.
"""

from __future__ import annotations

import ast
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from distill_testing import random_model_folder
from test_damaged_state import DAMAGES
from posttrain.tokenizer import Tokenizer
from posttrain.training.faults import KILL_AT_STEP_ENV, exit_on_known_errors, explain_out_of_memory
from posttrain.training.checkpointer import Checkpointer, resume_dir
from posttrain.utils.provenance import git_commit
from posttrain.rules import HELD_OUT_METRICS
from posttrain.workflow.schema import ConfigError, validate_config
from sft_testing import ROOT, SMALL_DATA, env_for, metrics, prepare_data, resolved_config, weights, write_config

# A fake hub token in every stage's environment: no output file and no log line may contain it.
SECRET = "hf_posttrainReliabilityTestToken0123456789"
TOKEN_ENV = {"HF_TOKEN": SECRET, "HUGGING_FACE_HUB_TOKEN": SECRET}

# Tiny runs of each training stage: a checkpoint every 2 steps, so a kill loses at most one step. DPO, GRPO and
# distillation also evaluate every 2 steps and keep the best evaluation's weights (SFT keeps the last).
BEST = {"eval_every": 2, "keep": "best"}
SECTIONS: dict[str, dict[str, Any]] = {
    "sft": {"steps": 4, "batch_size": 8, "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1},
    "dpo": {"steps": 4, "batch_size": 8, "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1, "lr": 1e-3, **BEST},
    "grpo": {"steps": 4, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 10, "checkpoint_every": 2,
             "log_every": 1, "eval_prompts": 8, "lr": 1e-3, **BEST},
    "distill": {"steps": 4, "batch_size": 8, "warmup_steps": 1, "checkpoint_every": 2, "log_every": 1,
                "eval_prompts": 4, "max_new_tokens": 8, **BEST},
}
# Fields of metrics.jsonl / posttrain.json that measure time, not results.
TIMING = {"started", "wall_time_s", "step_s", "tokens_per_s", "samples_per_s", "trainer_idle_frac", "generate_s",
          "train_s", "peak_memory_mb"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("reliability-data"))


@pytest.fixture(scope="module")
def start_model(data_dir, tmp_path_factory) -> Path:
    """The starting policy of DPO and GRPO: a random `tiny-student` folder with the data's tokenizer."""
    return random_model_folder(tmp_path_factory.mktemp("start") / "model", Tokenizer(data_dir / "tokenizer"),
                               preset="tiny-student", seed=3)


def stage_config(stage: str, key: str | None = None, **section: Any) -> dict[str, Any]:
    cfg = resolved_config(stage, key or f"rel-{stage}", data=SMALL_DATA)
    cfg[stage].update({**SECTIONS[stage], **section})
    if stage == "sft":
        cfg["model"]["policy"] = "tiny-student"
    return cfg


def stage_command(stage: str, cfg: dict[str, Any], out: Path, data: Path, model: Path | None) -> list[str]:
    """The stage's command line; `model` is the starting model folder (distillation's teacher; unused by SFT,
    which starts from a preset)."""
    config = write_config(cfg, out.parent / f"{out.name}.json")
    inputs = ["--data", str(data)] + ([] if stage == "sft" else ["--teacher" if stage == "distill" else "--model", str(model)])
    return [sys.executable, str(ROOT / "stages" / f"{stage}.py"), "--config", str(config), "--out", str(out), *inputs]


def run_stage(stage: str, cfg: dict[str, Any], out: Path, data: Path, model: Path | None, check: bool = True,
              **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(stage_command(stage, cfg, out, data, model), capture_output=True, text=True, cwd=ROOT,
                          env=env_for(**TOKEN_ENV, **env), timeout=600)
    assert SECRET not in proc.stdout + proc.stderr, f"{stage} printed the hub token"
    if check and proc.returncode != 0:
        raise AssertionError(f"{stage} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def results_without_timing(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def assert_no_token_written(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"{path} contains the hub token"


@pytest.fixture(scope="module")
def reference(data_dir, start_model, tmp_path_factory):
    """The uninterrupted run of a stage, made on first use and shared by the module's tests."""
    made: dict[str, Path] = {}

    def get(stage: str) -> Path:
        if stage not in made:
            out = tmp_path_factory.mktemp(f"reference-{stage}") / stage
            run_stage(stage, stage_config(stage), out, data_dir, start_model)
            made[stage] = out
        return made[stage]

    return get


# --- determinism and provenance ---


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo"])
def test_same_config_and_inputs_give_identical_files(stage, reference, data_dir, start_model, tmp_path):
    first = reference(stage)
    second = tmp_path / stage
    run_stage(stage, stage_config(stage), second, data_dir, start_model)

    names = sorted(p.relative_to(first).as_posix() for p in first.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(second).as_posix() for p in second.rglob("*") if p.is_file())
    assert "model.safetensors" in names
    for name in names:
        if name not in ("posttrain.json", "metrics.jsonl", "manifest.json"):  # times of the run and of its files
            assert (first / name).read_bytes() == (second / name).read_bytes(), f"{stage}: {name} differs"
    assert results_without_timing(metrics(first)) == results_without_timing(metrics(second))
    # Same provenance but for time (and the commit: other work may land between the two runs).
    varying = TIMING | {"metrics", "git_commit"}
    one, two = (json.loads((d / "posttrain.json").read_text()) for d in (first, second))
    assert {k: v for k, v in one.items() if k not in varying} == {k: v for k, v in two.items() if k not in varying}
    assert_no_token_written(first)
    assert_no_token_written(second)


def test_provenance_records_seed_versions_commit_and_resolved_config(reference):
    out = reference("sft")
    record = json.loads((out / "posttrain.json").read_text())
    cfg = json.loads((out.parent / f"{out.name}.json").read_text())
    assert record["stage"] == "sft" and record["key"] == cfg["key"] and record["upstream"] == cfg["upstream"]
    assert record["seed"] == cfg["seed"] == record["config"]["seed"]
    assert record["config"] == cfg  # the whole resolved config, not only the stage's section
    assert record["versions"]["torch"] == torch.__version__
    assert record["versions"]["posttrain"] and record["versions"]["python"]
    if git_commit() is not None:
        # The checkout's commit when the stage ran: HEAD or, if work landed since, one of its ancestors.
        commit = record["git_commit"].removesuffix("-dirty")
        assert len(commit) == 40 and subprocess.run(
            ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"]).returncode == 0, record["git_commit"]
    assert record["metrics"]["steps"] == SECTIONS["sft"]["steps"]


# --- interrupted runs resume bitwise ---


def _interrupt_with_sigterm(stage: str, cfg: dict[str, Any], out: Path, data: Path, model: Path) -> tuple[int, str]:
    """Start the stage, SIGTERM it once its first training step is logged; (exit status, stderr)."""
    proc = subprocess.Popen(stage_command(stage, cfg, out, data, model), cwd=ROOT, env=env_for(**TOKEN_ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live = resume_dir(out) / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if live.exists() and any('"loss"' in line for line in live.read_text().splitlines()):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=300)
    return proc.returncode, stderr


# SIGKILL at a random step (before the first checkpoint, too) of every training stage, and SIGTERM (only SFT's
# is tested elsewhere) must leave a resumable checkpoint.
@pytest.mark.slow
@pytest.mark.parametrize("stage,interrupt", [("sft", "sigkill"), ("dpo", "sigkill"), ("grpo", "sigkill"),
                                             ("distill", "sigkill"), ("dpo", "sigterm"), ("grpo", "sigterm")])
def test_interrupted_run_resumes_bitwise_equal(stage, interrupt, reference, data_dir, start_model, tmp_path):
    steps, every = SECTIONS[stage]["steps"], SECTIONS[stage]["checkpoint_every"]
    cfg = stage_config(stage)
    out = tmp_path / stage
    if interrupt == "sigkill":
        kill_step = random.randrange(1, steps)  # the process dies right after this step
        killed = run_stage(stage, cfg, out, data_dir, start_model, check=False, **{KILL_AT_STEP_ENV: str(kill_step)})
        assert killed.returncode == -signal.SIGKILL, (kill_step, killed.stderr[-2000:])
        saved, stopped = kill_step // every * every, kill_step
        expected = [f"step-{saved:08d}"] if saved else []
    else:
        status, stderr = _interrupt_with_sigterm(stage, cfg, out, data_dir, start_model)
        assert status == 128 + signal.SIGTERM, stderr[-2000:]
        saved = max(json.loads(line)["step"] for line in (resume_dir(out) / "metrics.jsonl").read_text().splitlines())
        assert 1 <= saved < steps and f"saved resume state at step {saved}" in stderr
        expected, stopped = [f"step-{saved:08d}"], saved
    # The declared output does not exist; the resume state lives beside it.
    assert not out.exists()
    assert sorted(p.name for p in resume_dir(out).glob("step-*")) == expected, (interrupt, saved)

    resumed = run_stage(stage, cfg, out, data_dir, start_model)
    print(f"{stage}: {interrupt} after step {stopped}, resumed from step {saved}")
    if saved:
        assert f"at step {saved}" in resumed.stdout
    ref = reference(stage)
    a, b = weights(ref), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (stage, interrupt, saved)
    losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert losses == [r["loss"] for r in metrics(ref) if "loss" in r] and len(losses) == steps
    assert results_without_timing(metrics(out)) == results_without_timing(metrics(ref))
    if SECTIONS[stage].get("keep") == "best":  # evaluated at 0, 2 and 4; the kept step survived the interruption
        metric = next(iter(HELD_OUT_METRICS[stage]))
        assert [r["step"] for r in metrics(out) if metric in r] == [0, 2, 4]
        summary = json.loads((out / "posttrain.json").read_text())["metrics"]
        assert summary["best_step"] in (2, 4) and summary["keep"] == "best" and summary["evaluations"] == 2
    assert not resume_dir(out).exists()


# --- damaged state (issue 64; the other damaged-state cases: test_damaged_state.py, test_damaged_stages.py) ---


def killed_after_step_3(stage: str, cfg: dict[str, Any], out: Path, data: Path, model: Path | None) -> None:
    """The stage killed right after step 3, a checkpoint after every step: steps 2 and 3 are kept."""
    proc = run_stage(stage, cfg, out, data, model, check=False, **{KILL_AT_STEP_ENV: "3"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(p.name for p in resume_dir(out).glob("step-*")) == ["step-00000002", "step-00000003"]


def assert_same_run(out: Path, whole: Path) -> None:
    a, b = weights(whole), weights(out)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert results_without_timing(metrics(out)) == results_without_timing(metrics(whole))


@pytest.mark.slow
@pytest.mark.parametrize("stage,name,how", [("sft", "__0_0.distcp", "flip"), ("dpo", "__0_0.distcp", "truncate"),
                                            ("grpo", "rank-0.json", "flip"), ("distill", ".metadata", "truncate")])
def test_a_damaged_checkpoint_resumes_from_the_one_before_to_the_uninterrupted_weights(stage, name, how, reference,
                                                                                       data_dir, start_model, tmp_path):
    """A checkpoint after every step (a run setting: the results are the uninterrupted run's with any cadence)."""
    cfg = stage_config(stage, checkpoint_every=1)
    out = tmp_path / "out"
    killed_after_step_3(stage, cfg, out, data_dir, start_model)
    damaged = resume_dir(out) / "step-00000003" / name
    DAMAGES[how](damaged)
    resumed = run_stage(stage, cfg, out, data_dir, start_model)
    assert f"checkpoint step-00000003 is damaged: {damaged}" in resumed.stdout, resumed.stdout[-2000:]
    assert "at step 2" in resumed.stdout
    assert_same_run(out, reference(stage))


@pytest.mark.slow
def test_a_log_line_torn_by_a_kill_resumes_bitwise(reference, data_dir, tmp_path):
    cfg = stage_config("sft", checkpoint_every=1)
    out = tmp_path / "out"
    killed_after_step_3("sft", cfg, out, data_dir, None)
    log = resume_dir(out) / "metrics.jsonl"
    with log.open("a") as f:  # what a kill during the next append leaves: part of a record, no newline
        f.write('{"step": 4, "loss": 1.23')
    resumed = run_stage("sft", cfg, out, data_dir, None)
    assert resumed.stdout.count("dropped its last line, cut short by a kill during a write") == 1
    assert_same_run(out, reference("sft"))


def test_a_run_killed_before_its_first_checkpoint_starts_over_with_fresh_metrics(tmp_path):
    out = tmp_path / "out"
    checkpointer = Checkpointer(out, every=2, key="k")
    checkpointer.metrics_path.parent.mkdir(parents=True)  # a metrics file from the killed run, no checkpoint
    checkpointer.metrics_path.write_text('{"step": 0, "eval_loss": 1.0}\n{"step": 1, "loss": 2.0}\n')
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    assert Checkpointer(out, every=2, key="k").load(model, optimizer, None) is None
    assert not checkpointer.metrics_path.exists()


# --- training faults ---


@pytest.mark.slow
def test_nonfinite_batches_are_skipped_up_to_the_limit_then_stop(data_dir, tmp_path):
    out = tmp_path / "sft"
    cfg = stage_config("sft", "skip", lr=1e20, steps=8, checkpoint_every=1, skip_nonfinite=2)
    proc = run_stage("sft", cfg, out, data_dir, None, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    skipped = [line for line in proc.stdout.splitlines() if "skipping this batch" in line]
    assert len(skipped) == 2 and "(1 of 2 allowed by sft.skip_nonfinite)" in skipped[0], proc.stdout[-2000:]
    # The error stands alone on the last line (not glued to a progress bar).
    error = proc.stderr.strip().splitlines()[-1]
    stop = int(skipped[0].split("step ")[1].split(":")[0]) + 2
    assert error.startswith(f"sft: error: step {stop}: ") and "2 batches already skipped" in error, proc.stderr[-1500:]
    # Skipped steps leave the weights alone, so the checkpoints after them are still good ones.
    assert f"last good checkpoint: {resume_dir(out) / f'step-{stop - 1:08d}'}" in error
    assert "Traceback" not in proc.stderr and not out.exists()


def test_out_of_memory_names_the_settings_to_change(capsys):
    with pytest.raises(SystemExit) as exit_info:
        with exit_on_known_errors("dpo"), explain_out_of_memory("dpo"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpo: error: dpo: out of device memory (CUDA out of memory.")
    for setting in ("dpo.batch_size", "dpo.grad_accum", "data.max_seq_len", "memory.activation_checkpointing",
                    "memory.optimizer_in_backward", "memory.low_bit_optimizer"):
        assert setting in lines[0]


# --- bad input: one error line from the stage script, nothing lost or overwritten ---


def _run_main(stage: str, argv: list[str], monkeypatch, capsys) -> str:
    """stages/<stage>.py run as `__main__` in this process; returns its one-line error (exit status 1)."""
    monkeypatch.setattr(sys, "argv", [f"stages/{stage}.py", *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "stages" / f"{stage}.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert exit_info.value.code == 1, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{stage}: error: "), err[-2000:]
    return last


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())
    return dst


def test_bad_data_row_names_file_row_and_field(tmp_path, monkeypatch, capsys):
    source = tmp_path / "chats.jsonl"
    good = {"prompt": "What is 2+2?", "response": "4"}
    source.write_text("\n".join(json.dumps(r) for r in [good, good, {"prompt": "Where is the answer?"}]) + "\n")
    raw = [{"kind": "sft", "path": str(source)}]
    with pytest.raises(ConfigError, match=r"chats.jsonl: row 2: field response is missing"):  # the dry run says it first
        validate_config({"data": {"sources": raw}})
    sources = validate_config({"data": {"sources": raw, "on_bad_row": "skip"}})["data"]["sources"]
    cfg = resolved_config("prepare_data", "bad-rows", data={**SMALL_DATA, "sources": sources})
    out = tmp_path / "data"
    error = _run_main("prepare_data", ["--config", write_config(cfg, tmp_path / "c.json"), "--out", out],
                      monkeypatch, capsys)
    assert str(source) in error and "row 2" in error and "response" in error, error
    assert not out.exists() and not list(tmp_path.glob("data.tmp-*"))


@pytest.mark.parametrize("case", ["vocab_mismatch", "truncated_safetensors", "remote_code", "other_runs_output"])
def test_bad_input_stops_with_one_line_and_leaves_files_alone(case, data_dir, start_model, tmp_path, monkeypatch,
                                                             capsys):
    model = _copy_model(start_model, tmp_path / "model")
    out = tmp_path / "dpo"
    expect: list[str]
    if case == "vocab_mismatch":
        hf = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**hf, "vocab_size": 260}))
        expect = [str(data_dir / "tokenizer"), str(model / "config.json"), "vocab_size 260"]
    elif case == "truncated_safetensors":
        weights_file = model / "model.safetensors"
        weights_file.write_bytes(weights_file.read_bytes()[:1000])
        expect = [str(weights_file), "safetensors"]
    elif case == "remote_code":
        hf = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**hf, "auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}))
        expect = ["remote code"]
    else:  # --out already holds another run's results: refused before training, not after
        out.mkdir()
        (out / "posttrain.json").write_text(json.dumps({"stage": "dpo", "key": "someone-else"}))
        (out / "model.safetensors").write_bytes(b"another run's weights")
        expect = [str(out), "'someone-else'", "'rel-dpo'"]
    before = {p: p.read_bytes() for p in [*model.iterdir(), *(out.iterdir() if out.exists() else [])]}

    cfg = stage_config("dpo")
    error = _run_main("dpo", ["--config", write_config(cfg, tmp_path / "c.json"), "--data", data_dir,
                              "--model", model, "--out", out], monkeypatch, capsys)
    assert all(fragment in error for fragment in expect), error
    assert {p: p.read_bytes() for p in before} == before  # inputs and the other run's output untouched
    assert not resume_dir(out).exists() and not list(tmp_path.glob("dpo.tmp-*"))
    assert case == "other_runs_output" or not out.exists()


# --- security and atomicity, checked on the source ---

SOURCE_DIRS = ("posttrain", "stages", "benchmarks", "tests")


def _python_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def _calls(tree: ast.AST):
    return (node for node in ast.walk(tree) if isinstance(node, ast.Call))


def _name(func: ast.expr) -> str:
    return ast.unparse(func)


def test_no_pickle_loading_and_no_remote_code_anywhere():
    """torch.load only with weights_only=True, everywhere; no pickle loads at all outside tests (a test may
    round-trip its own object in memory); no allow_pickle, no trust_remote_code."""
    problems = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for call in _calls(tree):
            where = f"{path.relative_to(ROOT)}:{call.lineno}"
            keywords = {k.arg: k.value for k in call.keywords}
            name = _name(call.func)
            if name == "torch.load" and not (isinstance(keywords.get("weights_only"), ast.Constant)
                                             and keywords["weights_only"].value is True):
                problems.append(f"{where}: torch.load without weights_only=True")
            if name.split(".")[0] in ("pickle", "dill", "joblib", "cloudpickle") and name.endswith(("load", "loads")) \
                    and path.relative_to(ROOT).parts[0] != "tests":
                problems.append(f"{where}: {name}")
            if "allow_pickle" in keywords and not (isinstance(keywords["allow_pickle"], ast.Constant)
                                                   and keywords["allow_pickle"].value is False):
                problems.append(f"{where}: allow_pickle")
            if "trust_remote_code" in keywords and not (isinstance(keywords["trust_remote_code"], ast.Constant)
                                                        and keywords["trust_remote_code"].value is False):
                problems.append(f"{where}: trust_remote_code")
    assert not problems, "\n".join(problems)


def test_ray_is_imported_only_after_the_loopback_environment_is_set():
    """`import ray` appears only inside functions that first set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0."""
    importers = []
    for path in _python_files():
        if "tests" in path.relative_to(ROOT).parts[:1]:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            imports_ray = (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names)) or (
                isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray")
            if imports_ray:
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                assert id(node) not in module_level, f"{where}: module-level import of ray"
                importers.append(path)
    from posttrain.rl.ray_collector import LOCAL_RAY_ENV

    assert LOCAL_RAY_ENV["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    source = (ROOT / "posttrain" / "rl" / "ray_collector.py").read_text()
    for path in importers:
        text = path.read_text()
        assert path.name == "ray_collector.py" or "import_ray" in text, path
    body = source.split("def import_ray", 1)[1]
    assert body.index("LOCAL_RAY_ENV") < body.index("import ray")


def test_every_stage_writes_its_output_atomically(tmp_path):
    """Each stage script hands its --out to atomic_dir, to `write_stage_output` (the harness's `run.write_output`
    calls it), or ends through the harness (`run.finish`, which writes `run.out` with save_final_model and
    atomic_dir); and `write_stage_output` leaves nothing under the output's name when its writer fails."""
    from posttrain.utils.provenance import write_stage_output

    for script in sorted((ROOT / "stages").glob("*.py")):
        calls = [(ast.unparse(c.func), c) for c in _calls(ast.parse(script.read_text()))]
        atomic = any(name in ("atomic_dir", "write_stage_output") and c.args
                     and ast.unparse(c.args[0]) in ("args.out", "run.out") for name, c in calls)
        assert atomic or any(name in ("run.finish", "run.write_output") for name, _ in calls), \
            f"{script.name}: no atomic write"

    def fails(folder: Path) -> dict[str, Any]:
        (folder / "half.txt").write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_stage_output(tmp_path / "out", {"key": "k"}, "evaluate", 0.0, fails)
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder left
    summary = write_stage_output(tmp_path / "out", {"key": "k"}, "evaluate", 0.0,
                                 lambda folder: (folder / "a.txt").write_text("a") and {"rows": 1})
    assert summary == {"rows": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((tmp_path / "out" / "posttrain.json").read_text())["metrics"] == {"rows": 1}
    assert (tmp_path / "out" / "manifest.json").is_file() and (tmp_path / "out" / "a.txt").read_text() == "a"


# --- Snakemake: one invocation per working directory ---


def test_second_invocation_in_the_same_directory_is_refused_by_the_lock(tmp_path):
    from test_workflow_snakemake import FAKE_STAGE, Workflow

    wf = Workflow(tmp_path / "wf")
    started, gate = tmp_path / "started", tmp_path / "gate"
    (wf.root / "stages" / "prepare_data.py").write_text(textwrap.dedent(f"""
        import pathlib, time
        pathlib.Path({str(started)!r}).touch()
        while not pathlib.Path({str(gate)!r}).exists():
            time.sleep(0.05)
    """) + FAKE_STAGE)
    env = {**os.environ, "FAKE_STAGE_LOG": str(wf.stage_log)}
    first = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "--until", "prepare_data"],
                             cwd=wf.root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), first.communicate()[0][-3000:]
        second = wf.snakemake("--cores", "1", "--until", "prepare_data", check=False)
        assert second.returncode != 0
        assert "Directory cannot be locked" in second.output and "--unlock" in second.output, second.output[-3000:]
    finally:
        gate.touch()
        output = first.communicate(timeout=120)[0]
    assert first.returncode == 0, output[-3000:]
    assert wf.runs() == {"prepare_data": 1}
