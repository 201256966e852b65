"""Reporting: TensorBoard summaries for train and eval, the console progress line, and the train
statistics summed per objective in the inner loop and over the logging interval."""

from __future__ import annotations

import math
import os
from typing import Any, Collection, Mapping

import tensorflow as tf
from absl import logging

from mixloop.errors import UserError
from mixloop.runner import guard


class MetricWriter:
    """Writes scalars to `workdir/train` or `workdir/eval` event files."""

    def __init__(self, workdir: str, enabled: bool = True):
        self._writers = {
            name: tf.summary.create_file_writer(os.path.join(workdir, name)) if enabled
            else tf.summary.create_noop_writer()
            for name in ("train", "eval")
        }

    def as_default(self, split: str):
        """The `split` writer as the default `tf.summary` writer (a context manager), for actions."""
        return self._writers[split].as_default()

    def write(self, split: str, step: int, scalars: Mapping[str, float]) -> None:
        """Writes one value per tag at `step` to the `split` ("train" or "eval") event file."""
        with self._writers[split].as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, value, step=step)
        self.flush(split)

    def flush(self, split: str) -> None:
        """Writes what the `split` writer holds to disk."""
        self._writers[split].flush()


def format_duration(seconds: float) -> str:
    """'1h02m', '3m07s' or '12s'."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


# The train scalars the framework writes itself (per objective as `<tag>/<objective>` when there are
# several); a train metric of the same name is refused.
BUILT_IN_TRAIN_TAGS = ("loss", "loss_scale", "learning_rate", "grad_norm", "skipped_steps",
                       "skipped_total", "steps_per_sec", "examples_per_sec")
_SPEED_TAGS = ("steps_per_sec", "examples_per_sec")


def tag(base: str, objective: str, objectives: Collection[str]) -> str:
    """A per-objective tag: `base` when there is a single objective, `base/objective` otherwise."""
    return base if len(objectives) == 1 else f"{base}/{objective}"


def check_metric_names(names: list[str]) -> None:
    """Refuses train metric names that would overwrite a built-in train scalar (`loss`, or with
    several objectives `loss/<name>`, and so on).

    Raises:
      UserError: naming the metric and the reserved names.
    """
    for name in names:
        if name.split("/")[0] in BUILT_IN_TRAIN_TAGS:
            raise UserError(f"compute_loss returns a metric named {name!r}, which the framework "
                            f"writes itself; rename it (taken: {', '.join(BUILT_IN_TRAIN_TAGS)})")


def zero_totals(metric_names: list[str]) -> dict[str, Any]:
    """One objective's sums over an inner loop, before its first update (see `add_update`)."""
    zero = tf.constant(0.0)
    return {"loss_sum": zero, "num_finite_loss": zero, "grad_norm_sum": zero, "num_applied": zero,
            # The train metrics, weighted by each update's total loss weight.
            "metric_sums": {name: zero for name in metric_names}, "metric_weight": zero,
            # The latest update, for the divergence message.
            "last_loss": zero, "last_scale": zero, "last_grads_finite": tf.constant(True),
            "stop_reason": tf.constant(guard.CONTINUE)}


