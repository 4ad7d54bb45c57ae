"""Training faults turned into decisions and one-line explanations.

- A NaN/inf loss stops the stage naming the step and the last good checkpoint, or skips the
  batch (no optimizer step) up to a configured number of times.
- CUDA out-of-memory is re-raised with the config keys that reduce memory.
- `POSTTRAIN_TEST_SIGKILL_AT_STEP=N` makes the process SIGKILL itself after step N: the resume
  tests use it to die at an exact step, as a preempted or OOM-killed job would.
- `POSTTRAIN_TEST_PAUSE_AT=<stage>:<step>[,...]` makes a stage wait after that step (its periodic
  checkpoint written) until SIGTERM arrives, as a long step would: the cluster tests requeue a job
  or take its node away at a known point.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.std import tqdm

from posttrain.model_files import CheckpointError
from posttrain.data.sources import DataError
from posttrain.models import ModelConfigError
from posttrain.tokenizer import TokenizerError
from posttrain.training.checkpointer import ResumeError
from posttrain.training.signals import StopOnSignal
from posttrain.utils.io import DiskFullError, OutputExistsError, no_space_left
from posttrain.utils.manifest import DamagedFileError
from posttrain.utils.metrics import LogDamagedError, LoggerUnavailableError

KILL_AT_STEP_ENV = "POSTTRAIN_TEST_SIGKILL_AT_STEP"
PAUSE_AT_ENV = "POSTTRAIN_TEST_PAUSE_AT"


class SettingError(ValueError):
    """A combination of settings this run cannot use; the message names the config keys."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN or inf more often than allowed."""


class NonFiniteLossGuard:
    """Decides what a non-finite loss does: skip the batch (while `max_skips` allows) or stop.

    `skip_possible=False` (optimizer-in-backward: parameters are already updated when the loss
    is known) makes any non-finite loss stop the stage.
    """

    def __init__(self, max_skips: int, config_key: str, skip_possible: bool = True):
        self.max_skips = int(max_skips)
        self.config_key = config_key
        self.skip_possible = skip_possible
        self.skipped = 0

    def should_skip(self, step: int, loss: float, grad_norm: float | None, last_checkpoint: Path | None) -> bool:
        """False when loss and gradient norm are finite; True to skip this batch; raises NonFiniteLossError to stop.

        A non-finite gradient norm counts too: stepping on it would poison the weights (and every
        checkpoint after) even while the loss still looks finite.
        """
        values = f"loss is {loss}" + ("" if grad_norm is None else f", gradient norm is {grad_norm}")
        if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
            return False
        if self.skip_possible and self.skipped < self.max_skips:
            self.skipped += 1
            print(
                f"step {step}: {values}; skipping this batch ({self.skipped} of {self.max_skips} "
                f"allowed by {self.config_key})",
                flush=True,
            )
            return True
        where = f"last good checkpoint: {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
        why = (
            "optimizer_in_backward updates parameters during backward, so batches cannot be skipped"
            if not self.skip_possible
            else f"{self.skipped} batches already skipped, {self.config_key}={self.max_skips}"
        )
        raise NonFiniteLossError(
            f"step {step}: {values} ({why}); {where}. Lower the learning rate, check the data, "
            f"or raise {self.config_key} to skip such batches"
        )


@contextmanager
def explain_out_of_memory(stage: str) -> Iterator[None]:
    """Re-raise CUDA OOM with the settings that reduce memory, in the order they usually help."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise torch.OutOfMemoryError(
            f"{stage}: out of device memory ({str(e).splitlines()[0]}). Settings that reduce memory: "
            f"{stage}.batch_size (raise {stage}.grad_accum to keep the global batch), data.max_seq_len, "
            "memory.activation_checkpointing: 1, memory.chunked_ce: true, memory.optimizer_in_backward: true, "
            f"memory.low_bit_optimizer: adamw8bit, {stage}.method: lora or qlora, or more GPUs (FSDP2 shards "
            "parameters and optimizer state across them)"
        ) from None


def kill_if_requested(step: int) -> None:
    """SIGKILL this process after `step` when POSTTRAIN_TEST_SIGKILL_AT_STEP equals it (tests only)."""
    at = os.environ.get(KILL_AT_STEP_ENV)
    if at is not None and int(at) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def pause_if_requested(stage: str, step: int, stop: StopOnSignal) -> None:
    """Wait after `step` of `stage` until SIGTERM when POSTTRAIN_TEST_PAUSE_AT names them (tests only)."""
    wanted = {item.strip() for item in os.environ.get(PAUSE_AT_ENV, "").split(",")}
    if f"{stage}:{step}" in wanted:
        print(f"{stage}: pausing after step {step} ({PAUSE_AT_ENV})", flush=True)
        while stop.signum is None:
            time.sleep(0.2)


KNOWN_ERRORS: tuple[type[BaseException], ...] = (
    SettingError,
    NonFiniteLossError,
    ResumeError,
    CheckpointError,
    DataError,
    ModelConfigError,
    TokenizerError,
    LoggerUnavailableError,
    OutputExistsError,
    DiskFullError,
    DamagedFileError,
    LogDamagedError,
    torch.OutOfMemoryError,
)


@contextmanager
def exit_on_known_errors(stage: str, extra: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Turn the expected failures of a stage (bad input, the faults above, `extra`) into one line, exit 1.

    Anything else keeps its traceback: it is a bug to report, not a setting to change.
    """
    try:
        try:
            yield
        except OSError as e:  # a full disk under any other write (a log line): said as the writes above say it
            if no_space_left(e) and not isinstance(e, DiskFullError):
                raise DiskFullError.at(Path(e.filename or "."), "writing") from None
            raise
    except KNOWN_ERRORS + extra as e:
        # Finish open progress bars first (tqdm's registry of them), so the error line stands alone and
        # last, not glued to a bar and followed by its final redraw at exit.
        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        where = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
        print(f"{where}{stage}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def run_main(stage: str, main: Callable[[], None], extra_errors: tuple[type[BaseException], ...] = ()) -> None:
    """Every stage's entry: its expected failures (and `extra_errors`) end in one line and exit 1; OOM names the settings."""
    with exit_on_known_errors(stage, extra_errors), explain_out_of_memory(stage):
        main()
