"""Suite-wide settings: test files run in parallel (pytest-xdist, `--dist=loadfile` in pyproject.toml).

Many slow tests run single-threaded stage processes, so on the 2-core CI machine two workers
shorten the suite (measured: 36 -> 29 min; the longest tests already use both cores and slow down
when they share them). Every test process keeps to one torch thread, and the stage processes it
starts one each (`sft_testing.env_for`), so float reductions, hence results, are the same
whether the suite runs in parallel or not. The longest files start first, so the workers finish together instead of one
running a long file alone at the end."""

from __future__ import annotations

import pytest
import torch

# Test files taking several minutes each (a learning comparison, a trained starting policy, the
# Slurm cluster, the pipeline on every model family), longest first; every other file keeps its collection order after them. xdist
# queues a worker's next file once at most two tests of its current one are left, so inside a
# file the tests that declare a longer timeout than the suite's go first: no file waits behind them.
LONGEST_FILES = ("test_grpo.py", "test_slurm.py", "test_hf_pipeline.py", "test_distill.py", "test_async_resume.py",
                 "test_dpo_stage.py", "test_reliability.py")  # by test time measured on 2 cores, 2026-12-04


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default_timeout = float(config.getini("timeout") or 0)

    def rank(item: pytest.Item) -> tuple[int, str, bool]:
        name = item.path.name
        file_rank = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        marker = item.get_closest_marker("timeout")
        declared_long = marker is not None and bool(marker.args) and float(marker.args[0]) > default_timeout
        return file_rank, str(item.path), not declared_long

    items.sort(key=rank)  # stable: otherwise tests keep their collection order
