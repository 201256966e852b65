"""Reporting: TensorBoard summaries for train and eval, the console lines (progress, slow steps,
the finish), and the train statistics summed per objective in the inner loop and over the logging
interval."""

from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Collection, Iterator, Mapping, Optional

import tensorflow as tf
from absl import flags, logging

from mixloop.errors import UserError
from mixloop.runner import guard, workdir


class MetricWriter:
    """Writes scalars to `workdir/train` or `workdir/eval` event files. A file system that cannot
    take them (full, no free inode, read-only) stops the run in one line: creating the writers,
    writing or flushing raises `workdir.UnusableWorkdir`, not TensorFlow's traceback."""

    def __init__(self, workdir: str, enabled: bool = True):
        self._workdir = workdir
        self._writers = {split: self._created(split) if enabled else tf.summary.create_noop_writer()
                         for split in ("train", "eval")}

    def as_default(self, split: str):
        """The `split` writer as the default `tf.summary` writer (a context manager), for actions."""
        return self._writers[split].as_default()

    def write(self, split: str, step: int, scalars: Mapping[str, float]) -> None:
        """Writes one value per tag at `step` to the `split` ("train" or "eval") event file."""
        with self._writing(split), self._writers[split].as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, value, step=step)
        self.flush(split)

    def flush(self, split: str) -> None:
        """Writes what the `split` writer holds to disk."""
        with self._writing(split):
            self._writers[split].flush()

    def _created(self, split: str) -> tf.summary.SummaryWriter:
        """The `split` writer, its events file created."""
        with self._writing(split):
            return tf.summary.create_file_writer(os.path.join(self._workdir, split))

    def file_error(self, split: str, error: Exception) -> Optional[UserError]:
        """The workdir's one line when `error` is TensorBoard failing to write `split`'s events
        file (no space, no inode, no permission), or None: what an action's own summaries raise
        is the disk's fault, not the action's."""
        folder = os.path.join(self._workdir, split)
        if (isinstance(error, (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError))
                and folder in (error.message or "")):
            return workdir.unusable_workdir(self._workdir, error, folder)
        return None

    @contextlib.contextmanager
    def _writing(self, split: str) -> Iterator[None]:
        """TensorBoard's file errors in the block as the workdir's one line, naming `split`'s
        folder."""
        try:
            yield
        except (tf.errors.ResourceExhaustedError, tf.errors.PermissionDeniedError) as error:
            raise workdir.unusable_workdir(self._workdir, error,
                                           os.path.join(self._workdir, split)) from None


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
                       "skipped_total", "retries", "updates", "steps_per_sec", "examples_per_sec",
                       "recoveries", "heals", "memory")
# The peak memory so far (memory.peak_bytes), beside each progress line's scalars; not on the line.
PEAK_MEMORY_TAG = "memory/peak_bytes"
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
            "num_ran": zero,  # Updates of the objective, applied or skipped (see every_steps).
            "num_retries": zero,  # Attempts taken again after an overflow (precision.overflow_retries).
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
        "num_ran": totals["num_ran"] + tf.cast(report["ran"], tf.float32),
        "num_retries": totals["num_retries"] + tf.cast(report["retries"], tf.float32),
        "metric_sums": {name: total + report["metrics"][name] * report["weight"]
                        for name, total in totals["metric_sums"].items()},
        "metric_weight": totals["metric_weight"] + report["weight"],
        "last_loss": report["loss"], "last_scale": report["loss_scale"],
        "last_grads_finite": report["grads_finite"],
    }


def log_progress(step: int, num_steps: int, scalars: Mapping[str, float]) -> None:
    """One console line: step/total, the losses, train metrics, scales and skips, steps/s, time left
    (the last two when the interval was timed)."""
    shown = [_progress_item(name, value, scalars) for name, value in scalars.items()
             if name.split("/")[0] not in ("skipped_total", "learning_rate", "grad_norm", *_SPEED_TAGS)
             and not (name.split("/")[0] == "retries" and not value)]
    logging.info("step %d/%d  %s%s", step, num_steps, "  ".join(shown),
                 _speed_and_eta(num_steps - step, scalars.get("steps_per_sec")))


def _speed_and_eta(steps_left: int, steps_per_sec: Optional[float]) -> str:
    """'  12.50 steps/s  ETA 1m20s', or '' when the speed is not known yet (a positive one is)."""
    if steps_per_sec is None:
        return ""
    return f"  {steps_per_sec:.2f} steps/s  ETA {format_duration(steps_left / steps_per_sec)}"


def _progress_item(name: str, value: float, scalars: Mapping[str, float]) -> str:
    """'loss 2.3141', 'scale/generator 32768', 'updates/generator 20' or 'skipped 1 (total 3)' for the
    progress line."""
    base, _, objective = name.partition("/")
    suffix = f"/{objective}" if objective else ""
    if base == "loss_scale":
        return f"scale{suffix} {value:g}"
    if base == "updates":
        return f"updates{suffix} {int(value)}"
    if base == "skipped_steps":
        return f"skipped{suffix} {int(value)} (total {int(scalars['skipped_total' + suffix])})"
    if base == "retries":
        return f"retries{suffix} {int(value)}"
    return f"{name} {value:.4f}"


