"""Peak memory of one KD loss forward+backward: chunked (posttrain.losses.kd_loss) vs naive.

Naive KD materializes the student's and the teacher's full ``[tokens, vocab]`` logits and takes
the divergence over them; the chunked loss never holds more than one chunk of either. Both run
at Qwen3's real vocabulary (151,936), each in a fresh process, from the same inputs: the output
projections of a student and a teacher and their final hidden states (teacher's without grad).
The losses and gradients of the two are compared as a correctness check.

    python benchmarks/memory/distill_memory.py [--tokens 2048] [--chunks 8] [--kind forward_kl] [--device cpu]

Target (issue 9): chunked peak <= 0.5x naive.
"""

from __future__ import annotations

import sys
from pathlib import Path
import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), *(str(d) for d in sorted(BENCH.glob("[a-z]*/")))]  # benchmarks/ and its groups
from _memory import peak_memory
from posttrain.losses.chunked import IGNORE_INDEX
from posttrain.losses.kd import kd_loss, token_divergence


def setup(cfg: dict[str, Any], warm_up: bool = True) -> dict[str, Any]:
    """Inputs for one run. First both variants run once at a tiny size, so the code pages and
    thread pools they load on first use are resident before the measurement starts."""
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    if warm_up:
        tiny = {**cfg, "vocab": min(cfg["vocab"], 8192), "tokens": min(cfg["tokens"], 256)}
        run_naive(setup(tiny, warm_up=False))
        run_chunked(setup(tiny, warm_up=False))
    torch.manual_seed(cfg["seed"])
    device = torch.device(cfg["device"])
    vocab, tokens = cfg["vocab"], cfg["tokens"]
    student = nn.Linear(cfg["student_dim"], vocab, bias=False, device=device)
    teacher = nn.Linear(cfg["teacher_dim"], vocab, bias=False, device=device).requires_grad_(False)
    labels = torch.randint(0, vocab, (1, tokens), device=device)
    labels[0, : tokens // 8] = IGNORE_INDEX  # a prompt share that does not count
    return {
        "student": student,
        "teacher": teacher,
        "student_hidden": torch.randn(1, tokens, cfg["student_dim"], device=device, requires_grad=True),
        "teacher_hidden": torch.randn(1, tokens, cfg["teacher_dim"], device=device),
        "labels": labels,
        "cfg": cfg,
    }


def _summary(loss: torch.Tensor, state: dict[str, Any]) -> dict[str, float]:
    loss.backward()
    return {
        "loss": loss.item(),
        "grad_hidden_norm": state["student_hidden"].grad.norm().item(),
        "grad_weight_norm": state["student"].weight.grad.norm().item(),
    }


def run_naive(state: dict[str, Any]) -> dict[str, float]:
    """Full logits of both models; divergence at every position, averaged over the kept ones."""
    cfg, labels = state["cfg"], state["labels"]
    student_logits = state["student"](state["student_hidden"])
    with torch.no_grad():
        teacher_logits = state["teacher"](state["teacher_hidden"])
    mask = (labels != IGNORE_INDEX).flatten()
    div = token_divergence(
        student_logits.flatten(0, 1), teacher_logits.flatten(0, 1), cfg["kind"], cfg["beta"], cfg["temperature"]
    )
    div = (div * mask).sum() / mask.sum()
    ce = F.cross_entropy(student_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
    return _summary((1 - cfg["ce_weight"]) * div + cfg["ce_weight"] * ce, state)


def run_chunked(state: dict[str, Any]) -> dict[str, float]:
    cfg = state["cfg"]
    loss, _ = kd_loss(
        state["student_hidden"],
        state["student"],
        state["teacher_hidden"],
        state["teacher"],
        state["labels"],
        kind=cfg["kind"],
        beta=cfg["beta"],
        temperature=cfg["temperature"],
        ce_weight=cfg["ce_weight"],
        num_chunks=cfg["chunks"],
    )
    return _summary(loss, state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--student-dim", type=int, default=512)
    parser.add_argument("--teacher-dim", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--kind", choices=["forward_kl", "reverse_kl", "jsd"], default="forward_kl")
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ce-weight", type=float, default=0.5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    cfg = vars(parser.parse_args())

    results = {}
    for name, run in (("naive", run_naive), ("chunked", run_chunked)):
        measured = peak_memory(setup, run, cfg, device=cfg["device"])
        results[name] = {"peak_mib": measured.peak_mib, "seconds": measured.seconds, **measured.result}
        print(
            f"{name:8s} peak above baseline {measured.peak_mib:9.1f} MiB   {measured.seconds:6.1f} s   "
            f"loss {measured.result['loss']:.6f}   |grad h| {measured.result['grad_hidden_norm']:.6e}",
            flush=True,
        )
    ratio = results["chunked"]["peak_mib"] / results["naive"]["peak_mib"]
    loss_rel = abs(results["chunked"]["loss"] - results["naive"]["loss"]) / abs(results["naive"]["loss"])
    print(f"chunked / naive peak memory: {ratio:.3f}x (target <= 0.5x); loss relative difference {loss_rel:.1e}")
    if cfg["json"]:
        with open(cfg["json"], "w") as f:
            json.dump({"config": cfg, "results": results, "ratio": ratio, "loss_rel_diff": loss_rel}, f, indent=2)


if __name__ == "__main__":
    main()
