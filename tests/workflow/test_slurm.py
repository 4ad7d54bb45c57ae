"""A real two-node Slurm cluster on this machine: the smoke pipeline through `snakemake --profile slurm`
(by name), and SFT on two nodes through the workflow's launcher.

The session fixture installs Debian's `slurmctld slurmd slurm-client munge` when they are missing
(root on Debian only; otherwise the test is skipped with the reason), starts munged, slurmctld and
slurmd on 127.0.0.1 from a temporary directory (tests/slurm/), and stops exactly those processes.
The workflow runs in a temporary copy of the repository, so its results and Snakemake's lock stay
out of the checkout. The `slurm` profile is installed by the documented command into a temporary
`XDG_CONFIG_HOME`; test-only settings go on the command line, the profile is used as shipped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.training.checkpointer import resume_dir
from posttrain.workflow.launch import LaunchSpec, command_prefix
from grpo_testing import GRPO_SCRIPT, RANDOM_DATA, grpo_config, random_policy, summary
from sft_testing import SFT_SCRIPT, SMALL_SFT, env_for, prepare_data, resolved_config, run_sft, write_config
from test_dpo_stage import DPO_SCRIPT, SHORT, dpo_config, run_dpo
from snakemake_testing import copy_repo, job_counts
from slurm.local_cluster import ClusterBusy, LocalSlurm, install, node_line, unavailable_reason

# About 10 minutes on 2 idle cores (each job also starts a nested Snakemake, 10-17 s); the limits
# leave room for a loaded machine.
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "profiles", "stages", "posttrain", "envs")  # keys cover its own code
SLURM_RULES = ("prepare_data", "sft", "dpo", "reward", "grpo", "distill", "evaluate", "export")
MODEL_STAGES = ("sft", "dpo", "grpo", "distill")
TRAINING_RULES = ("prepare_data", "sft", "dpo", "reward", "grpo", "distill")
# The profile's first status check waits 20 s (sized for real clusters); a test wants 2.
TEST_OVERRIDES = ("--slurm-init-seconds-before-status-checks", "2", "--latency-wait", "5")
SECTIONS_WITH_RESOURCES = ("data", "sft", "dpo", "reward", "grpo", "distill", "eval", "export")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    try:
        import snakemake_executor_plugin_slurm  # noqa: F401
    except ImportError:
        pytest.skip("snakemake-executor-plugin-slurm is not installed (pip install -e .)")
    install()
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        try:
            cluster.start()
        except ClusterBusy as e:
            pytest.skip(str(e))
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def workdir(tmp_path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    copy_repo(root, WORKFLOW_FILES)
    return root


def _stage_log_tails(workdir: Path, chars: int = 1500) -> str:
    logs = sorted((workdir / "results").rglob("logs/**/*.log"), key=lambda p: p.stat().st_mtime)[-3:]
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def _memory_overlay(workdir: Path) -> Path:
    """Jobs ask for at most half the node's memory (the configs' 8 GB would not fit a small CI machine);
    resources are not part of any stage key, so the results are those of the smoke config."""
    real_mb = int(node_line()[0].split("RealMemory=")[1].split()[0])
    mem_mb = min(4000, real_mb // 2)
    path = workdir / "slurm-test-resources.yaml"
    path.write_text("".join(f"{section}: {{resources: {{mem_mb: {mem_mb}}}}}\n" for section in SECTIONS_WITH_RESOURCES))
    return path


def _loggers_overlay(workdir: Path) -> Path:
    """TensorBoard for every training stage: a run setting, so the keys are the smoke config's."""
    path = workdir / "slurm-test-loggers.yaml"
    path.write_text("loggers: [tensorboard]\n")
    return path


def _snakemake(workdir: Path, env: dict[str, str], *args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=2200)
    return proc.returncode, proc.stdout + proc.stderr


