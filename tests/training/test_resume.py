"""Resume and fault handling of training stages, shown on SFT: kill/resume is bitwise, SIGTERM saves,
a kill during the final save leaves no output, NaN stops naming the step, checkpoints are atomic."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from posttrain.training.faults import KILL_AT_STEP_ENV, NonFiniteLossError, NonFiniteLossGuard
from posttrain.training.checkpointer import Checkpointer, ResumeError, resume_dir
from sft_testing import (
    ROOT,
    SMALL_DATA,
    SMALL_SFT,
    env_for,
    metrics,
    prepare_data,
    resolved_config,
    run_sft,
    sft_command,
    weights,
    write_config,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepare_data(tmp_path_factory.mktemp("resume-data"))


def _config(key: str = "resume", **sft) -> dict:
    return resolved_config("sft", key, data=SMALL_DATA, sft={**SMALL_SFT, **sft})


def _tiny_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)  # a frozen tensor, as a LoRA base: not saved, rebuilt by setup
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (i + 1))
    return model, opt, sched


def _train_step(model, opt, sched) -> None:
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_checkpoint_roundtrip_is_exact_and_partial_saves_are_ignored(tmp_path):
    out = tmp_path / "out"
    model, opt, sched = _tiny_training()
    ckpt = Checkpointer(out, every=2, key="k")
    for step in (1, 2, 3):
        _train_step(model, opt, sched)
        if step == 2:
            ckpt.save(2, model, opt, sched, {"epoch": 0, "index": 2})
    # A save killed half-way leaves a .tmp directory: ignored, the previous checkpoint still loads.
    (resume_dir(out) / "step-00000004.tmp").mkdir()
    (resume_dir(out) / "step-00000004.tmp" / "__0_0.distcp").write_bytes(b"partial")
    expected_next = [p.detach().clone() for p in model.parameters()]

    model, opt, sched = _tiny_training()  # setup rebuilds the same frozen weights
    point = Checkpointer(out, every=2, key="k").load(model, opt, sched)
    assert point.step == 2 and point.data_state == {"epoch": 0, "index": 2}
    assert point.path.name == "step-00000002"
    _train_step(model, opt, sched)  # the RNG was restored too: same input batch as the first run
    assert all(torch.equal(a, b) for a, b in zip(expected_next, model.parameters()))

    with pytest.raises(ResumeError, match="stage key 'k'"):
        Checkpointer(out, every=2, key="other").load(*_tiny_training())
    Checkpointer(out, every=2, key="k").remove()
    assert not resume_dir(out).exists()


def test_nonfinite_guard_skips_then_stops_naming_step_and_checkpoint(tmp_path):
    guard = NonFiniteLossGuard(max_skips=1, config_key="sft.skip_nonfinite")
    assert not guard.should_skip(1, 2.5, 1.0, None)
    assert guard.should_skip(2, float("nan"), None, None)
    with pytest.raises(NonFiniteLossError, match=r"step 3: loss is 1\.0, gradient norm is inf .*step-00000002"):
        guard.should_skip(3, 1.0, float("inf"), tmp_path / "step-00000002")
    in_backward = NonFiniteLossGuard(max_skips=5, config_key="sft.skip_nonfinite", skip_possible=False)
    with pytest.raises(NonFiniteLossError, match="optimizer_in_backward"):
        in_backward.should_skip(1, float("inf"), None, None)


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "sft"
    run_sft(_config(), data_dir, out)
    return out


@pytest.mark.slow
def test_sigkill_then_rerun_is_bitwise_equal_to_uninterrupted(data_dir, uninterrupted, tmp_path):
    out = tmp_path / "sft"
    killed = run_sft(_config(), data_dir, out, check=False, **{KILL_AT_STEP_ENV: "3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()
    assert sorted(p.name for p in resume_dir(out).glob("step-*")) == ["step-00000002"]

    run_sft(_config(), data_dir, out)
    reference, resumed = weights(uninterrupted), weights(out)
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)
    assert not resume_dir(out).exists()
    # One record per step: the records of the killed run past its checkpoint were dropped.
    steps = [r["step"] for r in metrics(out) if "loss" in r]
    assert steps == list(range(1, SMALL_SFT["steps"] + 1))
    assert [r["loss"] for r in metrics(out) if "loss" in r] == [r["loss"] for r in metrics(uninterrupted) if "loss" in r]


@pytest.mark.slow
def test_run_settings_leave_the_result_alone(data_dir, uninterrupted, tmp_path):
    """Checkpoint and log cadence and the loggers are run settings, part of no stage key: a run with
    other values gives the same weights and losses (with the resume tests above: no cadence, and
    no interruption, changes what a stage computes)."""
    out = tmp_path / "sft"
    run_sft(_config(checkpoint_every=5, log_every=3) | {"loggers": ["tensorboard"]}, data_dir, out)
    reference, other = weights(uninterrupted), weights(out)
    assert reference.keys() == other.keys() and all(torch.equal(reference[k], other[k]) for k in reference)
    assert [r["loss"] for r in metrics(out) if "loss" in r] == [r["loss"] for r in metrics(uninterrupted) if "loss" in r]
    assert list((out / "logs" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_nonzero(data_dir, tmp_path):
    out = tmp_path / "sft"
    cfg = _config(key="sigterm", steps=200, checkpoint_every=1000)
    config = write_config(cfg, tmp_path / "sigterm.json")
    proc = subprocess.Popen(sft_command(config, data_dir, out), cwd=ROOT, env=env_for(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live = resume_dir(out) / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if live.exists() and any('"loss"' in line for line in live.read_text().splitlines()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    last = max(json.loads(line)["step"] for line in live.read_text().splitlines())
    assert 1 <= last < 200
    assert [p.name for p in resume_dir(out).glob("step-*")] == [f"step-{last:08d}"]
    assert f"saved resume state at step {last}" in stderr
    assert not out.exists()


@pytest.mark.slow
def test_nan_loss_stops_naming_the_step_and_last_good_checkpoint(data_dir, tmp_path):
    # An absurd learning rate overflows the weights within a few steps.
    out = tmp_path / "sft"
    proc = run_sft(_config(key="nan", lr=1e20, checkpoint_every=1), data_dir, out, check=False)
    assert proc.returncode == 1
    error = proc.stderr.strip().splitlines()[-1]
    step = int(error.split("step ")[1].split(":")[0])
    assert error.startswith("sft: error: step ") and "nan" in error.lower()
    assert f"last good checkpoint: {resume_dir(out) / f'step-{step - 1:08d}'}" in error
    assert not out.exists()


def test_kill_during_final_save_leaves_no_output(data_dir, tmp_path):
    """The process dies after the weights are written but before the folder is complete."""
    out = tmp_path / "final"
    script = textwrap.dedent(f"""
        import os, signal, time
        import torch
        from posttrain.models import Transformer, preset_config
        from posttrain.tokenizer import Tokenizer
        from posttrain.training import final_model

        write_weights = final_model.save_hf_model
        def save_then_die(*args, **kwargs):
            write_weights(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        final_model.save_hf_model = save_then_die

        tok = Tokenizer({str(data_dir / "tokenizer")!r})
        config = preset_config("tiny-student", vocab_size=tok.vocab_size)
        cfg = {{"stage": "sft", "key": "k", "upstream": {{}}, "seed": 0, "model": {{"dtype": "float32"}}}}
        final_model.save_final_model({str(out)!r}, Transformer(config), hf_config=config, tokenizer=tok, cfg=cfg,
                                     started=time.time(), summary={{}}, metrics_path=None, is_main=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env_for(), capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()
    partial = list(tmp_path.glob("final.tmp-*"))
    assert len(partial) == 1 and (partial[0] / "model.safetensors").exists()
