"""The Snakefile driven through Snakemake's command line, in a temporary copy of the workflow.

The copy's stages/*.py are test doubles: each declares the real stage's `READS`, checks the inputs
it is handed, writes its declared output and appends `<stage> <key>` to $FAKE_STAGE_LOG, so job
planning, rerun decisions and the shell lines are tested in seconds. (The real stages run end to
end in the smoke test; tests/workflow/test_stage_keys.py plans a copy of the real ones.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from posttrain.workflow.fingerprint import declared_reads
from snakemake_testing import copy_repo, job_counts

REPO = Path(__file__).resolve().parents[2]
STAGES = ("prepare_data", "sft", "dpo", "reward", "grpo", "distill", "evaluate", "export", "report")
TRAINING = ("prepare_data", "sft", "dpo", "reward", "grpo", "distill")

FAKE_STAGE = textwrap.dedent('''
    """Test double of a stage script: the CLI contract of docs/architecture.md, no training."""
    import argparse, importlib, json, os, pathlib, sys

    READS = ()
    stage = pathlib.Path(sys.argv[0]).stem
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    for flag in ("data", "model", "teacher", "reward", "eval"):
        parser.add_argument(f"--{flag}")
    args = parser.parse_args()
    cfg = json.loads(pathlib.Path(args.config).read_text())
    assert cfg["stage"] == stage, (cfg["stage"], stage)
    if stage != "report":
        assert pathlib.Path(args.out).name == cfg["key"], (args.out, cfg["key"])
    for flag in ("data", "model", "teacher", "reward", "eval"):
        path = getattr(args, flag)
        if path is not None:
            upstream = json.loads((pathlib.Path(path) / "posttrain.json").read_text())
            assert cfg["upstream"][upstream["stage"]] == upstream["key"], (flag, upstream)
    out = pathlib.Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True)
    (tmp / "posttrain.json").write_text(json.dumps({"stage": stage, "key": cfg["key"], "config": cfg}))
    importlib.import_module("posttrain.utils.manifest").write_manifest(tmp)  # as real outputs; not in the copy's keys
    os.rename(tmp, out)
    with open(os.environ["FAKE_STAGE_LOG"], "a") as log:
        log.write(f"{stage} {cfg['key']}\\n")
''')


class Workflow:
    """A copy of the workflow with fake stages, and a way to run Snakemake in it."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()
        copy_repo(root, ("Snakefile", "workflow", "envs", "profiles"))
        (root / "config").mkdir()
        shutil.copy(REPO / "config" / "config.yaml", root / "config" / "config.yaml")
        (root / "stages").mkdir()
        for stage in STAGES:
            reads = declared_reads(REPO / "stages" / f"{stage}.py")
            (root / "stages" / f"{stage}.py").write_text(FAKE_STAGE.replace("READS = ()", f"READS = {reads!r}"))
        self.stage_log = root / "stage_runs.log"
        self.table("variant\n")  # no variants: one `default`

    def table(self, text: str) -> None:
        (self.root / "config" / "ablations.tsv").write_text(textwrap.dedent(text).lstrip("\n").replace("|", "\t"))

    def overlay(self, name: str, text: str) -> str:
        path = self.root / f"{name}.yaml"
        path.write_text(textwrap.dedent(text))
        return str(path)

    def snakemake(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "FAKE_STAGE_LOG": str(self.stage_log)}
        proc = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=300)
        proc.output = proc.stdout + proc.stderr
        if check and proc.returncode != 0:
            raise AssertionError(f"snakemake {' '.join(args)} failed:\n{proc.output[-4000:]}")
        return proc

    def plan(self, *args: str) -> Counter:
        """Job counts per rule of a dry run (empty when there is nothing to do)."""
        return job_counts(self.snakemake("--dry-run", "--quiet", "rules", *args).output)

    def runs(self) -> Counter:
        """How many times each stage script ran, and forget."""
        if not self.stage_log.exists():
            return Counter()
        ran = Counter(line.split()[0] for line in self.stage_log.read_text().splitlines())
        self.stage_log.unlink()
        return ran


@pytest.fixture
def wf(tmp_path) -> Workflow:
    return Workflow(tmp_path / "wf")


