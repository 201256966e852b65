"""Overflow retries: a step whose updates all overflowed is taken again on its batch at the lower scale.

A wrapper around the compiled step (`precision.overflow_retries` > 0, under a dynamic loss scale)::

    attempt 0, 1, ...: keep the model's non-trainable state no skip rolls back; take the step
        if every update due was skipped for an overflow a lower scale may cure (finite inputs and
        loss, the scale backed off) and attempts are left: put that state back, uncount the step
        (its number, and so every cadence, stays), and take it again
    a step no retry cured counts as one skip: its first attempt's scale reported, one back-off from it

The batch is not lost to the scale's search. A step where some objective applied its update is not
retried (the retry would apply it twice), and an overflow no scale cures (bad data, a scale at its
floor) does not drive the scale down faster than without retries. Each attempt starts from the
model's non-trainable state as the first found it (BatchNorm statistics, the Keras seed states: the
same dropout and noise; a `tf.random.Generator` outside the model draws anew). The attempt is
inside the compiled step, where XLA fuses it; the loop of attempts runs in the caller's graph, so
the step stays one trace and XLA never compiles the loop.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import keras
import tensorflow as tf

from mixloop.engine.loss_scale import DynamicLossScale
from mixloop.engine.objective import Objective

Report = dict[str, Any]


class OverflowRetries:
    """Up to `max_retries` retries of a step over `objectives` (those with a dynamic loss scale: only
    they back off) that counts its updates in `global_step`; 0 turns the wrapper off."""

    def __init__(self, objectives: Mapping[str, Objective], max_retries: int, model: keras.Model,
                 global_step: tf.Variable):
        self.objectives = objectives
        self.max_retries = int(max_retries) if any(
            isinstance(o.loss_scale, DynamicLossScale) for o in objectives.values()) else 0
        self.global_step = global_step
        # What a retry must put back beyond the skipped objectives' own rollbacks: the model's
        # non-trainable state outside every objective updated at each step.
        rolled_back = {id(v) for o in objectives.values() if o.every_steps == 1 for v in o.state}
        self._kept_state = [v for v in model.non_trainable_variables if id(v) not in rolled_back]

    def attempt(self, step: Callable[[Any], Report]) -> Callable[[Any, tf.Tensor], Report]:
        """One attempt of `step` (which counts itself) on a batch, as a function of (batch, attempt
        number) whose report also says whether to `retry`; an attempt to be retried leaves the step
        count and the kept state as it found them."""
        def one_attempt(batch: Any, number: tf.Tensor) -> Report:
            kept = [tf.identity(v) for v in self._kept_state]
            report = step(batch)
            retry = tf.logical_and(number < self.max_retries,
                                   self._curable_overflow(report["objectives"], report["inputs_finite"]))
            self.global_step.assign_add(-tf.cast(retry, tf.int64))
            for variable, value in zip(self._kept_state, kept):
                variable.assign(tf.where(retry, value, variable))
            return {**report, "retry": retry}

        return one_attempt

    def __call__(self, attempt: Callable[..., Report], batch: Any, jit_compile: bool) -> Report:
        """`attempt` (the compiled `attempt(step)`) on `batch`, called again while its report says
        `retry`, in the caller's graph; each objective's report gains `retries`."""
        def again(number, retry, report):
            del retry
            report = attempt(batch, number)
            return number + 1, report["retry"], report

        def settled_from(number, report, first_scales):
            attempts, _, report = tf.while_loop(lambda _, retry, __: retry, again,
                                                (number, tf.constant(True), report))
            return self._settled(attempts, report, first_scales)

        first_scales = {name: objective.loss_scale.scale for name, objective in self.objectives.items()}
        if jit_compile:
            # The loop only where the first attempt overflowed: around every step it cost a small
            # XLA step several percent, the conditional less (docs/step.md). XLA compiles once.
            first = attempt(batch, tf.constant(0))
            return tf.cond(first["retry"], lambda: settled_from(tf.constant(1), first, first_scales),
                           lambda: self._settled(tf.constant(1), first, {}))
        # Graph mode would inline a second call site's step into the graph again (twice the
        # compilation); a loop around one call costs its steps little (docs/step.md).
        outputs = attempt.get_concrete_function(batch, tf.constant(0)).structured_outputs
        unset = tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype), outputs)
        return settled_from(tf.constant(0), unset, first_scales)

    def _settled(self, attempts: tf.Tensor, report: Report, first_scales: dict) -> Report:
        """The last attempt's report with each objective's `retries`; an objective no retry cured
        (given `first_scales`, the scales of the batch's first attempt; none where nothing was
        retried) counts as a plain skip: its first scale in the report, one back-off from it."""
        report = {**report, "objectives": {name: dict(r) for name, r in report["objectives"].items()}}
        del report["retry"]
        for name, objective in self.objectives.items():
            objective_report = report["objectives"][name]
            objective_report["retries"] = tf.where(objective_report["ran"], attempts - 1, 0)
            if name in first_scales and isinstance(objective.loss_scale, DynamicLossScale):
                uncured = tf.logical_and(objective_report["retries"] > 0,
                                         tf.logical_not(objective_report["applied"]))
                objective_report["loss_scale"] = tf.where(uncured, first_scales[name],
                                                          objective_report["loss_scale"])
                objective.loss_scale.back_off_once_from(first_scales[name], uncured)
        return report

    def _curable_overflow(self, reports: Mapping[str, Report], inputs_finite: tf.Tensor) -> tf.Tensor:
        """Whether this attempt skipped every update due, each for non-finite gradients from
        finite inputs and a finite loss, with its scale now lower than the one it used."""
        due_and_curable, any_due = [], []
        for name, objective in self.objectives.items():
            r = reports[name]
            curable = tf.logical_and(tf.logical_not(r["applied"]), tf.math.is_finite(r["loss"]))
            curable = tf.logical_and(curable, objective.loss_scale.scale < r["loss_scale"])
            due_and_curable.append(tf.logical_or(tf.logical_not(r["ran"]), curable))
            any_due.append(r["ran"])
        return tf.logical_and(inputs_finite, tf.logical_and(tf.reduce_all(due_and_curable),
                                                            tf.reduce_any(any_due)))


def without_retries(report: Report) -> Report:
    """`report` of a step taken once, each objective's `retries` 0."""
    for objective_report in report["objectives"].values():
        objective_report["retries"] = tf.constant(0)
    return report