def add_update(totals: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """`totals` after one more update of the objective whose step `report` this is (graph-safe),
    without its `stop_reason`, which the guard sets.

    The loss is summed over updates where it is finite, the gradient norm over applied ones.
    """
    applied, finite_loss = report["applied"], tf.math.is_finite(report["loss"])
    return {
        "loss_sum": totals["loss_sum"] + tf.where(finite_loss, report["loss"], 0.0),
        "num_finite_loss": totals["num_finite_loss"] + tf.cast(finite_loss, tf.float32),
        "grad_norm_sum": totals["grad_norm_sum"] + tf.where(applied, report["grad_norm"], 0.0),
        "num_applied": totals["num_applied"] + tf.cast(applied, tf.float32),
        "metric_sums": {name: total + report["metrics"][name] * report["weight"]
                        for name, total in totals["metric_sums"].items()},
        "metric_weight": totals["metric_weight"] + report["weight"],
        "last_loss": report["loss"], "last_scale": report["loss_scale"],
        "last_grads_finite": report["grads_finite"],
    }


def log_progress(step: int, num_steps: int, scalars: Mapping[str, float]) -> None:
    """One console line: step/total, the losses, train metrics, scales and skips, steps/s, time left."""
    steps_per_sec = scalars["steps_per_sec"]
    eta = (num_steps - step) / steps_per_sec if steps_per_sec > 0 else float("inf")
    shown = [_progress_item(name, value, scalars) for name, value in scalars.items()
             if name.split("/")[0] not in ("skipped_total", "learning_rate", "grad_norm", *_SPEED_TAGS)]
    logging.info("step %d/%d  %s  %.2f steps/s  ETA %s", step, num_steps, "  ".join(shown),
                 steps_per_sec, format_duration(eta))


def _progress_item(name: str, value: float, scalars: Mapping[str, float]) -> str:
    """'loss 2.3141', 'scale/generator 32768' or 'skipped 1 (total 3)' for the progress line."""
    base, _, objective = name.partition("/")
    suffix = f"/{objective}" if objective else ""
    if base == "loss_scale":
        return f"scale{suffix} {value:g}"
    if base == "skipped_steps":
        return f"skipped{suffix} {int(value)} (total {int(scalars['skipped_total' + suffix])})"
    return f"{name} {value:.4f}"


def log_eval(step: int, metrics: Mapping[str, float]) -> None:
    """One console line with the eval metrics."""
    text = "  ".join(f"{name} {value:.4f}" for name, value in sorted(metrics.items()))
    logging.info("eval at step %d: %s", step, text)


_SUMMED = ("loss_sum", "num_finite_loss", "grad_norm_sum", "num_applied", "metric_weight")


class Interval:
    """Per objective, train statistics summed over the inner loops since the last progress line."""

    def __init__(self, step: int, skipped_totals: Mapping[str, int]):
        self.start_step, self.start_skipped = step, dict(skipped_totals)
        self.seconds = 0.0
        self.totals = {name: dict.fromkeys(_SUMMED, 0.0) for name in skipped_totals}
        self.metric_sums: dict[str, dict[str, float]] = {name: {} for name in skipped_totals}

    def add(self, totals: Mapping[str, Any], seconds: float) -> None:
        """Adds one inner loop's sums and the seconds it took (evaluation and checkpoints excluded)."""
        self.seconds += seconds
        for objective, objective_totals in totals["objectives"].items():
            for name in _SUMMED:
                self.totals[objective][name] += float(objective_totals[name])
            sums = self.metric_sums[objective]
            for name, value in objective_totals["metric_sums"].items():
                sums[name] = sums.get(name, 0.0) + float(value)

    def skipped(self, skipped_totals: Mapping[str, int]) -> dict[str, int]:
        """Per objective, the updates skipped since the interval began."""
        return {name: int(total) - self.start_skipped[name] for name, total in skipped_totals.items()}

    def summary(self, step: int, skipped_totals: Mapping[str, int], batch_size: int) -> dict[str, float]:
        """Per objective the mean loss, gradient norm, train metrics and skipped counts; the speed.

        The gradient norm is the mean over applied updates; an interval in which every update was
        skipped has none, and leaves it out rather than write a NaN into TensorBoard.
        """
        objectives, summary = list(self.totals), {}
        skipped = self.skipped(skipped_totals)
        for objective, t in self.totals.items():
            def tagged(base):
                return tag(base, objective, objectives)
            summary[tagged("loss")] = (t["loss_sum"] / t["num_finite_loss"] if t["num_finite_loss"]
                                       else math.nan)
            for name, total in self.metric_sums[objective].items():
                summary[name] = total / t["metric_weight"] if t["metric_weight"] else math.nan
            summary[tagged("skipped_steps")] = float(skipped[objective])
            summary[tagged("skipped_total")] = float(skipped_totals[objective])
            if t["num_applied"]:
                summary[tagged("grad_norm")] = t["grad_norm_sum"] / t["num_applied"]
        steps_per_sec = (step - self.start_step) / max(self.seconds, 1e-9)
        summary["steps_per_sec"] = steps_per_sec
        summary["examples_per_sec"] = steps_per_sec * batch_size
        return summary