def test_three_grpo_variants_plan_one_sft_one_dpo_three_grpo(wf):
    wf.table("""
        variant|grpo.group_size|grpo.clip_eps
        g4|4|
        g8|8|
        g16|16|0.1
    """)
    counts = wf.plan()
    assert counts["sft"] == 1 and counts["dpo"] == 1 and counts["grpo"] == 3
    assert counts == Counter({"prepare_data": 1, "sft": 1, "dpo": 1, "reward": 1, "grpo": 3, "distill": 3,
                              "evaluate": 8, "export": 3, "report": 1, "variant": 3, "all": 1})


def test_shell_lines(wf):
    out = wf.snakemake("--dry-run", "--printshellcmds", "--cores", "2").output
    key = r"[0-9a-f]{12}"
    python = re.escape(shlex.quote(sys.executable))  # the interpreter Snakemake runs in, not the first python on PATH
    launch = rf"PYTHONPATH=\S+\$\{{PYTHONPATH:\+:\$PYTHONPATH\}} OMP_NUM_THREADS=\d {python}"
    expected = {
        "prepare_data": rf"stages/prepare_data.py --config results/data/(?P<k>{key}).config.json --out results/data/(?P=k)"
                        rf" > results/logs/data/(?P=k).log 2>&1",
        "sft": rf"stages/sft.py --config results/sft/(?P<k>{key}).config.json --out results/sft/(?P=k)"
               rf" --data results/data/{key} > results/logs/sft/(?P=k).log 2>&1",
        "grpo": rf"stages/grpo.py --config results/grpo/(?P<k>{key}).config.json --out results/grpo/(?P=k)"
                rf" --data results/data/{key} --model results/dpo/{key} --reward results/reward/{key}"
                rf" > results/logs/grpo/(?P=k).log 2>&1",
        "distill": rf"stages/distill.py .* --data results/data/{key} --teacher results/grpo/{key} > ",
        "export": rf"stages/export.py .* --model results/distill/{key} --eval results/eval/{key} > ",
    }
    for stage, pattern in expected.items():
        assert re.search(rf"{launch} {pattern}", out), (stage, out[-3000:])
    assert re.search(rf"OMP_NUM_THREADS=1 {python} stages/report.py --config results/report\.[0-9a-f]{{12}}\.config\.json --out results/report", out)


def test_config_error_stops_before_any_job(wf):
    bad = wf.overlay("bad", """
        sft:
          lrr: 0.001
        grpo:
          mode: asyncc
    """)
    proc = wf.snakemake("--cores", "1", "--configfile", bad, check=False)
    assert proc.returncode != 0
    assert "sft.lrr: unknown key (did you mean 'lr'?)" in proc.output
    assert 'grpo.mode: "asyncc" is not allowed; allowed values: "sync", "async"' in proc.output
    assert "Building DAG" not in proc.output and not (wf.root / "results").exists() and not wf.runs()
    proc = wf.snakemake("--cores", "1", "--config", "seed=-1", check=False)
    assert proc.returncode != 0 and "seed: -1 must be >= 0" in proc.output


def test_ablation_errors_stop_before_any_job(wf, tmp_path):
    canary = tmp_path / "canary"
    wf.table(f"""
        variant|sft.lr|grpo.group_size
        ok|1e-3|4
        x; touch {canary}|1e-3|4
        bad|-1|one
    """)
    proc = wf.snakemake("--cores", "1", check=False)
    assert proc.returncode != 0
    assert f"line 3, column 'variant': variant name 'x; touch {canary}' must be" in proc.output
    assert "line 4 (variant 'bad'), column 'sft.lr': -1 must be > 0" in proc.output
    assert "line 4 (variant 'bad'), column 'grpo.group_size': \"one\" is not of type integer" in proc.output
    assert not canary.exists() and not (wf.root / "results").exists() and not wf.runs()
    wf.table("variant|grpo.groupsize\na|4\n")
    proc = wf.snakemake("--cores", "1", check=False)
    assert "column 2 'grpo.groupsize': is not a config key (did you mean 'grpo.group_size'?)" in proc.output


def test_ablations_key_swaps_the_table(wf):
    (wf.root / "other.tsv").write_text("variant\tsft.lr\nlow\t1e-4\nhigh\t1e-2\n")
    assert wf.plan("--config", "ablations=other.tsv")["variant"] == 2
    assert wf.plan("--config", "ablations=")["variant"] == 1


