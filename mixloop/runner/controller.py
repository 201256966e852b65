"""The outer loop: between compiled inner loops, report, evaluate, checkpoint, and handle faults.

Orbit's split: the Trainer owns the compiled inner loop, this module the Python around it. It keeps
the workdir safe (a lock, the config history, no checkpoint of a diverged state), turns SIGINT and
SIGTERM into a checkpoint and a clean exit, and stops on divergence or at the end of the data.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from typing import Any, Callable, Collection, Optional, Protocol, Union

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from mixloop import errors, interrupts
from mixloop.errors import UserError
from mixloop.runner import checkpointing, guard, memory, reporting, train_data, workdir
from mixloop.runner.actions import Action, checked_actions, returned_metrics

EMPTY_EVAL_DATA = "the eval dataset is empty: build_datasets() returned one with no batches"


def empty_train_data(batch_size: int) -> str:
    """The one line for a train set with no batch."""
    return (f"the train dataset is empty: build_datasets() returned one with no batches (batched "
            f"with drop_remainder=True, fewer than config.train.batch_size={batch_size} examples "
            "make none)")


class Runnable(Protocol):
    """What the controller reads and calls on the Trainer: nothing else, and nothing private.

    The Trainer owns the model, the compiled inner loop and the checkpointed state; the controller
    owns cadence, reporting, the workdir and faults.
    """

    config: ml_collections.ConfigDict
    workdir: str
    model: keras.Model  # Its trainable variables: the parameters the memory line counts.
    train_step: Any  # engine.step.TrainStep: its `ema` averages, for the memory line.
    is_chief: bool  # Whether this process writes summaries, config history and the export.
    checkpoints: tf.train.CheckpointManager
    global_step: tf.Variable  # Updates made, skipped ones included.
    state: Any  # state.RunState: per-objective skip counters.
    objectives: dict  # Name -> engine.objective.Objective (loss scale, optimizer).
    eval_data: Optional[tf.data.Dataset]
    # compile_mode.Mode: True (XLA), False or "elementwise"; None until choose_compile_mode
    # decides (jit_compile="auto").
    jit_compile: Optional[Union[bool, str]]

    def train_loop(self, num_steps: int) -> dict[str, Any]:
        """Up to `num_steps` updates in one compiled call; per-objective totals as NumPy."""

    def choose_compile_mode(self, stop_requested: Callable[[], bool] = lambda: False) -> bool:
        """Decides the compile mode for jit_compile="auto", leaving the state as it was, and giving
        up a probe once `stop_requested()`; whether the chosen loop is compiled already."""

    def evaluate(self) -> dict[str, float]:
        """The eval metrics (with the EMA weights when on)."""

    def ema_weights(self) -> contextlib.AbstractContextManager:
        """The weights eval uses, swapped in for a `with` block."""

    def random_states_kept(self) -> contextlib.AbstractContextManager:
        """Every checkpointed random state put back as it was after a `with` block."""

    def actions(self) -> list:
        """The subclass's `Action`s."""

    def export(self) -> Optional[str]:
        """Writes the float32 inference model; returns its path (None when Keras cannot save it)."""

    def restore(self) -> Optional[str]:
        """Restores the latest checkpoint of the workdir, if any."""

    def restore_weights(self, path: str) -> None:
        """Restores the state in `path` except the data position (recoveries)."""

    def resume_directory(self) -> str:
        """Where the checkpoints every process resumes from are."""

    def num_train_batches(self) -> Optional[int]:
        """Batches in one pass over the train data, or None when it repeats; raises `UserError`
        for a train set known to be empty."""

    def nonfinite_variable_paths(self, objective: str, latest: bool = False) -> list[str]:
        """The variables behind an objective's latest streak of skipped updates (`latest`: behind
        its latest overflowed attempt, a retried one included)."""

    def start_precision(self, stop_requested: Callable[[], bool] = lambda: False) -> None:
        """The automatic precision settings, from a probe of the weights, before the first update,
        giving up the probe once `stop_requested()`."""

    def heal(self) -> str:
        """Moves the layers a probe finds overflowing to float32; what moved, or ''."""

    def divergence_cure(self) -> str:
        """What would cure a divergence with finite inputs ('; ...'), for the end of its line."""


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


def _loop_length(trainer: Runnable, actions: list, step: int, last_step: int) -> int:
    """Steps to the next boundary: steps_per_loop, or sooner at a log, eval, checkpoint or action step."""
    c = trainer.config
    cadences = (c.train.steps_per_loop, c.train.log_every_steps, c.eval.every_steps,
                c.checkpoint.every_steps, *(action.every_steps for action in actions))
    return min([every - step % every for every in cadences if every] + [last_step - step])


