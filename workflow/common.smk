# Config validation, the variant plan and the helpers every stage's rule uses.
# The logic lives in posttrain/workflow/ (unit-tested Python); this file only wires it in.

import os
import shlex
import sys

from snakemake.utils import min_version

from snakemake.settings.types import DeploymentMethod

from posttrain.workflow.inputs import CACHE_FILE, stage_pythonpath
from posttrain.workflow.overrides import apply_command_line
from posttrain.workflow.schema import load_schema, validate_config
from posttrain.workflow.launch import RESOURCE_NAMES, command_prefix, job_resources, spec_from_resources
from posttrain.workflow.plan import KEY_PATTERN, STAGE_DIRS, build_plan, canonical_json
from posttrain.workflow.reasons import changed_outputs, rerun_reasons
from posttrain.workflow.stage_summary import summary_lines
from posttrain.workflow.views import write_plan_files

min_version("9.0")

REPO = os.path.abspath(workflow.basedir)
SCHEMAS = os.path.join(REPO, "workflow", "schemas")

# Every key, type and allowed value is checked before any job is planned; a problem stops here
# with a message naming the key. Defaults from the schema fill what the config leaves out.
# `--config` values are typed by the schema first (Snakemake reads nested ones as strings), and
# `--config set='sft.lr=1e-3; pipeline=[sft, grpo]'` takes dotted keys (posttrain/workflow/overrides.py).
SCHEMA = load_schema(os.path.join(SCHEMAS, "config.schema.yaml"))
_checked = validate_config(
    apply_command_line(config, workflow.config_settings.config or {}, SCHEMA),
    where="config (config/config.yaml + --configfile/--config)",
    schema=SCHEMA,
)
config.clear()
config.update(_checked)

# Keys cover the code of this checkout's stages/ and posttrain/ (a copied repository keys its own), and
# the content of the user's files each stage reads, hashed once per change (the cache under results/).
PLAN = build_plan(config, schema_dir=SCHEMAS, repo=REPO, hash_cache=os.path.join(config["results"], CACHE_FILE))
RESULTS = PLAN.results
# Each planned output's resolved config (<results>/<stage dir>/<key>.config.json) and the report's
# (<results>/report.<key>.config.json): pure functions of the plan, named by their key, written
# now (only when missing or different) so that every stage rule finds its config as an input file.
# Next to each, <key>.run.json: loggers, resources, log and checkpoint cadence, read by the stage
# but no rule input, so changing them reruns nothing.
write_plan_files(RESULTS, PLAN.files())
# A missing output whose stage has an output differing only in code: say which modules changed; an output whose
# files changed after its stage wrote them: name the file.
for line in rerun_reasons(PLAN) + changed_outputs(PLAN):
    print(line, file=sys.stderr)
# What each training stage will do (steps, rows and tokens per step, its split, epochs), said before any job
# runs, so `snakemake -n` shows it (the Snakefile is read before Snakemake knows it is a dry run).
if workflow.is_main_process:
    for line in summary_lines(PLAN):
        print(line, file=sys.stderr)


wildcard_constraints:
    key=KEY_PATTERN,
    variant=r"[A-Za-z0-9][A-Za-z0-9_.-]*",


def script(stage):
    """stages/<stage>.py relative to the working directory: a param, not an input, since the stage
    key covers the script's code (a comment-only edit reruns nothing, a real one moves the key)."""
    return os.path.relpath(os.path.join(REPO, "stages", f"{stage}.py"))


def stage_output(stage):
    return directory(f"{RESULTS}/{STAGE_DIRS[stage]}/{{key}}")


def stage_log(stage):
    return f"{RESULTS}/logs/{STAGE_DIRS[stage]}/{{key}}.log"


def stage_benchmark(stage):
    return f"{RESULTS}/benchmarks/{STAGE_DIRS[stage]}/{{key}}.tsv"


def stage_inputs(stage):
    """Input function: the resolved config and the upstream outputs (named by CLI flag)."""

    def inputs(wildcards):
        job = PLAN.job(stage, wildcards.key)
        return {
            "config": job.config_path,
            **{flag: upstream.path for flag, upstream in job.inputs.items()},
        }

    return inputs


def stage_args(wildcards, input, output):
    """Params function: the stage's command line after its script, `--<flag> <path>` for each named input
    (the flags `stage_inputs` names them by, which the stage script declares in its INPUTS), `--out` second."""
    flags = {name: str(path) for name, path in input.items()}
    flags = {"config": flags.pop("config"), "out": str(output[0]), **flags}
    return " ".join(f"--{name} {shlex.quote(path)}" for name, path in flags.items())


def stage_resources(stage):
    """Snakemake resources from the stage section's `resources` (a run setting, not part of the stage key)."""
    return {
        name: lambda wildcards, name=name: job_resources(PLAN.job(stage, wildcards.key).resources)[name]
        for name in RESOURCE_NAMES
    }


def stage_threads(stage):
    return lambda wildcards: PLAN.job(stage, wildcards.key).resources["cpus"]


def launcher(wildcards, threads, resources):
    """Params function: python / torchrun / srun torchrun from the job's resources.

    It takes `resources` and `threads`, so Snakemake treats it as derived and does not rerun a job
    when only its resources change (the stage key covers what the output depends on).
    """
    return command_prefix(spec_from_resources(resources, threads), pythonpath=os.pathsep.join(stage_pythonpath(REPO)),
                          python=PYTHON)


# The interpreter Snakemake runs in, so a venv's snakemake needs no activated venv; a conda env's own python.
PYTHON = "python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable
