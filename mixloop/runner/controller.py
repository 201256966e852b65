"""The outer loop: between compiled inner loops, report, evaluate, checkpoint, and handle faults.

Orbit's split: the Trainer owns the compiled inner loop, this module the Python around it. It keeps
the workdir safe (a lock, the config history, no checkpoint of a diverged state), turns SIGINT and
SIGTERM into a checkpoint and a clean exit, and stops on divergence or at the end of the data.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Collection, Optional, Protocol

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop import errors, interrupts, machine
from mixloop.errors import UserError
from mixloop.doctor import memory
from mixloop.runner import (auto_precision, cadence, checkpointing, compile_mode, guard,
                            memory_plan, reporting, train_data, workdir)
from mixloop.runner.actions import Action, checked_actions, returned_metrics
from mixloop.runner.recovery import Recovery

class Loop(Protocol):
    """What the outer loop reads and calls (a `run.Run`): Orbit's `train_loop(n)` and `evaluate()`,
    the step counter and the checkpoints, and what it reports of the run. The start's probes and the
    recoveries take the run whole (auto_precision.py, compile_mode.py, recovery.py)."""

    config: ml_collections.ConfigDict
    workdir: str
    trainer: Any  # The Trainer: its `actions()`.
    is_chief: bool  # Whether this process writes summaries, config history and the export.
    global_step: tf.Variable  # Updates made, skipped ones included.
    checkpoints: tf.train.CheckpointManager
    eval_data: Optional[tf.data.Dataset]
    # Reported: each objective's loss scale and learning rate, its skips, the train metrics' names,
    # the compile mode (None until decided).
    objectives: dict
    state: Any
    train_metric_names: dict[str, list[str]]
    jit_compile: Any
    memory_plan: Any  # What train.memory_budget planned (recorded in config.json), or None.

    def train_loop(self, num_steps: int) -> dict[str, Any]:
        """Up to `num_steps` updates in one compiled call; per-objective totals as NumPy."""

    def evaluate(self) -> dict[str, float]:
        """The eval summary (the Trainer's `evaluate()`)."""

    def ema_weights(self) -> contextlib.AbstractContextManager:
        """The weights eval uses, swapped in for a `with` block (eval-time actions see them)."""

    def random_states_kept(self) -> contextlib.AbstractContextManager:
        """Every checkpointed random state put back as it was after a `with` block."""

    def restore(self) -> Optional[str]:
        """Restores the latest checkpoint of the workdir, if any."""

    def resume_directory(self) -> str:
        """Where the checkpoints every process resumes from are."""

    def num_train_batches(self) -> Optional[int]:
        """Batches in one pass over the train data, or None when it repeats."""

    def export(self) -> Optional[str]:
        """Writes the float32 inference model; returns its path (None when Keras cannot save it)."""


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _StopRequest:
    """Turns SIGINT and SIGTERM into a request to stop at the next loop boundary; one that comes
    while an action runs is logged, as the checkpoint waits for the action to return."""

    def __init__(self):
        self.signal_number = None
        self.running: Optional[tuple[Action, int]] = None  # The action running now, and its step.
        self._previous = {}

    def __enter__(self) -> "_StopRequest":
        # From here a signal stops the run at a checkpoint, not its startup. Straight from the
        # startup's handlers to these: Python's defaults in between would let a SIGTERM kill.
        try:
            self._previous = {sig: interrupts.disarmed(sig, signal.signal(sig, self._request))
                              for sig in _STOP_SIGNALS}
        except ValueError:  # Not the main thread: signals stay with their owner.
            self._previous = {}
            interrupts.disarm()
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self) -> bool:
        """Whether a stop was requested (what a probe at the start asks between its passes)."""
        return self.signal_number is not None

    def _request(self, signal_number, frame) -> None:
        self.signal_number = signal_number
        if self.running is not None:
            action, step = self.running
            logging.warning("%s received while action %s runs at step %d: the checkpoint and the "
                            "stop wait until it returns (a grace period shorter than the action "
                            "ends the run without them)", signal.Signals(signal_number).name,
                            action.describe(), step)


def _save(run: Loop, step: int) -> None:
    """Checkpoints `step` unless already saved; a full disk is a one-line error (`UserError`)."""
    machine.release_free_memory()  # The save's buffers in the loop's freed pages, not new ones.
    checkpointing.save(run.checkpoints, step)


