"""What each stage kept and why it dropped the rest: a table, a JSON file and a funnel chart."""

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmstack.errors import require


@dataclass
class StageStats:
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0  # CPU time summed over worker processes
    drops: Counter = field(default_factory=Counter)  # reason -> documents dropped
    counts: Counter = field(default_factory=Counter)  # what the stage changed or noticed

    def add(self, other: "StageStats") -> None:
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out
        self.seconds += other.seconds
        self.drops.update(other.drops)
        self.counts.update(other.counts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "docs_in": self.docs_in,
            "docs_out": self.docs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "seconds": round(self.seconds, 6),
            "mb_per_second": round(self.bytes_in / 1e6 / self.seconds, 3) if self.seconds else None,
            "drops": dict(self.drops.most_common()),
            "counts": dict(sorted(self.counts.items())),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StageStats":
        return cls(
            d["docs_in"],
            d["docs_out"],
            d["bytes_in"],
            d["bytes_out"],
            d["seconds"],
            Counter(d["drops"]),
            Counter(d["counts"]),
        )


def merge(per_shard: Iterable[Mapping[str, StageStats]]) -> dict[str, StageStats]:
    """Sum [{stage: StageStats}] over shards, keeping the stages' order."""
    total: dict[str, StageStats] = {}
    for stats in per_shard:
        for name, stage in stats.items():
            total.setdefault(name, StageStats()).add(stage)
    return total


def format_table(stages: Mapping[str, StageStats], wall_seconds: float) -> str:
    header = f"{'stage':<20}{'docs in':>12}{'docs out':>12}{'kept':>8}{'MB in':>10}{'MB out':>10}{'MB/s':>8}  drops"
    rows = [header, "-" * len(header)]
    for name, s in stages.items():
        kept = f"{100 * s.docs_out / s.docs_in:.1f}%" if s.docs_in else "-"
        speed = f"{s.bytes_in / 1e6 / s.seconds:.2f}" if s.seconds else "-"
        drops = ", ".join(f"{reason} {n}" for reason, n in s.drops.most_common())
        rows.append(
            f"{name:<20}{s.docs_in:>12,}{s.docs_out:>12,}{kept:>8}{s.bytes_in / 1e6:>10.2f}"
            f"{s.bytes_out / 1e6:>10.2f}{speed:>8}  {drops}"
        )
    rows.append(f"wall time {wall_seconds:.1f} s; MB/s is per worker process (CPU time summed over workers)")
    return "\n".join(rows)


def save_json(stages: Mapping[str, StageStats], wall_seconds: float, path: str | Path) -> None:
    report = {"wall_seconds": round(wall_seconds, 3), "stages": {n: s.to_dict() for n, s in stages.items()}}
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def load_json(path: str | Path) -> tuple[dict[str, StageStats], float]:
    with open(path) as f:
        report = json.load(f)
    return {n: StageStats.from_dict(s) for n, s in report["stages"].items()}, report["wall_seconds"]


def save_funnel(stages: Mapping[str, StageStats], path: str | Path) -> None:
    """Horizontal bars of documents left after each stage, labelled with the share of the input."""
    # A Figure needs no pyplot and leaves the global matplotlib backend alone.
    Figure = require("matplotlib.figure", "data").Figure

    names = list(stages)
    kept = [s.docs_out for s in stages.values()]
    start = next((s.docs_in for s in stages.values()), 0) or 1
    fig = Figure(figsize=(8, 0.5 * len(names) + 1.5))
    ax = fig.subplots()
    bars = ax.barh(names[::-1], kept[::-1], color="tab:blue")
    for bar, value in zip(bars, kept[::-1]):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {value:,} ({100 * value / start:.1f}%)",
            va="center",
            fontsize=8,
        )
    ax.set_xlabel("documents kept")
    ax.set_title(f"data pipeline funnel ({start:,} documents read)")
    ax.set_xlim(0, max(kept + [start]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
