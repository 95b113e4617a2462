"""Training curves from a run's metrics.jsonl, drawn to PNG for people without a dashboard."""

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llmstack.errors import UserError, require

METRICS_FILE = "metrics.jsonl"

# (panel title, y label, [(metric, legend label)], log-scale y)
PANELS = [
    ("Loss", "loss", [("loss", "train"), ("val_loss", "validation")], False),
    ("Gradient norm (before clipping)", "global L2 norm", [("grad_norm", "grad norm")], True),
    ("Learning rate", "lr", [("lr", "lr")], False),
    ("Throughput", "tokens/s", [("tokens_per_s", "tokens/s")], False),
]


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of `run_dir/metrics.jsonl`, one dict per line, each with a "step"."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise UserError(f"{path} not found: pass the output directory of a training run")
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write leaves a partial last line; anything else is corruption.
            if number < len(lines):
                raise UserError(f"{path}: record {number} is not valid JSON") from None
    if not records:
        raise UserError(f"{path} has no records yet: plot after the first logging step")
    return records


def series(records: Iterable[Mapping[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping records without it and non-finite values."""
    points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
    return [p[0] for p in points], [p[1] for p in points]


EXPERT_LOAD = re.compile(r"moe/load/layer(\d+)/expert(\d+)$")


def expert_load_panels(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, list[tuple[str, str]], bool]]:
    """Panels of a mixture-of-experts run: max/mean load of every MoE layer, then each layer's load
    per expert (RouterStatsWindow's metrics); none for a dense run."""
    experts: dict[int, set[int]] = {}
    for record in records:
        for name in record:
            match = EXPERT_LOAD.match(name)
            if match:
                experts.setdefault(int(match[1]), set()).add(int(match[2]))
    if not experts:
        return []
    imbalance = [(f"moe/imbalance/layer{layer}", f"layer {layer}") for layer in sorted(experts)]
    return [("Expert load imbalance", "max / mean load", imbalance, False)] + [
        (
            f"Expert load, layer {layer}",
            "fraction of assignments",
            [(f"moe/load/layer{layer}/expert{e}", f"expert {e}") for e in sorted(experts[layer])],
            False,
        )
        for layer in sorted(experts)
    ]


def straggler_panels(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, list[tuple[str, str]], bool]]:
    """The straggler ratio of a multi-rank run (llmstack.monitor.stragglers); none for one rank."""
    if not any("straggler/ratio" in record for record in records):
        return []
    return [("Stragglers", "slowest rank / other ranks' median", [("straggler/ratio", "own time per step")], False)]


def accuracy_panels(records: Iterable[Mapping[str, Any]]) -> list[tuple[str, str, list[tuple[str, str]], bool]]:
    """Training and validation accuracy, beside the loss, where the run logged them."""
    if not any("accuracy" in record or "val_accuracy" in record for record in records):
        return []
    return [("Accuracy", "targets predicted (argmax)", [("accuracy", "train"), ("val_accuracy", "validation")], False)]


def panels_of(records: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[tuple[str, str]], bool]]:
    """The panels a run's records fill: the fixed ones (accuracy beside the loss where logged), then
    those of what the run logged."""
    return PANELS[:1] + accuracy_panels(records) + PANELS[1:] + straggler_panels(records) + expert_load_panels(records)


def plot_run(run_dir: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None) -> str | os.PathLike[str]:
    """Draw loss, accuracy, gradient norm, learning rate and throughput into one PNG, with expert load over
    time for a mixture-of-experts run; return its path."""
    # A Figure needs no pyplot and leaves the global matplotlib backend alone.
    Figure = require("matplotlib.figure", "monitor").Figure

    records = read_metrics(run_dir)
    out_path = out_path or os.path.join(run_dir, "metrics.png")
    panels = panels_of(records)
    rows = math.ceil(len(panels) / 2)
    fig = Figure(figsize=(12, 4 * rows), constrained_layout=True)
    axes = fig.subplots(rows, 2)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (title, ylabel, metrics, log_y) in zip(axes.flat, panels):
        drawn = False
        for name, label in metrics:
            steps, values = series(records, name)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
                drawn = True
        if drawn:
            if log_y:
                ax.set_yscale("log")
            if len(metrics) > 1:
                ax.legend()
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.savefig(out_path, dpi=100)
    return out_path


@dataclass(frozen=True)
class Heatmap:
    """Validation loss over a two-dimensional grid: values[i][j] at rows[i] x columns[j] (None: no result)."""

    row_key: str
    rows: Sequence[str]
    column_key: str
    columns: Sequence[str]
    values: Sequence[Sequence[float | None]]


def plot_sweep(
    runs: Sequence[tuple[str, str | os.PathLike[str]]],
    out_path: str | os.PathLike[str],
    heatmap: Heatmap | None = None,
) -> str | os.PathLike[str]:
    """A sweep's PNG: the training loss curves of its trials `runs` ((label, run directory); the
    final validation loss a marker in the curve's colour) and, for a two-dimensional grid, a heat
    map of the validation loss; return its path."""
    Figure = require("matplotlib.figure", "monitor").Figure

    fig = Figure(figsize=(13 if heatmap else 8, 5), constrained_layout=True)
    axes = fig.subplots(1, 2 if heatmap else 1, squeeze=False).flat
    curves = axes[0]
    for label, run_dir in runs:
        try:
            records = read_metrics(run_dir)
        except UserError:
            continue  # a trial that failed before logging
        steps, values = series(records, "loss")
        (line,) = curves.plot(steps, values, label=label)
        val_steps, val_values = series(records, "val_loss")
        if val_steps:
            curves.plot(val_steps[-1:], val_values[-1:], "o", color=line.get_color())
    curves.set(title="Training loss (dots: final validation loss)", xlabel="step", ylabel="loss")
    curves.grid(alpha=0.3)
    if runs:
        curves.legend(fontsize="small")
    if heatmap:
        _draw_heatmap(fig, axes[1], heatmap)
    fig.savefig(out_path, dpi=100)
    return out_path


def _draw_heatmap(fig: Any, ax: Any, heatmap: Heatmap) -> None:
    import numpy as np

    grid = np.array([[np.nan if v is None else v for v in row] for row in heatmap.values], dtype=float)
    image = ax.imshow(np.ma.masked_invalid(grid), cmap="viridis_r", aspect="auto")
    fig.colorbar(image, ax=ax, label="validation loss")
    ax.set_xticks(range(len(heatmap.columns)), heatmap.columns)
    ax.set_yticks(range(len(heatmap.rows)), heatmap.rows)
    ax.set(title="Validation loss", xlabel=heatmap.column_key, ylabel=heatmap.row_key)
    best = np.unravel_index(np.nanargmin(grid), grid.shape) if np.isfinite(grid).any() else None
    low, high = np.nanmin(grid), np.nanmax(grid)
    for (i, j), value in np.ndenumerate(grid):
        text = "-" if not np.isfinite(value) else f"{value:.3f}" + (" *" if (i, j) == best else "")
        dark = np.isfinite(value) and high > low and (value - low) / (high - low) > 0.5  # viridis_r: high is dark
        ax.text(j, i, text, ha="center", va="center", color="white" if dark else "black")
