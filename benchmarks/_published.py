"""A benchmark's table as the docs carry it: the machine line beside it, written between a page's markers.

Numbers in the docs come from a command anyone can rerun, named beside them with the machine (CPU model, ISA
flags, CPUs), the date and the commit; the table is written by the run, never typed.
"""

from __future__ import annotations

import os
import shlex
from datetime import datetime, timezone
from pathlib import Path

from posttrain.report.machine import ISA_FLAGS, cpu_model_and_flags
from posttrain.report.readme_table import replace_block
from posttrain.utils.provenance import git_commit


def machine_line(script: str, words: list[str], what: str) -> str:
    """The footer: `what` was measured, on which machine, when, at which commit, by which command."""
    cpu, flags = cpu_model_and_flags()
    isa = ", ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2"
    command = shlex.join(["python", script, *words])
    return (f"*{what}; {cpu} ({isa}), {os.cpu_count()} CPUs, {datetime.now(timezone.utc):%Y-%m-%d}, commit "
            f"{(git_commit() or 'unknown')[:12]}; made by `{command}`.*")


def publish(table: str, footer: str, update: Path | None, block: str) -> None:
    """Print the table and its footer; with `update`, write them between the page's `<!-- block:begin/end -->`."""
    text = f"{table}\n\n{footer}"
    print(text)
    if update:
        update.write_text(replace_block(update.read_text(), text, str(update), block))
