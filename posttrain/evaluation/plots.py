"""Report figures (matplotlib, Agg backend): training loss per stage, eval metrics by stage and variant."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Curve = tuple[str, list[float], list[float]]  # label, steps, values
FRACTIONS = ("accuracy", "pref_acc")  # plotted on [0, 1], as are pass@k


def _is_fraction(metric: str) -> bool:
    return metric in FRACTIONS or metric.startswith("pass@")


def _grid(n: int, max_cols: int = 3, size: tuple[float, float] = (4.5, 3.2)) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(n, max_cols)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def loss_curves(stage_runs: Mapping[str, Mapping[str, tuple[list[str], list[Mapping[str, Any]]]]],
                field: str = "loss") -> dict[str, list[Curve]]:
    """{stage: [(label, steps, values)]} from {stage: {key: (variant names, metrics.jsonl records)}}.

    Variants that share a stage output share one curve, labelled with all their names.
    """
    curves: dict[str, list[Curve]] = {}
    for stage, runs in stage_runs.items():
        for key, (variants, records) in runs.items():
            points = [(r["step"], r[field]) for r in records if isinstance(r.get(field), (int, float)) and "step" in r]
            if points:
                steps, values = zip(*points)
                curves.setdefault(stage, []).append((f"{', '.join(variants)} ({key[:6]})", list(steps), list(values)))
    return curves


def plot_loss_curves(curves: Mapping[str, Sequence[Curve]], path: Path, field: str = "loss") -> None:
    """One panel per stage, one line per distinct stage output."""
    if not curves:
        fig, ax = plt.subplots(figsize=(5, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, f"no stage logged '{field}' in metrics.jsonl", ha="center", va="center")
    else:
        fig, axes = _grid(len(curves))
        for ax, (stage, lines) in zip(axes, curves.items()):
            for label, steps, values in lines:
                ax.plot(steps, values, label=label, linewidth=1.2)
            ax.set_title(stage)
            ax.set_xlabel("step")
            ax.set_ylabel(field)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_eval_metrics(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], path: Path) -> None:
    """One panel per metric: stages on the x axis, one bar per variant (missing values leave a gap)."""
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    values = {(r["variant"], r["stage"]): r for r in rows}
    fig, axes = _grid(len(metrics))
    width = 0.8 / max(len(variants), 1)
    for ax, metric in zip(axes, metrics):
        for i, variant in enumerate(variants):
            heights = [values.get((variant, s), {}).get(metric) for s in stages]
            heights = [math.nan if h is None else float(h) for h in heights]
            xs = [j - 0.4 + width * (i + 0.5) for j in range(len(stages))]
            ax.bar(xs, heights, width=width, label=variant)
        ax.set_xticks(range(len(stages)), stages)
        ax.set_title(metric)
        if _is_fraction(metric):
            ax.set_ylim(0, 1.02)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
