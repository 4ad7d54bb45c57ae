"""Multi-turn environments for RL: the interface (`base`), tool calls (`tool_calls`), the sandbox, the built-ins,
and episodes as token-in/token-out trajectories (`posttrain.envs.episodes`, which needs torch; this package
itself does not, so the dry run loads environments without it)."""

from __future__ import annotations

import os
from typing import Any

from posttrain.envs.base import Environment, Reply, ToolEnvironment, tool_schema
from posttrain.envs.builtin import BUILTIN_ENVIRONMENTS

__all__ = ["BUILTIN_ENVIRONMENTS", "Environment", "Reply", "ToolEnvironment", "load_environment", "tool_schema"]


def load_environment(fn: str, workdir: str | os.PathLike | None = None) -> type[Environment]:
    """The class `environment.fn` names: a built-in (`calculator`, `python`, `guess_number`), `module:Class` or
    `path/file.py:Class` (relative to the working directory, loaded as reward files are)."""
    if fn in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[fn]
    from posttrain.rewards.specs import RewardSpec, user_function

    if ":" not in fn:
        raise ValueError(f"environment {fn!r}: not a built-in ({', '.join(BUILTIN_ENVIRONMENTS)}) nor "
                         "module:Class or path/file.py:Class")
    cls: Any = user_function(RewardSpec(fn), workdir, kind="environment")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"environment {fn!r}: {cls!r} is not a subclass of posttrain.envs.Environment")
    return cls
