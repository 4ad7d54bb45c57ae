"""Damaged state never trains in silence: every byte a resume or a later stage reads is checked first.

Unit level here (a small module's checkpoints, each file damaged by a flip that keeps its size and by a truncation;
logs cut mid-line; a full disk under the final output); the stages themselves in test_damaged_stages.py."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from posttrain.training.checkpointer import Checkpointer, ResumeError, resume_dir
from posttrain.utils.io import DiskFullError, atomic_dir
from posttrain.utils.manifest import MANIFEST, DamagedFileError, changed, damage, require_intact, write_manifest
from posttrain.utils.metrics import LogDamagedError, read_log, truncate_after


def flip(path: Path) -> None:
    """64 bytes in the middle of the file inverted, its size kept (a bad disk, a bit rot)."""
    data = bytearray(path.read_bytes())
    middle = max(0, len(data) // 2 - 32)
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    """The file cut to half its size (a partial copy, a kill during a transfer)."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {"flip": flip, "truncate": truncate}


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 16)).sum().backward()
    optimizer.step()
    return model, optimizer


def write_generator_weights(folder: Path) -> None:
    """What async GRPO writes beside a checkpoint: the weights of a policy version with work in flight."""
    (folder / "generator").mkdir()
    torch.save({"w": torch.arange(64, dtype=torch.float32)}, folder / "generator" / "version-1.pt")


