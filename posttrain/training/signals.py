"""SIGTERM (Slurm preemption, time limits) as a stop at the next step boundary, agreed by every rank."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class StopOnSignal:
    """Turns SIGTERM (Slurm preemption, time limits) into a request honoured at the next step boundary.

    `requested()` is collective under torch.distributed: a signal seen by any rank stops all of
    them at the same step, so they all take part in the final checkpoint.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signum: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def requested(self) -> bool:
        flag = 0 if self.signum is None else int(self.signum)
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([flag], dtype=torch.int64)
            if dist.get_backend() == "nccl":
                t = t.cuda()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        if flag and self.signum is None:
            self.signum = flag
        return flag != 0

    def exit(self, step: int, checkpoint: Path) -> None:
        """Leave with a non-zero status (128 + signal) after the checkpoint at `step` is on disk."""
        signum = self.signum or signal.SIGTERM
        print(
            f"received {signal.Signals(signum).name}: saved resume state at step {step} in {checkpoint}; "
            "rerun the same command to continue",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