def train(run: Loop) -> dict[str, float]:
    """Runs `run` to `config.train.num_steps`, resuming from its workdir; returns the last metrics."""
    # Checks before anything is written: a checkpoint that does not fit changes nothing.
    resumed_from = run.restore()
    if run.eval_data is not None and next(iter(run.eval_data.take(1)), None) is None:
        raise UserError(errors.EMPTY_EVAL_DATA)
    num_batches = run.num_train_batches()  # None when it repeats.
    # Before the lock: a bad Action is refused with nothing written.
    actions = checked_actions(run.trainer.actions())
    lock_directory = run.workdir if run.is_chief else run.checkpoints.directory
    # The stop request first: from the lock on, a signal stops the run at a checkpoint.
    with _StopRequest() as stop:
        try:
            with workdir.WorkdirLock(lock_directory):
                return _train_locked(run, actions, num_batches, stop, resumed_from)
        except interrupts.ProbeAbandoned:  # Logged; the lock released, nothing written since.
            interrupts.end_process(0)


def _train_locked(run: Loop, actions: list, num_batches: Optional[int], stop: _StopRequest,
                  resumed_from: Optional[str]) -> dict[str, float]:
    """`train` once the workdir's lock is taken (`resumed_from`: the checkpoint restored)."""
    if run.is_chief:
        workdir.check_writable(run.workdir)
        workdir.write_config(run.workdir, run.config, int(run.global_step.numpy()))
        memory_plan.record(run.workdir, run.memory_plan)  # A resume keeps it.
    # A stop during a probe ends it at its next boundary; the run then saves and exits (and
    # a stop during the placement leaves the compile mode undecided: no loop runs).
    auto_precision.start(run, stop.requested)  # From the restored weights, before any trace.
    # After the placement, which changes what is compiled.
    start = int(run.global_step.numpy())
    try:
        probed = not stop.requested() and compile_mode.choose(run, stop.requested)
    except interrupts.ProbeAbandoned:
        logging.info("Stopped by %s during the compile-mode probe at step %d, which kept "
                     "nothing: %s. Run the same command to resume.",
                     signal.Signals(stop.signal_number).name, start,
                     f"checkpoint {os.path.basename(resumed_from)} holds the run" if resumed_from
                     else "nothing to save, as a new start repeats this one")
        raise
    logging.info("%s", memory.persistent_state(run).describe())  # As placed and compiled.
    metrics, reason = _run_loops(run, actions, stop, num_batches, compiled=probed)
    step = int(run.global_step.numpy())
    _save(run, step)
    if stop.signal_number is not None and step < run.config.train.num_steps:
        logging.info("Stopped by %s at step %d; checkpoint saved in %s. Run the same command "
                     "to resume.", signal.Signals(stop.signal_number).name, step,
                     run.checkpoints.directory)
        return metrics
    if reason == guard.END_OF_DATA:
        logging.warning("The train dataset ended at step %d of %d; checkpoint saved. Set "
                        "config.train.repeat_dataset=True to repeat it.", step,
                        run.config.train.num_steps)
        return metrics
    if run.is_chief:
        machine.release_free_memory()
        run.export()
    logging.info("%s", memory_plan.describe_peak(memory.peak_bytes(), run.memory_plan))
    logging.info("%s", reporting.describe_finish(step, run.config.train.num_steps, metrics,
                                                 has_eval_data=run.eval_data is not None))
    return metrics


