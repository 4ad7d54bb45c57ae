"""Peak memory of one piece of work, measured in a fresh process so variants cannot pollute each other.

CPU: the process's resident-set high-water mark (Linux ``VmHWM``), reset right before the work
by writing 5 to ``/proc/self/clear_refs``, minus the resident set at that moment. This counts
every page the work touched (tensors, allocator slack, temporaries of fused kernels), which is
what decides whether a job fits in a node's memory. The child runs with glibc's mmap threshold
fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``): otherwise glibc raises it after the first large
free and later tensors come from a heap that is not returned to the system, so the resident set
would track the heap's history rather than live tensors (measured: repeated runs of the same
work then differ by 2x). Timings under it are slow (many page-faulted mmaps); time runs with
``pin_allocator=False``. CUDA: ``torch.cuda.max_memory_allocated``
above the allocation level after setup.

``setup`` and ``run`` must be module-level functions (they are pickled by name into a spawned
process), so scripts using this need an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_MIB = 1024 * 1024


@dataclass(frozen=True)
class PeakMemory:
    peak_mib: float  # peak during ``run`` above the level right after ``setup``
    baseline_mib: float  # resident (CPU) or allocated (CUDA) memory after ``setup``
    seconds: float  # wall time of ``run``
    result: Any  # what ``run`` returned (keep it small: it is pickled back)


def _status_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key}: CPU peak memory needs Linux")
    return int(match.group(1))


def _measure(setup: Callable[..., Any], run: Callable[[Any], Any], args: tuple, device: str) -> PeakMemory:
    state = setup(*args)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        baseline = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    result = run(state)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM") * 1024
    seconds = time.perf_counter() - start
    return PeakMemory((peak - baseline) / _MIB, baseline / _MIB, seconds, result)


def peak_memory(setup: Callable[..., Any], run: Callable[[Any], Any], *args: Any, device: str = "cpu",
                pin_allocator: bool = True) -> PeakMemory:
    """Run ``state = setup(*args)`` then ``run(state)`` in a freshly started (spawned) process; measure ``run`` only.

    The child imports only what ``setup`` and the calling script's top level import, so its
    resident set holds those libraries and nothing the parent loaded. ``pin_allocator=False``
    leaves glibc's mmap threshold at its default: the CPU peak is then less reliable, but the
    run's time is what a job's would be (with the threshold pinned every large tensor is a fresh,
    page-faulted mapping: measured 30-45% slower here).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if pin_allocator:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # read by glibc when the child starts
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(_measure, setup, run, args, device).result()
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