def test_smoke_pipeline_runs_on_slurm(slurm_cluster, workdir, tmp_path):
    smoke = ("--configfile", "config/smoke.yaml", str(_memory_overlay(workdir)), str(_loggers_overlay(workdir)))
    env = {**slurm_cluster.env, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    install = subprocess.run([sys.executable, "-m", "posttrain.workflow.profiles", "install", "slurm"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    start = time.perf_counter()
    returncode, output = _snakemake(workdir, env, "--profile", "slurm", *smoke, *TEST_OVERRIDES)
    seconds = time.perf_counter() - start
    print(f"smoke pipeline on Slurm: {seconds:.0f} s")
    assert returncode == 0, f"{output[-5000:]}\n{_stage_log_tails(workdir)}\n{slurm_cluster.logs()}"
    assert "Using profiles slurm and workflow specific profile profiles/default" in output

    # Every stage's output, found through the variant's manifest, is complete.
    results = workdir / "results" / "smoke"
    manifest = json.loads((results / "variants" / "default" / "manifest.json").read_text())
    outputs = {stage: workdir / ref["path"] for stage, ref in manifest["stages"].items()}
    assert set(outputs) == {"prepare_data", "sft", "dpo", "reward", "grpo", "distill"}, manifest["stages"]
    for stage, folder in outputs.items():
        assert json.loads((folder / "posttrain.json").read_text())["stage"] == stage
    for stage in MODEL_STAGES:
        assert {"model.safetensors", "config.json"} <= {p.name for p in outputs[stage].iterdir()}, stage
        # `loggers` reached the stage through its run settings file (the smoke reward stage trains no model)
        assert list((outputs[stage] / "logs" / "tensorboard").glob("events.out.tfevents.*")), stage
    assert sorted(manifest["eval"]) == sorted(MODEL_STAGES)
    assert all((workdir / ref["path"] / "metrics.json").is_file() for ref in manifest["eval"].values())
    assert (workdir / manifest["export"]["path"] / "model.safetensors").is_file()
    assert (results / "report" / "summary.tsv").is_file()
    assert not list(results.rglob("*.resume")) and not list(results.rglob("*.tmp-*"))

    # Slurm ran every non-local rule as a job and each one completed; the plugin polled with squeue.
    jobs = slurm_cluster.jobs()
    by_rule: dict[str, list[str]] = {}
    for job in jobs:
        rule = job["comment"].removeprefix("rule_").split("_wildcards_")[0]
        by_rule.setdefault(rule, []).append(job["state"])
    assert set(by_rule) == set(SLURM_RULES), jobs
    assert all(state == "COMPLETED" for states in by_rule.values() for state in states), jobs
    assert len(by_rule["evaluate"]) == len(MODEL_STAGES)
    assert "Falling back to 'sacct'" not in output

    # Snakemake's HTML report embeds the report rule's figures and summary table.
    html = workdir / "report.html"
    returncode, output = _snakemake(workdir, slurm_cluster.env, *smoke, "--report", str(html))
    assert returncode == 0, output[-3000:]
    page = html.read_text()
    figures = sorted(p.name for p in (results / "report").glob("*.png"))
    assert figures and "summary.tsv" in page, figures
    assert all(f"data:image/png;charset=utf8;filename={name};base64,iVBORw0KGgo" in page for name in figures)  # PNG bytes inline

    # Reruns on these results (local profile: where jobs run enters no key). An eval setting reruns
    # the four evals and what reads them (export's model card, the report), no training stage;
    # sft.lr plans SFT and every stage after it, not data preparation.
    local = ("--profile", "profiles/local")
    evals = workdir / "eval-overlay.yaml"
    evals.write_text("eval: {max_new_tokens: 8}\n")
    # One --configfile list: a second --configfile flag would replace the smoke files, not add to them.
    returncode, output = _snakemake(workdir, slurm_cluster.env, *local, *smoke, str(evals))
    assert returncode == 0, output[-3000:]
    ran = job_counts(output)
    assert ran["evaluate"] == len(MODEL_STAGES) and not set(ran) & set(TRAINING_RULES), ran
    lr = workdir / "lr-overlay.yaml"
    lr.write_text("sft: {lr: 1.0e-3}\n")
    returncode, output = _snakemake(workdir, slurm_cluster.env, *local, *smoke, str(lr), "--dry-run", "--quiet", "rules")
    assert returncode == 0, output[-3000:]
    planned = job_counts(output)
    assert set(planned) & set(TRAINING_RULES) == set(TRAINING_RULES) - {"prepare_data"}, planned
    assert planned["evaluate"] == len(MODEL_STAGES), planned


def _on_two_nodes(cluster: LocalSlurm, tmp: Path, name: str, script: Path, *args: Path | str) -> list[str]:
    """Run `script` as the workflow launches `resources: {nodes: 2}` (one CPU process a node) inside a
    two-node allocation; the torchrun of each node (`python -m torch.distributed.run` from the workflow's
    interpreter), as a shim of that interpreter recorded it."""
    shims = tmp / f"{name}-bin"
    shims.mkdir()
    log = tmp / f"{name}-torchrun.log"
    (shims / "python").write_text(f'#!/bin/sh\nif [ "$1 $2" = "-m torch.distributed.run" ]; then shift 2\n'
                                  f'  echo "$SLURMD_NODENAME $*" >> {log}; set -- -m torch.distributed.run "$@"; fi\n'
                                  f'exec {sys.executable} "$@"\n')
    (shims / "python").chmod(0o755)
    prefix = command_prefix(LaunchSpec(nodes=2, procs=1, threads=1), str(REPO), python=str(shims / "python"))
    line = " ".join([prefix, str(script), *map(str, args)])
    env = {**cluster.env, "PATH": f"{shims}:{Path(sys.executable).parent}:{cluster.env['PATH']}"}
    start = time.perf_counter()
    proc = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=2000",
                           "sh", "-c", line], env=env, capture_output=True, text=True, timeout=600)
    print(f"{name} on two Slurm nodes: {time.perf_counter() - start:.0f} s")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{cluster.logs()}"
    return sorted(log.read_text().splitlines())


def _same_weights(a: Path, b: Path) -> bool:
    one, two = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return one.keys() == two.keys() and all(torch.equal(one[name], two[name]) for name in one)


def test_sft_and_dpo_on_two_nodes_match_two_processes_on_one(slurm_cluster, tmp_path):
    """One torchrun per node, node k of the allocation holding node rank k (and so ranks 2k..: the
    same ranks, data shards and gloo reductions as two processes on one node): the same weights, bitwise."""
    data = prepare_data(tmp_path, {"n_preference": 64})
    sft = resolved_config("sft", "two-nodes", sft={**SMALL_SFT, "steps": 4, "checkpoint_every": 2})
    run_sft(sft, data, tmp_path / "sft-one-node", nproc=2)
    launches = _on_two_nodes(slurm_cluster, tmp_path, "sft", SFT_SCRIPT, "--config", write_config(sft, tmp_path / "sft.json"),
                             "--data", data, "--out", tmp_path / "sft-two-nodes")
    assert [launch.split()[0] for launch in launches] == ["n1", "n2"], launches
    assert all(f"--node-rank {rank} --master-addr 127.0.0.1" in launch for rank, launch in enumerate(launches)), launches
    assert _same_weights(tmp_path / "sft-one-node", tmp_path / "sft-two-nodes")

    dpo = dpo_config("two-nodes", **SHORT)
    run_dpo(dpo, data, tmp_path / "sft-one-node", tmp_path / "dpo-one-node", nproc=2)
    _on_two_nodes(slurm_cluster, tmp_path, "dpo", DPO_SCRIPT, "--config", write_config(dpo, tmp_path / "dpo.json"),
                  "--data", data, "--model", tmp_path / "sft-one-node", "--out", tmp_path / "dpo-two-nodes")
    assert _same_weights(tmp_path / "dpo-one-node", tmp_path / "dpo-two-nodes")


def _job_field(cluster: LocalSlurm, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job, "-o"], env=cluster.env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(f"{field}=")), "")