def test_lint_is_clean(wf):
    proc = wf.snakemake("--lint")
    assert "Congratulations, your workflow is in a good condition!" in proc.output
    assert "Lints for" not in proc.output


def test_twenty_variant_sweep_plans_every_variant_and_shares_the_prefix(wf):
    """A 20-variant sweep plans 20 GRPO runs on 2 SFT runs (the only SFT-relevant key has 2 values).

    Its planning time is measured by benchmarks/tools/sweep_planning.py, not asserted here.
    """
    rows = [f"v{i:02d}|{2 + i % 5}|{1e-6 * (1 + i // 5):.1e}|{i % 2}" for i in range(20)]
    wf.table("variant|grpo.group_size|grpo.lr|memory.activation_checkpointing\n" + "\n".join(rows) + "\n")
    counts = wf.plan()
    assert counts["variant"] == 20 and counts["sft"] == 2 and counts["grpo"] == 20


def test_slurm_profile_plans(wf):
    proc = wf.snakemake("--profile", "profiles/slurm", "--dry-run", "--config", "ablations=")
    assert "sft" in proc.output and "Job stats" in proc.output


@pytest.mark.slow
def test_reruns_are_exact(wf):
    local = ("--profile", "profiles/local")
    wf.snakemake(*local)
    assert wf.runs() == Counter({stage: 1 for stage in STAGES} | {"evaluate": 4})
    view = wf.root / "results" / "variants" / "default"
    assert (view / "manifest.json").is_file() and (view / "grpo" / "posttrain.json").is_file()

    # Nothing changed, or only run settings (resources, loggers, cadence: part of no key): nothing to
    # do, although the run settings files next to the configs were rewritten.
    assert wf.plan(*local) == Counter()
    run = wf.overlay("run", """
        loggers: [tensorboard]
        sft: {resources: {cpus: 1, mem_mb: 1000, runtime: 5}, log_every: 1, checkpoint_every: 3}
    """)
    assert wf.plan(*local, "--configfile", run) == Counter()
    sft_run = json.loads(next((wf.root / "results" / "sft").glob("*.run.json")).read_text())
    assert sft_run["loggers"] == ["tensorboard"] and sft_run["sft"]["checkpoint_every"] == 3

    # An eval setting: the evals rerun (and export, whose model card quotes an eval), no training.
    evals = wf.overlay("eval", "eval: {max_new_tokens: 8}\n")
    wf.snakemake(*local, "--configfile", evals)
    assert wf.runs() == Counter({"evaluate": 4, "export": 1, "report": 1})

    # sft.lr: SFT and everything downstream of it, not data preparation.
    lr = wf.overlay("lr", "sft: {lr: 1.0e-3}\n")
    wf.snakemake(*local, "--configfile", lr)
    assert wf.runs() == Counter({stage: 1 for stage in STAGES if stage != "prepare_data"} | {"evaluate": 4})
    assert wf.plan(*local, "--configfile", lr) == Counter()

    # A comment in a stage script changes no key: nothing to do. A real edit moves that stage and what
    # reads its output to new keys (the old outputs stay), and the dry run says why.
    with open(wf.root / "stages" / "grpo.py", "a") as script:
        script.write("# edited\n")
    assert wf.plan(*local, "--configfile", lr) == Counter()
    with open(wf.root / "stages" / "grpo.py", "a") as script:
        script.write("EDITED = True\n")
    output = wf.snakemake(*local, "--configfile", lr, "--dry-run", "--quiet", "rules").output
    assert job_counts(output) == Counter({"grpo": 1, "distill": 1, "evaluate": 2, "export": 1, "report": 1,
                                          "variant": 1, "all": 1})
    key = "[0-9a-f]{12}"
    assert re.search(rf"^rerun reason: grpo {key} \(was {key}\): code: stages/grpo.py$",
                     output, re.M), output
    assert re.search(rf"^rerun reason: distill {key} \(was {key}\): input: new key of grpo$", output, re.M), output


