"""Tokens/s of posttrain's KV-cache sampler over `transformers.generate`, same model and prompts.

    python benchmarks/speed/generation.py [--batch 32] [--new-tokens 128] [--preset tiny]

Both sides decode greedily for exactly --new-tokens tokens (no early stop) from the same
left-padded ragged prompts; the ratio comes from one run, best of --repeats for each side.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from posttrain.generation import SamplingParams, generate
from posttrain.models import Transformer, preset_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    import transformers

    torch.manual_seed(0)
    cfg = preset_config(args.preset, vocab_size=512, pad_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg)).eval().to(args.device)
    ours = Transformer(hf.config.to_dict()).eval().to(args.device)
    ours.load_state_dict(hf.state_dict())

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (int(n),), generator=g).tolist() for n in torch.randint(8, 48, (args.batch,), generator=g)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)
    attention = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        attention[i, width - len(p) :] = 1
    params = SamplingParams(max_new_tokens=args.new_tokens)

    def run_ours():
        return generate(ours, prompts, params, pad_id=0)

    def run_hf():
        return hf.generate(ids, attention_mask=attention, do_sample=False, max_new_tokens=args.new_tokens,
                           min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)

    def timed(fn) -> float:
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    tokens = args.batch * args.new_tokens
    run_hf(), run_ours()  # warm-up
    # Alternate the two sides so a change in machine load hits both; keep each side's best.
    t_hf, t_ours = float("inf"), float("inf")
    for _ in range(args.repeats):
        t_hf = min(t_hf, timed(run_hf))
        t_ours = min(t_ours, timed(run_ours))
    result = {
        "device": args.device,
        "preset": args.preset,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "posttrain_tokens_per_s": round(tokens / t_ours, 1),
        "transformers_tokens_per_s": round(tokens / t_hf, 1),
        "ratio": round(t_hf / t_ours, 2),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    print(json.dumps(result, indent=2))
    print(f"posttrain sampler / transformers.generate: {result['ratio']}x (target >= 2x)")


if __name__ == "__main__":
    main()