def log_eval(step: int, metrics: Mapping[str, float]) -> None:
    """One console line with the eval metrics."""
    text = "  ".join(f"{name} {value:.4f}" for name, value in sorted(metrics.items()))
    logging.info("eval at step %d: %s", step, text)


_SUMMED = ("loss_sum", "num_finite_loss", "grad_norm_sum", "num_applied", "num_ran", "num_retries",
           "metric_weight")


class Interval:
    """Per objective, train statistics summed over the inner loops since the last progress line."""

    def __init__(self, step: int, skipped_totals: Mapping[str, int]):
        self.start_step, self.start_skipped = step, dict(skipped_totals)
        self.seconds, self.num_untimed_steps = 0.0, 0
        self.totals = {name: dict.fromkeys(_SUMMED, 0.0) for name in skipped_totals}
        self.metric_sums: dict[str, dict[str, float]] = {name: {} for name in skipped_totals}

    def add(self, totals: Mapping[str, Any], seconds: float) -> None:
        """Adds one inner loop's sums and the seconds it took (evaluation and checkpoints excluded)."""
        self.seconds += seconds
        self._add_sums(totals)

    def add_untimed(self, totals: Mapping[str, Any], num_steps: int) -> None:
        """Adds one inner loop's sums but leaves its `num_steps` updates out of the speed: the first
        loop, whose time is mostly tracing and compiling."""
        self.num_untimed_steps += num_steps
        self._add_sums(totals)

    def _add_sums(self, totals: Mapping[str, Any]) -> None:
        for objective, objective_totals in totals["objectives"].items():
            for name in _SUMMED:
                self.totals[objective][name] += float(objective_totals[name])
            sums = self.metric_sums[objective]
            for name, value in objective_totals["metric_sums"].items():
                sums[name] = sums.get(name, 0.0) + float(value)

    def skipped(self, skipped_totals: Mapping[str, int]) -> dict[str, int]:
        """Per objective, the updates skipped since the interval began."""
        return {name: int(total) - self.start_skipped[name] for name, total in skipped_totals.items()}

    def summary(self, step: int, skipped_totals: Mapping[str, int], batch_size: int,
                cadenced: Collection[str] = ()) -> dict[str, float]:
        """Per objective the mean loss, gradient norm, train metrics and skipped counts, and for the
        `cadenced` objectives (`every_steps` > 1) the updates they made (`updates`); the speed over
        the timed loops (none when every update of the interval was untimed).

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
            summary[tagged("retries")] = t["num_retries"]
            if objective in cadenced:
                summary[tagged("updates")] = t["num_ran"]
            if t["num_applied"]:
                summary[tagged("grad_norm")] = t["grad_norm_sum"] / t["num_applied"]
        num_timed_steps = step - self.start_step - self.num_untimed_steps
        if num_timed_steps > 0:  # Otherwise the interval has no speed to tell.
            steps_per_sec = num_timed_steps / max(self.seconds, 1e-9)
            summary["steps_per_sec"] = steps_per_sec
            summary["examples_per_sec"] = steps_per_sec * batch_size
        return summary


# Train scalars that describe the run's pace or settings rather than what it learned.
_NOT_RESULTS = ("skipped_steps", "retries", "updates", "learning_rate", "loss_scale", "grad_norm",
                *_SPEED_TAGS)


def describe_finish(step: int, num_steps: int, metrics: Mapping[str, float], *,
                    has_eval_data: bool) -> str:
    """The line a finished run ends with: the step, the last train and eval metrics it reported,
    and why a group is missing."""
    train = {name: value for name, value in metrics.items()
             if not name.startswith("eval_") and name.split("/")[0] not in _NOT_RESULTS}
    evaluation = {name[len("eval_"):]: value for name, value in metrics.items()
                  if name.startswith("eval_")}
    if not metrics:
        return (f"Finished at step {step} of {num_steps}; no metrics: this run made no update (the "
                f"workdir's checkpoint was already at step {step}; raise config.train.num_steps to "
                "train further; earlier metrics are in its TensorBoard event files)")
    eval_text = (_metrics_text(evaluation) if evaluation else
                 "none (build_datasets() returned no eval dataset)" if not has_eval_data else "none")
    return f"Finished at step {step} of {num_steps}. Train: {_metrics_text(train)}. Eval: {eval_text}."


def _metrics_text(metrics: Mapping[str, float]) -> str:
    """'accuracy 0.8125  loss 0.4410', sorted by name (counts without decimals)."""
    return "  ".join(f"{name} {value:.4f}" if name.split("/")[0] != "skipped_total"
                     else f"{name} {int(value)}" for name, value in sorted(metrics.items()))


def show_info_by_default() -> None:
    """Lets absl's INFO lines (progress, eval) through when mixloop runs from Python rather than
    under `absl.app.run`, which does the same after parsing its flags; a verbosity chosen by the
    user (`absl.logging.set_verbosity`, `--verbosity`) is kept."""
    if not flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].using_default_value:
        logging.set_verbosity(logging.INFO)


@contextlib.contextmanager
def announced(doing: str) -> Iterator[None]:
    """Logs `doing...` before a block that may take long (so a silent console is not a hung one),
    and `doing: done in 1.2 s` after it."""
    logging.info("%s...", doing)
    started = time.perf_counter()
    yield
    logging.info("%s: done in %.1f s", doing, time.perf_counter() - started)