def test_a_pipeline_column_plans_the_shared_sft_once(wf):
    """config/examples/ablations-pipeline.tsv: [sft, dpo, grpo], [sft, grpo] and [grpo] from a model folder."""
    policy = wf.root / "instruct"
    policy.mkdir()
    (policy / "config.json").write_text('{"model_type": "qwen3", "vocab_size": 512}')
    (policy / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    counts = wf.plan("--config", f"ablations={REPO / 'config/examples/ablations-pipeline.tsv'}", "set=model.policy=instruct")
    assert counts == Counter({"prepare_data": 1, "sft": 1, "dpo": 1, "reward": 3, "grpo": 3, "evaluate": 5,
                              "export": 3, "variant": 3, "report": 1, "all": 1})


def test_command_line_values_are_typed_by_the_schema(wf):
    """`--config set=` takes dotted keys; nested `--config` values, which Snakemake reads as text, are typed."""
    wf.plan("--config", "set=sft.steps=7; sft.lr=1e-3; pipeline=[sft]", "eval={base: true, n_prompts: 12}")
    (sft_config,) = (wf.root / "results" / "sft").glob("*.config.json")
    sft = json.loads(sft_config.read_text())["sft"]
    assert sft["steps"] == 7 and sft["lr"] == 1e-3 and sft["batch_size"] == 16  # the rest of the section kept
    evals = [json.loads(p.read_text())["eval"] for p in (wf.root / "results" / "eval").glob("*.config.json")]
    assert len(evals) == 2 and all(e["n_prompts"] == 12 for e in evals)  # the base and sft, no other stage
    assert not (wf.root / "results" / "dpo").exists()
    bad = wf.snakemake("-n", "--config", "set=sft.lrr=1", check=False)
    assert bad.returncode != 0 and "--config set=...: sft.lrr: is not a config key" in bad.output


def test_a_dry_run_names_an_output_changed_after_its_stage_wrote_it(wf):
    """Each output's manifest records its files' sizes and times: `snakemake -n` names a file edited or replaced
    since (Snakemake still takes the output as done; deleting it reruns the stage), and an untouched tree says
    nothing."""
    local = ("--profile", "profiles/local")
    wf.snakemake(*local)
    quiet = wf.snakemake("-n", *local)
    assert "changed after it was written" not in quiet.output
    sft = next(p for p in (wf.root / "results" / "sft").iterdir() if p.is_dir())
    (sft / "posttrain.json").write_text((sft / "posttrain.json").read_text() + " ")
    dry = wf.snakemake("-n", *local)
    lines = [line for line in dry.output.splitlines() if "changed after it was written" in line]
    where = sft.relative_to(wf.root)  # the results folder, as the config names it
    assert len(lines) == 1 and lines[0].startswith(f"sft: {where / 'posttrain.json'}: changed after it was written"), lines
    assert lines[0].endswith(f"delete {where} to rerun the stage"), lines


def test_a_trained_reward_model_on_a_family_transformers_cannot_classify_stops_the_dry_run_in_one_line(wf):
    """`reward_model.source: train` builds the reward model on GRPO's starting model: on the transformers backend that
    is transformers' own sequence classifier of the family. Granite has none: `snakemake -n` refuses the config in one
    line naming the key and the family, before any job; Mistral (a native port) is planned with its reward model."""
    reads = declared_reads(REPO / "stages" / "reward_model.py")
    (wf.root / "stages" / "reward_model.py").write_text(FAKE_STAGE.replace("READS = ()", f"READS = {reads!r}"))
    for family in ("granite", "mistral"):
        folder = wf.root / family
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": family, "vocab_size": 512}))
        (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    settings = "pipeline=[sft, grpo]; reward_model.source=train"
    refused = wf.snakemake("-n", "--config", f"set=model.policy=granite; {settings}", check=False)
    lines = [line for line in refused.output.splitlines() if "reward_model.source" in line]
    assert refused.returncode != 0 and len(lines) == 1, refused.output[-3000:]
    assert lines[0].startswith("config (") and lines[0].endswith(
        "reward_model.source: train: the policy's model_type 'granite' runs on the transformers backend (model.backend), "
        "and transformers has no sequence classifier (*ForSequenceClassification) for it to build the reward model on; "
        "name a pretrained reward model (a folder or hub id), or set it to null"), lines
    assert "Building DAG" not in refused.output and not (wf.root / "results").exists()
    counts = wf.plan("--config", f"set=model.policy=mistral; {settings}")
    assert counts["reward_model"] == 1 and counts["grpo"] == 1 and counts["sft"] == 1, counts