def _run_loops(run: Loop, actions: list, stop: _StopRequest, num_batches: Optional[int],
               compiled: bool) -> tuple[dict[str, float], int]:
    """Inner loops until num_steps, a stop request or the end of the `num_batches` of the data (None:
    it repeats); returns the last metrics and why it ended (`guard.CONTINUE` or
    `guard.END_OF_DATA`). Unless the loop is `compiled` already, the first loop runs one update and
    its time is logged apart. After each loop, what the `cadence.Schedule` says is due: the
    progress line, the actions, eval, a checkpoint.

    Raises:
      guard.TrainingDiverged: when the run diverges with no recovery left.
      UserError: when repeated train data ends: it has no batch (tf.data could not count them).
    """
    config = run.config
    num_steps = config.train.num_steps
    last_step = num_steps if num_batches is None else min(num_steps, num_batches)
    schedule = cadence.Schedule(config, actions, last_step)
    recovery = Recovery(run)
    writer = reporting.MetricWriter(run.workdir, enabled=run.is_chief)
    step = int(run.global_step.numpy())
    if step >= num_steps:
        logging.info("Already trained to step %d of %d; nothing to do.", step, num_steps)
    metrics: dict[str, float] = {}
    interval = reporting.Interval(step, run.state.skipped_totals())
    while stop.signal_number is None:
        if step >= last_step:
            return metrics, guard.END_OF_DATA if step < num_steps else guard.CONTINUE
        loop_length = schedule.loop_length(step) if compiled else 1
        started = time.perf_counter()
        try:
            totals = run.train_loop(loop_length) if compiled else compile_mode.first_loop(run)
        except tf.errors.OutOfRangeError:  # Only after a recovery, whose data moved on further...
            if config.train.repeat_dataset:  # ...or when there is nothing to repeat.
                raise UserError(errors.empty_train_data(config.train.batch_size)) from None
            return metrics, guard.END_OF_DATA
        except tf.errors.OpError as error:
            if not _is_input_error(error):
                raise
            raise UserError(_loop_failure(run, error, step)) from None
        if compiled:
            interval.add(totals, time.perf_counter() - started)
        else:
            _log_compiled(run, time.perf_counter() - started)
            machine.release_free_memory()  # What tracing and compiling freed.
            interval.add_untimed(totals, num_steps=1)
            compiled = True
        step = int(run.global_step.numpy())
        recovery.name_first_failures(interval, totals)
        if recovery.after_loop(totals):
            compiled = compiled and not recovery.last_healed  # A heal traces the loop anew.
            writer.write("train", step, {"recoveries": recovery.recoveries, "heals": recovery.heals})
            step = int(run.global_step.numpy())
            interval = reporting.Interval(step, run.state.skipped_totals())
            continue
        if schedule.log.is_due(step):
            metrics.update(_report_train(run, writer, step, interval))
            interval = reporting.Interval(step, run.state.skipped_totals())
        computed = _run_actions(run, writer, "train", step, schedule.train_actions(step), stop,
                                taken=_train_metric_names(run), reserved=reporting.BUILT_IN_TRAIN_TAGS)
        if computed:
            writer.write("train", step, computed)
        if stop.signal_number is not None:  # Save at once: a scheduler's grace period is short.
            break
        if schedule.eval.is_due(step):
            # Eval leaves the run's random sequence where training had it: a run that stops (and
            # evaluates) here and resumes then draws the noise a straight run draws.
            with run.random_states_kept():
                metrics.update(_report_eval(run, writer, step, schedule.eval_actions(), stop))
        if schedule.checkpoint.is_due(step):
            _save(run, step)
    return metrics, guard.CONTINUE


def _log_compiled(run: Loop, seconds: float) -> None:
    logging.info("Compiled the train loop in %.1f s (tracing%s, and its first update; left out of "
                 "steps/s and the ETA)", seconds, " and XLA" if run.jit_compile else "")


def _run_actions(run: Loop, writer: reporting.MetricWriter, split: str, step: int,
                 due: list[Action], stop: _StopRequest, taken: Collection[str] = (),
                 reserved: Collection[str] = ()) -> dict[str, float]:
    """Runs the `due` actions with the `split` TensorBoard writer as the default summary writer,
    telling `stop` which one runs; returns the metrics they returned (`actions.returned_metrics`,
    none named as in `taken` or starting with a `reserved` tag).

    Raises:
      UserError: when an action raises, naming it, the step and the checkpoint kept (its
        summaries failing on a full disk: the workdir's line); or returns a metric it may not
        (`returned_metrics`).
    """
    metrics: dict[str, float] = {}
    if not due:
        return metrics
    with writer.as_default(split):
        for action in due:
            stop.running = (action, step)
            try:
                returned = action.fn(step)
            except Exception as error:  # Research code: whatever it raises is its own bug,
                raise (writer.file_error(split, error)  # but for its summaries on a full disk.
                       or UserError(f"action {action.describe()} failed at step {step}: "
                                    f"{errors.described(error)}; {_kept_checkpoint(run)}")) from None
            finally:
                stop.running = None
            metrics.update(returned_metrics(action, returned, step, [*taken, *metrics], reserved))
    writer.flush(split)
    return metrics