def _is_due(trainer: Runnable, step: int, every: int) -> bool:
    return step == trainer.config.train.num_steps or (every > 0 and step % every == 0)


def _save(trainer: Runnable, step: int) -> None:
    """Checkpoints `step` unless already saved; a full disk is a one-line error (`UserError`)."""
    checkpointing.save(trainer.checkpoints, step)


def train(trainer: Runnable) -> dict[str, float]:
    """Runs `trainer` to `config.train.num_steps`, resuming from its workdir; returns the last metrics."""
    # Checks before anything is written: a checkpoint that does not fit changes nothing.
    resumed_from = trainer.restore()
    if trainer.eval_data is not None and next(iter(trainer.eval_data.take(1)), None) is None:
        raise UserError(EMPTY_EVAL_DATA)
    num_batches = trainer.num_train_batches()  # None when it repeats.
    # Before the lock: a bad Action is refused with nothing written.
    actions = checked_actions(trainer.actions())
    lock_directory = trainer.workdir if trainer.is_chief else trainer.checkpoints.directory
    # The stop request first: from the lock on, a signal stops the run at a checkpoint.
    with _StopRequest() as stop:
        try:
            with workdir.WorkdirLock(lock_directory):
                return _train_locked(trainer, actions, num_batches, stop, resumed_from)
        except interrupts.ProbeAbandoned:  # Logged; the lock released, nothing written since.
            interrupts.end_process(0)


def _train_locked(trainer: Runnable, actions: list, num_batches: Optional[int], stop: _StopRequest,
                  resumed_from: Optional[str]) -> dict[str, float]:
    """`train` once the workdir's lock is taken (`resumed_from`: the checkpoint restored)."""
    if trainer.is_chief:
        workdir.check_writable(trainer.workdir)
        workdir.write_config(trainer.workdir, trainer.config, int(trainer.global_step.numpy()))
    # A stop during a probe ends it at its next boundary; the run then saves and exits (and
    # a stop during the placement leaves the compile mode undecided: no loop runs).
    trainer.start_precision(stop.requested)  # From the restored weights, before any trace.
    # After the placement, which changes what is compiled.
    start = int(trainer.global_step.numpy())
    try:
        probed = not stop.requested() and trainer.choose_compile_mode(stop.requested)
    except interrupts.ProbeAbandoned:
        logging.info("Stopped by %s during the compile-mode probe at step %d, which kept "
                     "nothing: %s. Run the same command to resume.",
                     signal.Signals(stop.signal_number).name, start,
                     f"checkpoint {os.path.basename(resumed_from)} holds the run" if resumed_from
                     else "nothing to save, as a new start repeats this one")
        raise
    logging.info("%s", memory.persistent_state(trainer).describe())  # As placed and compiled.
    metrics, reason = _run_loops(trainer, actions, stop, num_batches, compiled=probed)
    step = int(trainer.global_step.numpy())
    _save(trainer, step)
    if stop.signal_number is not None and step < trainer.config.train.num_steps:
        logging.info("Stopped by %s at step %d; checkpoint saved in %s. Run the same command "
                     "to resume.", signal.Signals(stop.signal_number).name, step,
                     trainer.checkpoints.directory)
        return metrics
    if reason == guard.END_OF_DATA:
        logging.warning("The train dataset ended at step %d of %d; checkpoint saved. Set "
                        "config.train.repeat_dataset=True to repeat it.", step,
                        trainer.config.train.num_steps)
        return metrics
    if trainer.is_chief:
        trainer.export()
    logging.info("%s", reporting.describe_finish(step, trainer.config.train.num_steps, metrics,
                                                 has_eval_data=trainer.eval_data is not None))
    return metrics


