"""What bf16 autocast would buy a training step on this CPU: one step's time in float32 and under bf16 autocast.

    python benchmarks/speed/cpu_bf16.py MODEL_DIR [--rows 16] [--seq 40] [--steps 3]

A forward, backward and AdamW step of the model folder (posttrain's model, full-vocabulary
cross-entropy) on random tokens, `--steps` timed after one warm-up, in float32 and then with
`torch.autocast("cpu", torch.bfloat16)`; prints both and their ratio with the CPU's bf16 flags
(AMX tiles and AVX-512 BF16 are what make bf16 matmuls fast on a CPU). The stages train in float32
on a CPU; this says what that choice costs here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def step_seconds(model, tokens, steps: int, bf16: bool) -> float:
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model.lm_head(model(tokens)).float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path, help="an HF model folder")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--seq", type=int, default=40)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    import torch

    from posttrain.model_files import load_hf_model
    from posttrain.report.machine import ISA_FLAGS, cpu_model_and_flags

    model = load_hf_model(args.model).train()
    tokens = torch.randint(0, model.hf_config["vocab_size"], (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    fp32 = step_seconds(model, tokens, args.steps, bf16=False)
    bf16 = step_seconds(model, tokens, args.steps, bf16=True)
    cpu, flags = cpu_model_and_flags()
    isa = {flag: flag in flags for flag in ISA_FLAGS}
    result = {"model": str(args.model), "rows": args.rows, "seq": args.seq, "threads": torch.get_num_threads(),
              "cpu": cpu, "isa": isa, "float32_step_s": fp32, "bf16_autocast_step_s": bf16, "speedup": fp32 / bf16}
    print(json.dumps(result))
    print(f"float32 {fp32:.2f} s/step, bf16 autocast {bf16:.2f} s/step: {fp32 / bf16:.2f}x on {cpu} "
          f"({', '.join(f for f, on in isa.items() if on)}), {result['threads']} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
