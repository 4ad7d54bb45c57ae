"""The built-in environments: a calculator and a Python tool (both tool use, the answer scored by the verifiers),
and guess-the-number (a game only the environment's replies make solvable, scored by the environment)."""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from posttrain.envs.base import Environment, Message, Reply, ToolEnvironment
from posttrain.envs.sandbox import Limits, run_python

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_DIGITS = 60  # a result longer than this is refused (no 9**9**9)


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // % and parentheses on numbers), or an error line."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            result = _OPS[type(node.op)](value(node.left), value(node.right))
            if len(str(result)) > MAX_DIGITS:
                raise ValueError("the result is too large")
            return result
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
        raise ValueError(f"{what} is not supported (only + - * / // % and parentheses on numbers)")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as err:
        return f"error: {err.msg if isinstance(err, SyntaxError) else err}"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)


class Calculator(ToolEnvironment):
    """`calculate(expression)`; the episode ends with the model's first answer that calls no tool."""

    TOOLS = {"calculate": ("Evaluate an arithmetic expression", {"expression": "for example 12*(3+4)"})}

    def calculate(self, expression: str) -> str:
        return calculate(expression)


class Python(ToolEnvironment):
    """`run_python(code)` in the sandbox (`posttrain.envs.sandbox`): its printed output comes back.
    Args: the fields of `sandbox.Limits` (`timeout_s`, `memory_mb`, `output_chars`, ..., `allow_missing`)."""

    TOOLS = {"run_python": ("Run Python code and return what it prints", {"code": "a Python program"})}
    SANDBOXED = True

    def run_python(self, code: str) -> str:
        return run_python(code, sandbox_limits(self.args))


def sandbox_limits(args: dict[str, Any]) -> Limits:
    """The sandbox's limits from an environment's args (the keys `Limits` has; the rest are the environment's)."""
    fields = {k: v for k, v in args.items() if k in Limits.__dataclass_fields__}
    return Limits(**{**fields, "allow_missing": tuple(fields.get("allow_missing", ()))})


class GuessNumber(Environment):
    """Find a number between 1 and `high` (arg, default 16) from "higher" / "lower" replies; reward 1 for finding
    it. The number is drawn from the row's id, so each row is one game, the same on every run."""

    def __init__(self, example: dict[str, Any], **args: Any):
        super().__init__(example, **args)
        self.high = int(args.get("high", 16))
        self.secret = random.Random(str(example.get("id", example.get("prompt")))).randint(1, self.high)

    def messages(self) -> list[Message]:
        return [{"role": "user", "content": f"I am thinking of a number from 1 to {self.high}. "
                                            "Guess it: answer with one number each turn."}]

    def step(self, message: Message) -> Reply:
        words = str(message.get("content", "")).replace("#", " ").split()
        guess = next((int(w) for w in reversed(words) if w.lstrip("-").isdigit()), None)
        if guess is None:
            return Reply([{"role": "user", "content": "Answer with a number."}])
        if guess == self.secret:
            return Reply(reward=1.0, done=True)
        return Reply([{"role": "user", "content": "higher" if guess < self.secret else "lower"}])


BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": Calculator, "python": Python,
                                                      "guess_number": GuessNumber}