@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Checkpoints of steps 1 and 2 (both kept), each with the files of every kind, and the weights each holds."""
    out = tmp_path / "out"
    checkpointer = Checkpointer(out, every=1, key="k")
    weights = {}
    for step in (1, 2):
        model, optimizer = model_and_optimizer(step)
        checkpointer.save(step, model, optimizer, None, {"position": step}, write_files=write_generator_weights)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = model_and_optimizer(3)
    checkpointer.save(3, model, optimizer, None, {"position": 3}, write_files=write_generator_weights)
    weights[3] = {k: v.clone() for k, v in model.state_dict().items()}
    assert checkpointer.kept_steps() == [2, 3]  # the newest and the one before it
    return out, weights


def load(out: Path) -> tuple[int, dict[str, torch.Tensor]]:
    model, optimizer = model_and_optimizer(0)
    point = Checkpointer(out, every=1, key="k").load(model, optimizer, None)
    return point.step, model.state_dict()


def checkpoint_files(out: Path, step: int) -> list[str]:
    folder = resume_dir(out) / f"step-{step:08d}"
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_every_kind_of_checkpoint_file_is_written_and_digested(two_checkpoints):
    out, _ = two_checkpoints
    files = checkpoint_files(out, 3)
    assert MANIFEST in files and "rank-0.json" in files and ".metadata" in files and "generator/version-1.pt" in files
    assert any(f.endswith(".distcp") for f in files)
    assert set(json.loads((resume_dir(out) / "step-00000003" / MANIFEST).read_text())["files"]) == set(files) - {MANIFEST}


@pytest.mark.parametrize("how", sorted(DAMAGES))
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(how, two_checkpoints, tmp_path, capsys):
    """Each file of the newest checkpoint damaged in turn: the resume takes the one before, with its weights, and
    says so; an intact newest is taken as it is."""
    out, weights = two_checkpoints
    assert load(out)[0] == 3
    for name in checkpoint_files(out, 3):
        copy = tmp_path / name.replace("/", "_") / "out"
        shutil.copytree(resume_dir(out), resume_dir(copy))
        DAMAGES[how](resume_dir(copy) / "step-00000003" / name)
        step, state = load(copy)
        assert step == 2, name
        assert all(torch.equal(state[k], weights[2][k]) for k in state), name
        said = capsys.readouterr().out
        assert f"checkpoint step-00000003 is damaged: {resume_dir(copy) / 'step-00000003' / name}" in said, said


def test_with_no_intact_checkpoint_the_resume_stops_naming_the_file(two_checkpoints):
    out, _ = two_checkpoints
    flip(resume_dir(out) / "step-00000003" / "rank-0.json")
    truncate(resume_dir(out) / "step-00000002" / ".metadata")
    with pytest.raises(ResumeError) as err:
        load(out)
    message = str(err.value)
    assert "\n" not in message and str(resume_dir(out) / "step-00000003" / "rank-0.json") in message
    assert f"no intact checkpoint to resume from: delete {resume_dir(out)}" in message


def test_a_checkpoint_without_its_manifest_is_not_trusted(two_checkpoints):
    out, weights = two_checkpoints
    (resume_dir(out) / "step-00000003" / MANIFEST).unlink()
    assert load(out)[0] == 2


def test_a_checkpoint_holding_nan_is_named_not_trained_on(tmp_path):
    out = tmp_path / "out"
    model, optimizer = model_and_optimizer(1)
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    Checkpointer(out, every=1, key="k").save(1, model, optimizer, None, {})
    with pytest.raises(ResumeError, match=r"tensor '1.weight' \(1 of 128 values\) holds NaN or inf"):
        load(out)


def test_a_torn_last_line_is_dropped_once_and_earlier_damage_is_named(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n{"step": 3, "lo')
    truncate_after(log, 2)
    assert log.read_text() == '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'
    assert capsys.readouterr().out.count("dropped its last line") == 1
    log.write_text('{"step": 1, "loss": 2.5}\n{"st\x00p": 2\n{"step": 3, "loss": 2.0}\n')
    with pytest.raises(LogDamagedError, match=f"{log}: line 2 is not a JSON record"):
        read_log(log)


def test_an_output_carries_a_manifest_and_a_damaged_one_is_named(tmp_path):
    out = tmp_path / "sft"
    with atomic_dir(out) as tmp:
        (tmp / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (tmp / "posttrain.json").write_text('{"key": "k"}')
    (out / ".snakemake_timestamp").touch()  # what Snakemake adds to a finished folder output is not the stage's
    assert damage(out) is None and changed(out) is None
    require_intact(out, "the input --model")
    flip(out / "model.safetensors")
    assert damage(out).startswith(f"{out / 'model.safetensors'}: its bytes differ")
    with pytest.raises(DamagedFileError, match="the input --model .* is not what its stage wrote"):
        require_intact(out, "the input --model")
    truncate(out / "model.safetensors")
    assert changed(out).startswith(f"{out / 'model.safetensors'}: changed after it was written (16384 -> 8192 bytes)")
    (out / "extra.bin").write_bytes(b"x")
    (out / "model.safetensors").unlink()
    assert damage(out) == f"{out / 'model.safetensors'}: missing"


def test_a_full_disk_under_the_final_output_leaves_nothing_and_says_where(tmp_path, monkeypatch):
    """ENOSPC injected into the final write: one error naming the folder and the free space, no folder under the
    final name or a temporary one (the stage test fills a real, size-limited filesystem)."""
    out = tmp_path / "out"
    with pytest.raises(DiskFullError) as err:
        with atomic_dir(out) as tmp:
            (tmp / "a").write_text("x")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert f"writing the output {out}; nothing is left under its name" in str(err.value)
    assert "MiB free of" in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_write_manifest_is_atomic_and_lists_every_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a").write_text("a")
    (tmp_path / "b").write_text("bb")
    write_manifest(tmp_path)
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["b", "sub/a"] and files["b"]["size"] == 2
    assert not (tmp_path / f"{MANIFEST}.tmp").exists()


def test_a_full_disk_under_any_other_write_ends_the_stage_in_one_line(tmp_path, capsys):
    from posttrain.training.faults import exit_on_known_errors

    log = tmp_path / "metrics.jsonl"
    with pytest.raises(SystemExit) as stop:
        with exit_on_known_errors("sft"):
            raise OSError(errno.ENOSPC, "No space left on device", str(log))
    assert stop.value.code == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"sft: error: {log}: no space left on device (") and "\n" not in error
