"""What a multi-turn environment is: from a dataset row, the opening messages and the tools offered; on each model
turn, the environment's reply (tool results or a message of its own), a reward and whether the episode ended.

An environment is a class; one instance runs one episode (`cls(example, **args)`), so its state is plain
attributes. The runner (`posttrain.envs.episodes`) caps the turns and the tokens, keeps the model's tokens exactly
as sampled and appends the environment's turns as the chat template renders them.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

Message = dict[str, Any]


@dataclass
class Reply:
    """The environment's answer to a model turn: messages to append (`tool` results, or a `user` message), the
    turn's reward (summed over the episode) and whether the episode is over."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


class Environment(ABC):
    """One episode. `example` is the prompts (or eval) split's row: `prompt`, `answer`, `task` and every column
    of the source. Subclasses define `step`; `messages` and `tools` have defaults. `SANDBOXED`: the environment
    runs model-written code in `posttrain.envs.sandbox`, so the dry run checks that this machine can confine it
    (with `args.allow_missing`)."""

    SANDBOXED: ClassVar[bool] = False

    def __init__(self, example: Mapping[str, Any], **args: Any):
        self.example = dict(example)
        self.args = args

    def messages(self) -> list[Message]:
        """The conversation the model starts from: the row's prompt as the user's message."""
        return [{"role": "user", "content": str(self.example["prompt"])}]

    def tools(self) -> list[dict[str, Any]] | None:
        """The tools offered (JSON schemas as chat templates take them as `tools`); None: none."""
        return None

    @abstractmethod
    def step(self, message: Message) -> Reply:
        """The reply to the model's turn `message` ({role: assistant, content, tool_calls?}, parsed from its tokens)."""


Tool = Callable[..., str]


def tool_schema(name: str, description: str, parameters: Mapping[str, str]) -> dict[str, Any]:
    """An OpenAI-style function schema with string parameters (`{name: description}`), all required."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {p: {"type": "string", "description": d}
                                                         for p, d in parameters.items()},
                       "required": list(parameters)}}}


class ToolEnvironment(Environment):
    """The model calls tools until it answers without one; that answer ends the episode (the verifiers score it).

    `TOOLS` maps a tool's name to (description, parameters); the method of the same name runs it and returns the
    text of its result. A call to an unknown tool, or with wrong arguments, gets an error result, and the episode
    goes on: the model can recover, and the run never stops on a model's mistake.
    """

    TOOLS: ClassVar[dict[str, tuple[str, dict[str, str]]]] = {}

    def tools(self) -> list[dict[str, Any]] | None:
        return [tool_schema(name, description, params) for name, (description, params) in self.TOOLS.items()]

    def step(self, message: Message) -> Reply:
        calls = message.get("tool_calls") or []
        if not calls:
            return Reply(done=True)
        results = []
        for call in calls:
            function = call.get("function", {})
            name, arguments = function.get("name"), function.get("arguments", {})
            results.append({"role": "tool", "name": name, "content": self._run(name, arguments)})
        return Reply(results)

    def _run(self, name: Any, arguments: Any) -> str:
        if name not in self.TOOLS:
            return f"error: no tool {name!r}; tools: {', '.join(self.TOOLS)}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as err:
                return f"error: arguments are not JSON ({err.msg})"
        expected = set(self.TOOLS[name][1])
        if not isinstance(arguments, dict) or set(arguments) != expected:
            return f"error: {name} takes {', '.join(sorted(expected))}"
        return str(getattr(self, name)(**{k: str(v) for k, v in arguments.items()}))