def _run_loops(trainer: Runnable, actions: list, stop: _StopRequest, num_batches: Optional[int],
               compiled: bool) -> tuple[dict[str, float], int]:
    """Inner loops until num_steps, a stop request or the end of the `num_batches` of the data (None:
    it repeats); returns the last metrics and why it ended (`guard.CONTINUE` or
    `guard.END_OF_DATA`). Unless the loop is `compiled` already, the first loop runs one update and
    its time is logged apart.

    Raises:
      guard.TrainingDiverged: when the run diverges with no recovery left.
      UserError: when repeated train data ends: it has no batch (tf.data could not count them).
    """
    config = trainer.config
    num_steps = config.train.num_steps
    last_step = num_steps if num_batches is None else min(num_steps, num_batches)
    writer = reporting.MetricWriter(trainer.workdir, enabled=trainer.is_chief)
    step = int(trainer.global_step.numpy())
    if step >= num_steps:
        logging.info("Already trained to step %d of %d; nothing to do.", step, num_steps)
    metrics: dict[str, float] = {}
    interval = reporting.Interval(step, trainer.state.skipped_totals())
    recoveries, heals, logged_first_skips, logged_first_retries = 0, 0, set(), set()
    while stop.signal_number is None:
        if step >= last_step:
            return metrics, guard.END_OF_DATA if step < num_steps else guard.CONTINUE
        loop_length = _loop_length(trainer, actions, step, last_step) if compiled else 1
        started = time.perf_counter()
        try:
            totals = trainer.train_loop(loop_length)
        except tf.errors.OutOfRangeError:  # Only after a recovery, whose data moved on further...
            if config.train.repeat_dataset:  # ...or when there is nothing to repeat.
                raise UserError(empty_train_data(config.train.batch_size)) from None
            return metrics, guard.END_OF_DATA
        except tf.errors.OpError as error:
            if not _is_input_error(error):
                raise
            raise UserError(_loop_failure(trainer, error, step)) from None
        if compiled:
            interval.add(totals, time.perf_counter() - started)
        else:
            _log_compiled(trainer, time.perf_counter() - started)
            interval.add_untimed(totals, num_steps=1)
            compiled = True
        step = int(trainer.global_step.numpy())
        _log_first_skips(trainer, interval, logged_first_skips)
        _log_first_retries(trainer, totals, logged_first_retries)
        diverged = _divergence(trainer, totals)
        if diverged:
            if recoveries >= config.train.max_recoveries:  # Before any save: no bad checkpoint.
                raise guard.TrainingDiverged(
                    diverged + _cure(trainer, bool(totals["last_inputs_finite"])))
            recoveries += 1
            healed = _recover(trainer, diverged, recoveries, bool(totals["last_inputs_finite"]))
            heals += healed
            compiled = compiled and not healed  # A heal traces the loop anew: timed apart again.
            writer.write("train", step, {"recoveries": recoveries, "heals": heals})
            step = int(trainer.global_step.numpy())
            interval = reporting.Interval(step, trainer.state.skipped_totals())
            continue
        if _is_due(trainer, step, config.train.log_every_steps) or step == last_step:
            metrics.update(_report_train(trainer, writer, step, interval))
            interval = reporting.Interval(step, trainer.state.skipped_totals())
        computed = _run_actions(trainer, writer, "train", step, [a for a in actions if a.is_due(step)],
                                stop, taken=_train_metric_names(trainer),
                                reserved=reporting.BUILT_IN_TRAIN_TAGS)
        if computed:
            writer.write("train", step, computed)
        if stop.signal_number is not None:  # Save at once: a scheduler's grace period is short.
            break
        if _is_due(trainer, step, config.eval.every_steps):
            # Eval leaves the run's random sequence where training had it: a run that stops (and
            # evaluates) here and resumes then draws the noise a straight run draws.
            with trainer.random_states_kept():
                metrics.update(_report_eval(trainer, writer, step,
                                            [action for action in actions if action.at_eval], stop))
        if _is_due(trainer, step, config.checkpoint.every_steps):
            _save(trainer, step)
    return metrics, guard.CONTINUE


def _log_compiled(trainer: Runnable, seconds: float) -> None:
    logging.info("Compiled the train loop in %.1f s (tracing%s, and its first update; left out of "
                 "steps/s and the ETA)", seconds, " and XLA" if trainer.jit_compile else "")


def _run_actions(trainer: Runnable, writer: reporting.MetricWriter, split: str, step: int,
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
                                    f"{errors.described(error)}; {_kept_checkpoint(trainer)}")) from None
            finally:
                stop.running = None
            metrics.update(returned_metrics(action, returned, step, [*taken, *metrics], reserved))
    writer.flush(split)
    return metrics


def _train_metric_names(trainer: Runnable) -> list[str]:
    """The train metrics `compute_loss` reports, by name and as `name/objective`: tags an action's
    metric may not reuse."""
    names = trainer.train_metric_names
    return [tag for objective, metrics in names.items() for metric in metrics
            for tag in (metric, f"{metric}/{objective}")]


def _kept_checkpoint(trainer: Runnable) -> str:
    """What a run that stops on an error keeps: its last checkpoint, named."""
    last = tf.train.latest_checkpoint(trainer.resume_directory())
    return f"the last checkpoint ({last}) is kept" if last else "no checkpoint was saved yet"


