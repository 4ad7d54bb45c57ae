"""Write demos.jsonl: tool-use demonstrations for config/examples/tool-use.yaml's SFT, in OpenAI's message layout.

Each is a training-side problem of the recipe's task (never one held out for eval), the model calling the
calculator with the problem's expression, the tool's result, and the answer copied from it:

    python config/examples/tool-use/make_demos.py   # rewrites config/examples/tool-use/demos.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.data.tasks import make_splits
from posttrain.envs.builtin import Calculator, calculate

TASK = {"name": "arithmetic", "ops": ["mul"], "digits": 2}  # what the recipe's data.tasks generate
N, SEED = 400, 7


def demonstration(row: dict) -> dict:
    expression = row["prompt"].removeprefix("Compute ").removesuffix(".")
    result = calculate(expression)
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return {"messages": [{"role": "user", "content": row["prompt"]},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "calculate", "content": result},
                         {"role": "assistant", "content": f"#### {result}"}],
            "tools": Calculator({"prompt": ""}).tools()}


if __name__ == "__main__":
    rows = make_splits([TASK], {"sft": N}, seed=SEED)["sft"]
    out = Path(__file__).with_name("demos.jsonl")
    out.write_text("".join(json.dumps(demonstration(r)) + "\n" for r in rows))
    print(f"{out}: {len(rows)} demonstrations")
