"""`snakemake --profile slurm` by name: the documented install command, and what Snakemake then loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.workflow import profiles

REPO = Path(__file__).resolve().parents[2]
INSTALL = [sys.executable, "-m", "posttrain.workflow.profiles", "install"]


def run(args: list[str], config_home: Path, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CONFIG_HOME": str(config_home)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_documented_command_makes_the_slurm_profile_reachable_by_name(tmp_path):
    home = tmp_path / "config"
    installed = run([*INSTALL, "slurm"], home)
    assert installed.returncode == 0, installed.stderr
    config = home / "snakemake" / "slurm" / "config.yaml"
    settings = yaml.safe_load(config.read_text())
    assert settings == yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    assert settings["executor"] == "slurm" and settings["slurm-status-command"] == "squeue"

    # Snakemake finds it by name and adds the workflow's own profile (per-rule settings) by itself.
    dry = run([sys.executable, "-m", "snakemake", "--profile", "slurm", "--dry-run",
               "--config", "ablations=", f"results={tmp_path / 'results'}"], home)
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    out = dry.stdout + dry.stderr
    assert "Using profiles slurm and workflow specific profile profiles/default" in out
    assert "tasks_per_gpu=0" in out  # profiles/default's set-resources reached the stage rules


def test_the_accounting_variant_checks_job_status_with_sacct(tmp_path):
    target = profiles.install("slurm-accounting", tmp_path)
    settings = yaml.safe_load((target / "config.yaml").read_text())
    slurm = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    assert settings == {**slurm, "slurm-status-command": "sacct"}


def test_an_edited_profile_is_kept_unless_forced(tmp_path):
    target = profiles.install("slurm", tmp_path)
    assert profiles.install("slurm", tmp_path) == target  # the same text again: nothing to do
    config = target / "config.yaml"
    config.write_text(config.read_text() + 'default-resources: {slurm_account: "mine"}\n')
    with pytest.raises(FileExistsError, match="--force"):
        profiles.install("slurm", tmp_path)
    assert "mine" in config.read_text()
    profiles.install("slurm", tmp_path, force=True)
    assert "mine" not in config.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["slurm"]  # no staging directory left behind


def test_an_unknown_name_lists_the_shipped_profiles(tmp_path):
    with pytest.raises(ValueError, match="slurm, slurm-accounting"):
        profiles.install("pbs", tmp_path)
    proc = run([*INSTALL, "pbs"], tmp_path)
    assert proc.returncode != 0 and "invalid choice: 'pbs'" in proc.stderr
