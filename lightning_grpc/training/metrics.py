"""Where a run's metrics go: a CSV (one row per step), TensorBoard when it is installed, a PNG of the reward."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Metrics plotted in the reward figure: (column, label).
REWARD_CURVES = (
    ("reward_mean", "train reward"),
    ("val_reward", "validation reward"),
    ("solved", "train solved"),
)


class MetricsLog:
    """Rows of metrics by step, written to ``metrics.csv`` (rewritten whole, so new columns are welcome)."""

    def __init__(self, directory: Path, *, tensorboard: bool = True) -> None:
        self.directory = directory
        self.csv_path = directory / "metrics.csv"
        self.rows: list[dict[str, Any]] = self._read_existing()
        self.writer: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(directory / "tensorboard"))
            except ImportError:  # TensorBoard is optional
                self.writer = None

    def _read_existing(self) -> list[dict[str, Any]]:
        """A resumed run keeps the rows written before (up to where it resumes)."""
        if not self.csv_path.exists():
            return []
        with self.csv_path.open() as f:
            return [{k: _number(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]

    def truncate(self, step: int) -> None:
        """Forget rows after ``step`` (a run resumed from an earlier checkpoint writes them again)."""
        self.rows = [r for r in self.rows if int(r.get("step", 0)) <= step]

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.rows = [r for r in self.rows if r.get("step") != step] + [row]
        self._write_csv()
        if self.writer is not None:
            for name, value in metrics.items():
                if math.isfinite(float(value)):
                    self.writer.add_scalar(name, float(value), step)
            self.writer.flush()

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add metrics to an existing step's row."""
        row = next((r for r in self.rows if r.get("step") == step), {})
        self.add(step, {**{k: v for k, v in row.items() if k != "step"}, **metrics})

    def _write_csv(self) -> None:
        columns = ["step", *sorted({k for r in self.rows for k in r} - {"step"})]
        tmp = self.csv_path.with_suffix(".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        tmp.replace(self.csv_path)

    def plot(self, path: Path, target: float | None = None) -> Path | None:
        """The reward curves as a PNG (None when matplotlib is missing)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
        for column, label in REWARD_CURVES:
            points = [(r["step"], r[column]) for r in self.rows if column in r and math.isfinite(r[column])]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if column == "val_reward" else None, markersize=3, label=label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _number(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def summary_line(step: int, metrics: Mapping[str, float], names: Sequence[str]) -> str:
    parts = [f"step {step:>4}"]
    for name in names:
        if name in metrics and math.isfinite(metrics[name]):
            parts.append(f"{name}={metrics[name]:.3f}")
    return " ".join(parts)