def test_a_requeued_sft_job_resumes_to_the_weights_of_an_uninterrupted_run(slurm_cluster, tmp_path):
    """`scontrol requeue`, as a preemption with requeue does it: Slurm SIGTERMs the running job, the
    stage saves its resume state and exits, Slurm starts the job again under the same id, and the
    rerun continues from that state to the weights of a run that was never interrupted."""
    data = prepare_data(tmp_path)
    cfg = resolved_config("sft", "requeue", sft={**SMALL_SFT, "steps": 150, "checkpoint_every": 1000, "log_every": 1})
    run_sft(cfg, data, tmp_path / "uninterrupted")

    out, log = tmp_path / "requeued", tmp_path / "requeued.log"
    line = " ".join([command_prefix(LaunchSpec(threads=1), str(REPO)), str(SFT_SCRIPT),
                     "--config", str(write_config(cfg, tmp_path / "requeue.json")), "--data", str(data), "--out", str(out)])
    env = {**slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}:{slurm_cluster.env['PATH']}"}
    job = subprocess.run(["sbatch", "--parsable", "--requeue", "--open-mode=append", f"--output={log}", "--nodes=1",
                          "--ntasks=1", "--cpus-per-task=1", "--mem=2000", f"--wrap={line}"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    metrics = resume_dir(out) / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and sum(1 for row in metrics.read_text().splitlines() if '"loss"' in row) >= 10):
        assert time.monotonic() < deadline and _job_field(slurm_cluster, job, "JobState") in ("PENDING", "RUNNING"), \
            f"no training step logged: {log.read_text() if log.exists() else ''}\n{slurm_cluster.logs()}"
        time.sleep(0.2)
    node = _job_field(slurm_cluster, job, "NodeList")
    subprocess.run(["scontrol", "requeue", job], env=slurm_cluster.env, check=True, capture_output=True)
    requeued = time.monotonic()
    slurm_cluster.release_requeued(job, away_from=node)
    deadline = time.monotonic() + 600
    while _job_field(slurm_cluster, job, "JobState") != "COMPLETED":
        assert time.monotonic() < deadline and _job_field(slurm_cluster, job, "JobState") not in ("FAILED", "CANCELLED"), \
            f"{_job_field(slurm_cluster, job, 'JobState')}\n{log.read_text()}\n{slurm_cluster.logs()}"
        time.sleep(1)

    print(f"requeued SFT job: done {time.monotonic() - requeued:.0f} s after the requeue")
    text = log.read_text()
    assert _job_field(slurm_cluster, job, "Restarts") == "1", text
    assert "received SIGTERM: saved resume state at step" in text and "resuming from" in text, text
    assert _same_weights(tmp_path / "uninterrupted", out)
    assert not resume_dir(out).exists()


def _running_job(cluster: LocalSlurm, rule: str) -> tuple[str, str] | None:
    """(job id, node) of the running Slurm job of `rule` (the plugin names the rule in the job's comment)."""
    out = subprocess.run(["squeue", "--noheader", "--states=RUNNING", "--format=%i|%k|%N"], env=cluster.env,
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        job, comment, node = line.split("|")
        if comment.startswith(f"rule_{rule}_"):
            return job, node
    return None


def _wait_for(what: str, ready, proc: subprocess.Popen, cluster: LocalSlurm, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            output = proc.communicate()[0]
            raise AssertionError(f"gave up waiting for {what}:\n{output[-4000:]}\n{cluster.logs()}")
        time.sleep(0.5)
    return found


def test_a_requeue_and_a_lost_node_through_snakemake_end_with_the_weights_of_an_uninterrupted_run(
        slurm_cluster, workdir, tmp_path):
    """Through `snakemake --profile slurm` (restart-times: 1): SFT's job is requeued after step 20 (SIGTERM:
    the stage checkpoints and exits, Slurm starts the job again, it resumes); DPO's node is lost after
    step 10 (its slurmd and every process of the job SIGKILLed: the job fails with NODE_FAIL, runs again
    on the other node, resumes from the step-10 checkpoint). Both end with the weights of stages run
    straight through with the same configs."""
    env = {**slurm_cluster.env, "XDG_CONFIG_HOME": str(tmp_path / "config"), "POSTTRAIN_TEST_PAUSE_AT": "sft:20,dpo:10",
           "PATH": f"{Path(sys.executable).parent}:{slurm_cluster.env['PATH']}"}
    subprocess.run([sys.executable, "-m", "posttrain.workflow.profiles", "install", "slurm"], env=env, check=True,
                   capture_output=True, timeout=120)
    steps = workdir / "steps.yaml"
    steps.write_text("sft: {steps: 40, checkpoint_every: 10}\ndpo: {steps: 20, checkpoint_every: 5}\n")
    args = ("--profile", "slurm", "--configfile", "config/smoke.yaml", str(_memory_overlay(workdir)), str(steps),
            *TEST_OVERRIDES, "--until", "dpo")
    results = workdir / "results" / "smoke"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=workdir, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def paused(stage: str, step: int):
        logs = list((results / "logs" / stage).glob("*.log")) if (results / "logs" / stage).is_dir() else []
        if any(f"{stage}: pausing after step {step}" in log.read_text(errors="replace") for log in logs):
            return _running_job(slurm_cluster, stage)
        return None

    sft_job, sft_node = _wait_for("SFT to pause after step 20", lambda: paused("sft", 20), proc, slurm_cluster)
    subprocess.run(["scontrol", "requeue", sft_job], env=slurm_cluster.env, check=True, capture_output=True)
    slurm_cluster.release_requeued(sft_job, away_from=sft_node)
    dpo_job, dpo_node = _wait_for("DPO to pause after step 10", lambda: paused("dpo", 10), proc, slurm_cluster, 900)
    assert slurm_cluster.lose_node(dpo_node, dpo_job), f"no process of job {dpo_job} found"
    try:
        slurm_cluster.release_requeued(dpo_job, away_from=dpo_node)  # slurmctld requeues it once the node is down
        output = proc.communicate(timeout=1200)[0]
    finally:
        slurm_cluster.restart_node(dpo_node)
    print(f"requeue + lost node through Snakemake: {time.perf_counter() - start:.0f} s")
    assert proc.returncode == 0, f"{output[-5000:]}\n{_stage_log_tails(workdir)}\n{slurm_cluster.logs()}"

    # The requeued job ran again under its id; the lost one failed and ran again (a new job from
    # Snakemake's restart, or the same one requeued by Slurm), each rerun resuming from its checkpoint.
    assert _job_field(slurm_cluster, sft_job, "Restarts") == "1"
    dpo_runs = [j for j in slurm_cluster.jobs() if j["comment"].startswith("rule_dpo_")]
    assert _job_field(slurm_cluster, dpo_job, "Restarts") == "1" or len(dpo_runs) == 2, dpo_runs
    (sft_log,), (dpo_log,) = (list((results / "logs" / stage).glob("*.log")) for stage in ("sft", "dpo"))
    assert "resuming from" in sft_log.read_text() and "step-00000020 at step 20" in sft_log.read_text()
    assert "step-00000010 at step 10" in dpo_log.read_text()

    # The same stages run straight through, from the configs the workflow wrote, give the same weights.
    (data,) = (p for p in (results / "data").iterdir() if p.is_dir())
    (sft,), (dpo,) = ([p for p in (results / stage).iterdir() if p.is_dir()] for stage in ("sft", "dpo"))
    straight = {**env}
    straight.pop("POSTTRAIN_TEST_PAUSE_AT")
    for script, out, extra in ((SFT_SCRIPT, tmp_path / "sft", ()), (DPO_SCRIPT, tmp_path / "dpo", ("--model", str(sft)))):
        stage_dir = sft if out.name == "sft" else dpo
        subprocess.run([sys.executable, str(script), "--config", str(stage_dir.with_name(stage_dir.name + ".config.json")),
                        "--data", str(data), "--out", str(out), *extra], cwd=workdir, env=straight, check=True,
                       capture_output=True, timeout=600)
    assert _same_weights(tmp_path / "sft", sft)
    assert _same_weights(tmp_path / "dpo", dpo)


def test_async_grpo_trains_on_the_first_node_and_generates_on_the_second(slurm_cluster, tmp_path):
    """`grpo.resources: {nodes: 2, generator_nodes: 1}`, as the workflow launches it: node 1 runs the trainer's
    torchrun and the Ray head (no CPUs of its own), node 2 a Ray worker that the generator actor lands on.
    The weights equal the same async run on one node (trainer and a local Ray), bitwise."""
    pytest.importorskip("ray")
    data, model = random_policy(tmp_path)
    cfg = grpo_config("ray-nodes", data=RANDOM_DATA, reward={"verifiers": ["grpo_testing:length_reward"]}, mode="async",
                      generators=1, generator_threads=1, max_staleness=1, steps=4, prompts_per_step=4, group_size=4,
                      max_new_tokens=8, eval_prompts=4, lr=1e-3, checkpoint_every=100)
    config = write_config(cfg, tmp_path / "grpo.json")
    args = ["--config", str(config), "--data", str(data), "--model", str(model)]
    env = {**slurm_cluster.env, "PYTHONPATH": str(REPO / "tests"),
           "PATH": f"{Path(sys.executable).parent}:{slurm_cluster.env['PATH']}"}
    one_node = tmp_path / "one-node"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                    str(GRPO_SCRIPT), *args, "--out", str(one_node)], env=env_for(threads=1, PYTHONPATH=env["PYTHONPATH"]),
                   cwd=REPO, check=True, capture_output=True, timeout=900)

    two_nodes = tmp_path / "two-nodes"
    prefix = command_prefix(LaunchSpec(nodes=2, procs=1, threads=1, generator_nodes=1), str(REPO))
    line = " ".join([prefix, str(GRPO_SCRIPT), *args, "--out", str(two_nodes)])
    start = time.perf_counter()
    proc = subprocess.run(["salloc", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=2000",
                           "sh", "-c", line], env=env, capture_output=True, text=True, timeout=900)
    print(f"async GRPO on two Slurm nodes: {time.perf_counter() - start:.0f} s")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{slurm_cluster.logs()}"
    result = summary(two_nodes)
    assert result["trainer_node"] == "n1" and result["generator_nodes"] == ["n2"], result
    assert result["max_staleness_seen"] <= 1 and result["policy_version"] == 4
    assert _same_weights(one_node, two_nodes)
