"""Results of a stage's numbered work items, kept across a kill so a rerun skips what is done."""

from __future__ import annotations

import json
import os
from typing import Any

from posttrain.training.checkpointer import resume_dir


class ResultLog:
    """Results of a stage's numbered work items (generation calls), kept in `<out>.resume/` as they finish.

    One JSON line per item, flushed and fsynced, after a header naming the stage key: a rerun
    skips the items already done and a log of another configuration is ignored. Items must be
    deterministic given their number (each generation call has its own seed), so skipping them
    changes nothing. Removed with the rest of the resume state.
    """

    def __init__(self, out: str | os.PathLike, name: str, key: str | None):
        self.path = resume_dir(out) / name
        self.key = key
        self.done: dict[int, Any] = {}
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.is_file() else []
        if lines and json.loads(lines[0]).get("key") == key:
            for line in lines[1:]:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # the last line of a killed write
                    break
                self.done[int(record["item"])] = record["result"]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", encoding="utf-8") as f:  # rewritten without any torn last line
            f.write(json.dumps({"key": key}) + "\n")
            for item, result in self.done.items():
                f.write(json.dumps({"item": item, "result": result}) + "\n")

    def add(self, item: int, result: Any) -> None:
        self.done[item] = result
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"item": item, "result": result}) + "\n")
            f.flush()
            os.fsync(f.fileno())
