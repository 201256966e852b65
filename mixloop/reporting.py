"""Reporting: TensorBoard summaries for train and eval, and the console progress line."""

from __future__ import annotations

import math
import os
from typing import Mapping

import tensorflow as tf
from absl import logging


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


def log_progress(step: int, num_steps: int, scalars: Mapping[str, float]) -> None:
    """One console line: step/total, loss, scale, skipped, steps/s and the time left."""
    steps_per_sec = scalars["steps_per_sec"]
    eta = (num_steps - step) / steps_per_sec if steps_per_sec > 0 else float("inf")
    logging.info(
        "step %d/%d  loss %.4f  scale %g  skipped %d (total %d)  %.2f steps/s  ETA %s",
        step, num_steps, scalars["loss"], scalars["loss_scale"], scalars["skipped_steps"],
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

    def add(self, totals: Mapping[str, float], seconds: float) -> None:
        """Adds one inner loop's sums and the seconds it took (evaluation and checkpoints excluded)."""
        self.seconds += seconds
        for name in ("loss_sum", "num_finite_loss", "grad_norm_sum", "num_applied"):
            self.totals[name] = self.totals.get(name, 0.0) + float(totals[name])

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
        return summary