def _is_input_error(error: tf.errors.OpError) -> bool:
    """Whether an op error of the train or eval step comes from its input (reading the data, a
    value or shape an op refuses, an op the compile mode lacks) rather than from mixloop."""
    return train_data.failed_reading(error) or isinstance(
        error, (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError))


def _loop_failure(trainer: Runnable, error: tf.errors.OpError, start_step: int) -> str:
    """The one line for an op error of the inner loop that began after `start_step`: reading the
    data failed (the last checkpoint is named: nothing later is saved) or the step did."""
    # The step counter holds the finished updates, perhaps with the failing one (its increment
    # does not wait for that update's data or step); the loop's first step is a floor.
    near = max(start_step + 1, int(trainer.global_step.numpy()))
    if train_data.failed_reading(error):
        return (f"the train data pipeline failed near step {near}: {op_error_summary(error)}; "
                f"{_kept_checkpoint(trainer)}")
    hint = (" (the step is compiled with XLA; --config.jit_compile=False runs it without)"
            if trainer.jit_compile and isinstance(error, tf.errors.UnimplementedError) else "")
    return f"the train step failed near step {near}: {op_error_summary(error)}{hint}"


def op_error_summary(error: tf.errors.OpError) -> str:
    """The line of a TensorFlow op error that says what went wrong, without the trace around it.

    That is the last line outside the traces: the shapes or values an op refused (`Matrix
    size-incompatible: In[0]: [32,9], In[1]: [8,16]`), or a Python exception raised in the data
    pipeline (`ValueError: ...`, the last line of its traceback), without tf.data's prefix naming
    the transformation.
    """
    noise = ("Graph execution error", "Detected at node", 'File "', "[[", "Stack trace",
             "tf2xla conversion failed")
    lines = [line.strip() for line in error.message.splitlines()]
    useful = [line for line in lines if line and not line.startswith(noise)]
    summary = (useful[-1] if useful else lines[0]).split("\t")[0].strip()
    summary = re.sub(r"^Error in user-defined function passed to .*? with iterator: \S+: ", "",
                     summary)
    summary = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", summary)  # A function called eagerly.
    summary = re.sub(r"\s+Label values:.*", "", summary)  # Every label of the batch.
    if re.search(_INDEX_OUT_OF_RANGE, summary):
        summary += " (an integer input, such as a label, outside its valid range)"
    return summary


# How TensorFlow's kernels without XLA say an index is out of range: gather (an embedding, a
# label's row), the segment sums of a gather's gradient, the sparse cross-entropy.
_INDEX_OUT_OF_RANGE = r" is not in \[| is out of range \[|outside the valid range of \["


def _divergence(trainer: Runnable, totals: dict) -> str:
    """The divergence message for the first objective whose guard stopped the loop, or ''."""
    for name, objective_totals in totals["objectives"].items():
        reason = int(objective_totals["stop_reason"])
        if reason in (guard.NONFINITE_LOSS, guard.TOO_MANY_SKIPS, guard.OVERFLOW_AT_MIN_SCALE):
            return _divergence_message(trainer, reason, name, objective_totals,
                                       bool(totals["last_inputs_finite"]))
    return ""


def _divergence_message(trainer: Runnable, reason: int, objective: str, totals: dict,
                        inputs_finite: bool) -> str:
    message = guard.describe(
        reason, step=int(trainer.global_step.numpy()),
        objective=objective if len(trainer.objectives) > 1 else None,
        loss=float(totals["last_loss"]), inputs_finite=inputs_finite,
        grads_finite=bool(totals["last_grads_finite"]), xla=trainer.jit_compile,
        scale=float(totals["last_scale"]),
        consecutive_skips=int(trainer.state.skips[objective].consecutive_skips.numpy()),
        max_consecutive_skips=trainer.config.train.max_consecutive_skips,
        nonfinite_paths=trainer.nonfinite_variable_paths(objective),
    )
    last_good = tf.train.latest_checkpoint(trainer.resume_directory())
    return f"{message}; last good checkpoint: {last_good or 'none yet'}"


