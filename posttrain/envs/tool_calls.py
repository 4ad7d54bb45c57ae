"""Tool calls in a model's text, in the Hermes / Qwen convention the `chatml-tools` template renders:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after the message's text."""

from __future__ import annotations

import json
import re
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def parse_assistant(text: str) -> tuple[dict[str, Any], int]:
    """(the assistant message, how many tool-call blocks were malformed) from a turn's decoded text.

    The message's content is the text before the first `<tool_call>`; each well-formed block (a JSON object
    with a string `name` and object `arguments`) becomes an OpenAI-style tool call. A malformed block is left
    out of the calls and counted, so the environment answers what the model did call.
    """
    start = text.find(_OPEN)
    message: dict[str, Any] = {"role": "assistant", "content": (text if start < 0 else text[:start]).strip()}
    calls, invalid = [], 0
    blocks = _CALL.findall(text)
    invalid += text.count(_OPEN) - len(blocks)  # opened and never closed (a truncated turn)
    for block in blocks:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            invalid += 1
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)):
            invalid += 1
            continue
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}})
    if calls:
        message["tool_calls"] = calls
    return message, invalid


def format_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model writes it (what SFT demonstrations teach)."""
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