def _train_metric_names(run: Loop) -> list[str]:
    """The train metrics `compute_loss` reports, by name and as `name/objective`: tags an action's
    metric may not reuse."""
    names = run.train_metric_names
    return [tag for objective, metrics in names.items() for metric in metrics
            for tag in (metric, f"{metric}/{objective}")]


def _kept_checkpoint(run: Loop) -> str:
    """What a run that stops on an error keeps: its last checkpoint, named."""
    last = tf.train.latest_checkpoint(run.resume_directory())
    return f"the last checkpoint ({last}) is kept" if last else "no checkpoint was saved yet"


def _is_input_error(error: tf.errors.OpError) -> bool:
    """Whether an op error of the train or eval step comes from its input (reading the data, a
    value or shape an op refuses, an op the compile mode lacks) rather than from mixloop."""
    return train_data.failed_reading(error) or isinstance(
        error, (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError))


def _loop_failure(run: Loop, error: tf.errors.OpError, start_step: int) -> str:
    """The one line for an op error of the inner loop that began after `start_step`: reading the
    data failed (the last checkpoint is named: nothing later is saved) or the step did."""
    # The step counter holds the finished updates, perhaps with the failing one (its increment
    # does not wait for that update's data or step); the loop's first step is a floor.
    near = max(start_step + 1, int(run.global_step.numpy()))
    if train_data.failed_reading(error):
        return (f"the train data pipeline failed near step {near}: {errors.op_error_summary(error)}; "
                f"{_kept_checkpoint(run)}")
    summary = errors.op_error_summary(error)
    hint = (" (the step is compiled with XLA; --config.jit_compile=False runs it without)"
            if run.jit_compile and (isinstance(error, tf.errors.UnimplementedError)
                                    or summary.startswith(errors.XLA_CANNOT_COMPILE)) else "")
    return f"the train step failed near step {near}: {summary}{hint}"


def _report_train(run: Loop, writer: reporting.MetricWriter, step: int,
                  interval: reporting.Interval) -> dict:
    cadenced = [name for name, objective in run.objectives.items() if objective.every_steps > 1]
    scalars = interval.summary(step, run.state.skipped_totals(), run.config.train.batch_size,
                               cadenced)
    for name, objective in run.objectives.items():
        scalars[reporting.tag("loss_scale", name, run.objectives)] = float(
            objective.loss_scale.scale.numpy())
        scalars[reporting.tag("learning_rate", name, run.objectives)] = float(
            keras.ops.convert_to_numpy(objective.optimizer.learning_rate))
    writer.write("train", step, {**scalars, reporting.PEAK_MEMORY_TAG: memory.peak_bytes()})
    reporting.log_progress(step, run.config.train.num_steps, scalars)
    return scalars


def _report_eval(run: Loop, writer: reporting.MetricWriter, step: int, at_eval: list[Action],
                 stop: _StopRequest) -> dict:
    """Evaluates (with eval data), runs the eval-time actions `at_eval` with the weights eval used,
    and reports both together as the eval summary: TensorBoard's eval scalars, the `eval at step N:`
    line, and the run's metrics (`eval_<name>`, which `Finished ...` shows); {} with neither."""
    metrics = _evaluate(run, step) if run.eval_data is not None else {}
    if at_eval:
        with run.ema_weights():  # Eval-time actions see the weights eval saw.
            metrics.update(_run_actions(run, writer, "eval", step, at_eval, stop, taken=metrics))
    if not metrics:
        return {}
    writer.write("eval", step, metrics)
    reporting.log_eval(step, metrics)
    return {f"eval_{name}": value for name, value in metrics.items()}


def _evaluate(run: Loop, step: int) -> dict[str, float]:
    """`run.evaluate()`; an op error of its input is one line (`UserError`)."""
    try:
        return dict(run.evaluate())
    except tf.errors.OpError as error:
        if not _is_input_error(error):
            raise
        raise UserError(f"the eval step failed at step {step}: {errors.op_error_summary(error)}; "
                        f"{_kept_checkpoint(run)}") from None
