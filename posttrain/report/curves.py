"""Training curves of each stage's own objective, read from its `metrics.jsonl`.

One `loss` says little across stages: GRPO's policy-gradient loss sits near zero whatever the
reward does, and DPO's hides whether the chosen answer wins. So each stage is followed on the
keys its script logs for what it optimizes (the names are those the stage scripts write):
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.workflow.layout import pipeline_order

OBJECTIVES: dict[str, tuple[str, ...]] = {
    # held-out keys (rules.HELD_OUT_METRICS) at step 0, every <stage>.eval_every steps and the last step
    "sft": ("loss", "eval_loss"),  # stages/sft.py: training CE per step; held-out CE
    "dpo": ("rewards/accuracy", "rewards/margin", "eval_pref_acc"),  # stages/dpo.py: implicit-reward win rate, margin
    "reward_model": ("loss", "held_out_accuracy"),  # stages/reward_model.py (reward_model.source: train)
    "grpo": ("reward_mean", "kl", "entropy", "eval_accuracy"),  # posttrain.rl.rollout stats; `kl` with grpo.kl_coef > 0
    "distill": ("divergence", "eval_divergence"),  # stages/distill.py: KD divergence per step; held-out divergence
}

Curve = tuple[str, list[float], list[float]]  # label, steps, values
Runs = Mapping[str, Mapping[str, tuple[Sequence[str], Sequence[Mapping[str, Any]]]]]


def objective_curves(stage_runs: Runs) -> dict[tuple[str, str], list[Curve]]:
    """{(stage, key): [(label, steps, values)]} from {stage: {output key: (variant names, records)}}.

    Stages in pipeline order, keys in `OBJECTIVES` order; a key no run logged has no entry.
    Variants that share a stage output share one curve, labelled with all their names.
    """
    curves: dict[tuple[str, str], list[Curve]] = {}
    for stage in pipeline_order(s for s in stage_runs if s in OBJECTIVES):
        for field in OBJECTIVES[stage]:
            for key, (variants, records) in stage_runs[stage].items():
                points = [(r["step"], r[field]) for r in records
                          if isinstance(r.get(field), (int, float)) and "step" in r]
                if points:
                    steps, values = zip(*points)
                    curves.setdefault((stage, field), []).append(
                        (f"{', '.join(variants)} ({key[:6]})", list(steps), list(values)))
    return curves
