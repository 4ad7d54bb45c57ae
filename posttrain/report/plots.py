"""Report figures (matplotlib, Agg backend): each stage's objective curves, eval metrics by stage and
variant, and each stage's effect on the eval metrics over seeds. Stages always in pipeline order."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from posttrain.report.curves import Curve  # noqa: E402
from posttrain.workflow.layout import pipeline_order  # noqa: E402

FRACTIONS = ("accuracy", "pref_acc")  # plotted on [0, 1], as are pass@k
DPI = 110


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


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _note(text: str) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    return fig


def plot_objective_curves(curves: Mapping[tuple[str, str], Sequence[Curve]], path: Path) -> None:
    """One row per stage, one panel per (stage, metric key), one line per distinct stage output."""
    if not curves:
        _save(_note("no stage logged its objective keys in metrics.jsonl"), path)
        return
    stages = list(dict.fromkeys(stage for stage, _ in curves))
    fields = {stage: [f for s, f in curves if s == stage] for stage in stages}
    cols = max(len(f) for f in fields.values())
    fig, axes = plt.subplots(len(stages), cols, figsize=(4.5 * cols, 3.0 * len(stages)), squeeze=False)
    for row, stage in zip(axes, stages):
        for ax in row[len(fields[stage]):]:
            ax.set_visible(False)
        for ax, field in zip(row, fields[stage]):
            for label, steps, values in curves[(stage, field)]:
                ax.plot(steps, values, label=label, linewidth=1.2, marker="o", markersize=2.5)
            ax.set_title(f"{stage}: {field}")
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    _save(fig, path)


def plot_eval_metrics(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], path: Path) -> None:
    """One panel per metric: stages on the x axis, one bar per variant (missing values leave a gap)."""
    stages = pipeline_order({r["stage"] for r in rows})
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
        ax.set_xlim(-0.5, len(stages) - 0.5)
        ax.set_title(metric)
        if _is_fraction(metric):
            ax.set_ylim(0, 1.02)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    _save(fig, path)


def plot_stage_effects(effects: pd.DataFrame, metrics: Sequence[str], path: Path) -> None:
    """Per metric (columns): the value after each stage (top) and its change from the previous stage
    (bottom), one bar per variant group, mean over seeds with a +-1 std error bar."""
    stages = pipeline_order(set(effects["stage"]))
    groups = list(dict.fromkeys(effects["group"]))
    n = effects.groupby("group", sort=False)["n"].max()
    fig, axes = plt.subplots(2, len(metrics), figsize=(3.6 * len(metrics), 6.4), squeeze=False)
    width = 0.8 / max(len(groups), 1)
    for col, metric in enumerate(metrics):
        for i, group in enumerate(groups):
            rows = effects[(effects["group"] == group) & (effects["metric"] == metric)]
            rows = rows.set_index("stage").reindex(stages)  # a stage without the metric leaves a gap
            xs = [j - 0.4 + width * (i + 0.5) for j in range(len(stages))]
            label = f"{group} (n={n[group]})"
            axes[0][col].bar(xs, rows["mean"], width=width, yerr=rows["std"], capsize=3, label=label)
            axes[1][col].bar(xs, rows["delta_mean"], width=width, yerr=rows["delta_std"], capsize=3, label=label)
        axes[0][col].set_title(metric)
        axes[1][col].set_title(f"change in {metric} from the previous stage", fontsize=9)
        if effects.loc[effects["metric"] == metric, "delta_mean"].isna().all():
            axes[1][col].text(0.5, 0.75, "no previous stage measured it", ha="center", va="center",
                              transform=axes[1][col].transAxes)
        axes[1][col].axhline(0, color="black", linewidth=0.8)
        if _is_fraction(metric):
            axes[0][col].set_ylim(0, 1.02)
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xticks(range(len(stages)), stages)
            ax.set_xlim(-0.5, len(stages) - 0.5)  # a stage without a value keeps its slot
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _save(fig, path)