def _recover(trainer: Runnable, message: str, recoveries: int, inputs_finite: bool) -> bool:
    """Restores the last good checkpoint (the data keeps moving forward) and goes on; with
    `precision.heal` and finite inputs, first moves the layers a probe of the diverged weights finds
    overflowing to float32. Returns whether it healed."""
    path = tf.train.latest_checkpoint(trainer.resume_directory())
    if path is None:
        hint = ("; a heal needs a checkpoint to restore (precision.float32_layers=auto probes "
                "before the first update)" if trainer.config.precision.heal and inputs_finite else "")
        raise guard.TrainingDiverged(message + hint + _cure(trainer, inputs_finite))
    healed = trainer.heal() if trainer.config.precision.heal and inputs_finite else ""
    logging.warning("%s %d of %d: %s. %sRestoring %s and continuing with later data.",
                    "Heal (recovery)" if healed else "Recovery", recoveries,
                    trainer.config.train.max_recoveries, message,
                    f"Healing: {healed}. " if healed else "", path)
    trainer.restore_weights(path)
    return bool(healed)


def _cure(trainer: Runnable, inputs_finite: bool) -> str:
    """The precision cure for a divergence's one line; '' for bad data, which no precision cures."""
    return trainer.divergence_cure() if inputs_finite else ""


def _log_first_skips(trainer: Runnable, interval: reporting.Interval, logged: set) -> None:
    """Names, once per objective and run, the variables behind its first non-finite update."""
    many = len(trainer.objectives) > 1
    for objective, count in interval.skipped(trainer.state.skipped_totals()).items():
        if not count or objective in logged:
            continue
        logged.add(objective)
        skips = trainer.state.skips[objective]
        bad_data = ("" if skips.first_inputs_finite.numpy()
                    else "; the batch's floating inputs held inf or NaN (bad data, not an overflow)")
        logging.info("First skipped update%s (non-finite gradients) by step %d: non-finite in %s%s",
                     f" of objective {objective!r}" if many else "", int(trainer.global_step.numpy()),
                     guard.describe_variables(trainer.nonfinite_variable_paths(objective)), bad_data)


def _log_first_retries(trainer: Runnable, totals: dict, logged: set) -> None:
    """Names, once per objective and run, the variables whose overflow first made a step be taken
    again (`precision.overflow_retries`): a cured overflow leaves no skip to name them."""
    many = len(trainer.objectives) > 1
    for objective, objective_totals in totals["objectives"].items():
        if not objective_totals["num_retries"] or objective in logged:
            continue
        logged.add(objective)
        logging.info("First overflow retried%s by step %d (taken again on its batch at a lower "
                     "loss scale): non-finite in %s", f" in objective {objective!r}" if many else "",
                     int(trainer.global_step.numpy()),
                     guard.describe_variables(trainer.nonfinite_variable_paths(objective, latest=True)))


def _report_train(trainer: Runnable, writer: reporting.MetricWriter, step: int,
                  interval: reporting.Interval) -> dict:
    cadenced = [name for name, objective in trainer.objectives.items() if objective.every_steps > 1]
    scalars = interval.summary(step, trainer.state.skipped_totals(), trainer.config.train.batch_size,
                               cadenced)
    for name, objective in trainer.objectives.items():
        scalars[reporting.tag("loss_scale", name, trainer.objectives)] = float(
            objective.loss_scale.scale.numpy())
        scalars[reporting.tag("learning_rate", name, trainer.objectives)] = float(
            keras.ops.convert_to_numpy(objective.optimizer.learning_rate))
    writer.write("train", step, {**scalars, reporting.PEAK_MEMORY_TAG: memory.peak_bytes()})
    reporting.log_progress(step, trainer.config.train.num_steps, scalars)
    return scalars


def _report_eval(trainer: Runnable, writer: reporting.MetricWriter, step: int, at_eval: list[Action],
                 stop: _StopRequest) -> dict:
    """Evaluates (with eval data), runs the eval-time actions `at_eval` with the weights eval used,
    and reports both together as the eval summary: TensorBoard's eval scalars, the `eval at step N:`
    line, and the run's metrics (`eval_<name>`, which `Finished ...` shows); {} with neither."""
    metrics = _evaluate(trainer, step) if trainer.eval_data is not None else {}
    if at_eval:
        with trainer.ema_weights():  # Eval-time actions see the weights eval saw.
            metrics.update(_run_actions(trainer, writer, "eval", step, at_eval, stop, taken=metrics))
    if not metrics:
        return {}
    writer.write("eval", step, metrics)
    reporting.log_eval(step, metrics)
    return {f"eval_{name}": value for name, value in metrics.items()}


def _evaluate(trainer: Runnable, step: int) -> dict[str, float]:
    """`trainer.evaluate()`; an op error of its input is one line (`UserError`)."""
    try:
        return dict(trainer.evaluate())
    except tf.errors.OpError as error:
        if not _is_input_error(error):
            raise
        raise UserError(f"the eval step failed at step {step}: {op_error_summary(error)}; "
                        f"{_kept_checkpoint(trainer)}") from None
