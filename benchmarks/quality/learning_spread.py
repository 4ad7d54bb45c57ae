"""The spread of the suite's learning claims over seeds and torch threads, one line a run.

    python benchmarks/quality/learning_spread.py dpo|grpo|kd [--seeds 1234 1 2] [--threads 1 2]

A learning test runs once in CI, on one seed and one thread; its margins are set from this
script's spread (a change of threads changes float rounding as a change of CPU does). Each run
repeats the test's own setup (data, starting SFT, the trained stage) from tests/ with the run's
seed and thread count and prints the measures the test asserts on. The runs of one thread count
go two at a time (one core each) when `--parallel 2`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def with_seed(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    return {**cfg, "seed": seed}


def dpo_run(tmp: Path, seed: int, threads: int) -> dict[str, Any]:
    import test_dpo_stage as t

    data, sft = t.sft_policy(tmp, seed, threads)
    t.run_dpo(with_seed(t.dpo_config("dpo-e2e", **t.DPO), seed), data, sft, tmp / "dpo", OMP_NUM_THREADS=str(threads))
    s = t.summary(tmp / "dpo")
    before, after = t.greedy_scores(sft, data), t.greedy_scores(tmp / "dpo", data)
    return {"pref_acc": s["pref_acc"], "likelihood_acc": s["likelihood_acc"], "likelihood_acc_sft": s["likelihood_acc_sft"],
            "accuracy_sft": before["accuracy"], "accuracy_dpo": after["accuracy"],
            "format_sft": before["format"], "format_dpo": after["format"]}


def grpo_run(tmp: Path, seed: int, threads: int) -> dict[str, Any]:
    import grpo_testing as g
    import test_grpo as t

    data, sft = g.starting_policy(tmp, seed, threads)
    g.run_grpo(with_seed(g.grpo_config("sync", **t.LEARN), seed), data, sft, tmp / "grpo", threads=threads)
    s, records = g.summary(tmp / "grpo"), g.step_records(tmp / "grpo")
    return {"accuracy_before": s["eval_accuracy_before"], "accuracy_after": s["eval_accuracy_after"],
            **t.reward_rise(records)}


def kd_run(tmp: Path, seed: int, threads: int) -> dict[str, Any]:
    import test_distill as t

    data, teacher = t.learning_teacher(tmp, seed, threads)
    labelled = t.kd_against_labels(tmp / "labelled", data, teacher, seed, threads)
    unlabelled = t.kd_on_unlabelled_prompts(tmp / "unlabelled", data, teacher, seed, threads)
    return {**labelled, **{f"unlabelled_{k}": v for k, v in unlabelled.items() if k != "size_ratio"}}


RUNS: dict[str, Callable[[Path, int, int], dict[str, Any]]] = {"dpo": dpo_run, "grpo": grpo_run, "kd": kd_run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("claim", choices=sorted(RUNS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--parallel", type=int, default=2, help="concurrent one-thread runs")
    args = parser.parse_args()

    def one(seed: int, threads: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            result = RUNS[args.claim](Path(tmp), seed, threads)
        print(json.dumps({"claim": args.claim, "seed": seed, "threads": threads, **result}), flush=True)

    for threads in args.threads:
        with ThreadPoolExecutor(args.parallel if threads == 1 else 1) as pool:
            for future in [pool.submit(one, seed, threads) for seed in args.seeds]:
                future.result()


if __name__ == "__main__":
    main()
