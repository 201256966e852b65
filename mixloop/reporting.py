"""Reporting: TensorBoard summaries for train and eval, the console progress line, interval statistics."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping

import tensorflow as tf
from absl import logging

from mixloop.errors import UserError


class MetricWriter:
    """Writes scalars to `workdir/train` or `workdir/eval` event files."""

    def __init__(self, workdir: str, enabled: bool = True):
        self._writers = {
            name: tf.summary.create_file_writer(os.path.join(workdir, name)) if enabled
            else tf.summary.create_noop_writer()
            for name in ("train", "eval")
        }

    def write(self, split: str, step: int, scalars: Mapping[str, float]) -> None:
        """Writes one value per tag at `step` to the `split` ("train" or "eval") event file."""
        with self._writers[split].as_default():
            for tag, value in scalars.items():
                tf.summary.scalar(tag, value, step=step)
        self._writers[split].flush()


def format_duration(seconds: float) -> str:
    """'1h02m', '3m07s' or '12s'."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


# The train scalars the framework writes itself; a train metric of the same name is refused.
BUILT_IN_TRAIN_TAGS = ("loss", "loss_scale", "learning_rate", "grad_norm", "skipped_steps",
                       "skipped_total", "steps_per_sec", "examples_per_sec")


def check_metric_names(names: list[str]) -> None:
    """Refuses train metric names that would overwrite a built-in train scalar.

    Raises:
      UserError: naming the metric and the reserved names.
    """
    for name in names:
        if name in BUILT_IN_TRAIN_TAGS:
            raise UserError(f"compute_loss returns a metric named {name!r}, which the framework "
                            f"writes itself; rename it (taken: {', '.join(BUILT_IN_TRAIN_TAGS)})")


def log_progress(step: int, num_steps: int, scalars: Mapping[str, float]) -> None:
    """One console line: step/total, loss, train metrics, scale, skipped, steps/s and the time left."""
    steps_per_sec = scalars["steps_per_sec"]
    eta = (num_steps - step) / steps_per_sec if steps_per_sec > 0 else float("inf")
    metrics = "".join(f"  {name} {value:.4f}" for name, value in scalars.items()
                      if name not in BUILT_IN_TRAIN_TAGS)
    logging.info(
        "step %d/%d  loss %.4f%s  scale %g  skipped %d (total %d)  %.2f steps/s  ETA %s",
        step, num_steps, scalars["loss"], metrics, scalars["loss_scale"], scalars["skipped_steps"],
        scalars["skipped_total"], steps_per_sec, format_duration(eta),
    )


def log_eval(step: int, metrics: Mapping[str, float]) -> None:
    """One console line with the eval metrics."""
    text = "  ".join(f"{name} {value:.4f}" for name, value in sorted(metrics.items()))
    logging.info("eval at step %d: %s", step, text)


class Interval:
    """Train statistics summed over the inner loops since the last progress line."""

    def __init__(self, step: int, skipped_total: int):
        self.start_step, self.start_skipped = step, int(skipped_total)
        self.seconds = 0.0
        self.totals: dict[str, float] = {}
        self.metric_sums: dict[str, float] = {}  # Train metrics times the loss weight of each update.

    def add(self, totals: Mapping[str, Any], seconds: float) -> None:
        """Adds one inner loop's sums and the seconds it took (evaluation and checkpoints excluded)."""
        self.seconds += seconds
        for name in ("loss_sum", "num_finite_loss", "grad_norm_sum", "num_applied", "metric_weight"):
            self.totals[name] = self.totals.get(name, 0.0) + float(totals.get(name, 0.0))
        for name, value in totals.get("metric_sums", {}).items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + float(value)

    def skipped(self, skipped_total: int) -> int:
        """Updates skipped since the interval began."""
        return int(skipped_total) - self.start_skipped

    def summary(self, step: int, skipped_total: int, batch_size: int) -> dict[str, float]:
        """Mean loss and gradient norm, skipped counts and speed over the interval.

        The gradient norm is the mean over applied updates; an interval in which every update was
        skipped has none, and leaves it out rather than write a NaN into TensorBoard.
        """
        steps_per_sec = (step - self.start_step) / max(self.seconds, 1e-9)
        t = self.totals
        summary = {
            "loss": t["loss_sum"] / t["num_finite_loss"] if t.get("num_finite_loss") else math.nan,
            "skipped_steps": float(self.skipped(skipped_total)),
            "skipped_total": float(skipped_total),
            "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * batch_size,
        }
        if t.get("num_applied"):
            summary["grad_norm"] = t["grad_norm_sum"] / t["num_applied"]
        for name, total in self.metric_sums.items():
            summary[name] = total / t["metric_weight"] if t.get("metric_weight") else math.nan
        return summary
