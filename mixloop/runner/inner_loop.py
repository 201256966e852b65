"""The inner loop: up to N train steps in one compiled call, counting and summing what each reports.

Per step: the next batch, the train step, then per objective its skip counters
(`state.SkipCounters.record`), its sums for the progress line and TensorBoard
(`reporting.add_update`) and the guard's verdict (`guard.stop_reason`); the loop ends early when an
objective shows the run diverging. One host sync per call: the controller reads the totals back.
The end of finite data is the controller's business: it counts the batches once and never asks
for more (a step inside a `tf.cond` cannot be traced by MirroredStrategy on CPUs).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import tensorflow as tf

from mixloop.engine import tracing
from mixloop.engine.objective import Objective
from mixloop.engine.step import TrainStep
from mixloop.runner import guard, reporting
from mixloop.runner.state import RunState

Totals = dict[str, Any]


class InnerLoop:
    """`steps(iterator, num_steps)` of `train_step` over `objectives`, counted in `state`, stopped by
    `max_consecutive_skips` skips in a row; each compile mode's loop is traced once and kept."""

    def __init__(self, train_step: TrainStep, objectives: Mapping[str, Objective], state: RunState,
                 metric_names: Mapping[str, list[str]], max_consecutive_skips: int):
        self.train_step, self.objectives, self.state = train_step, objectives, state
        self.metric_names = metric_names
        self.max_consecutive_skips = max_consecutive_skips
        self._by_mode: dict[Any, Callable[..., Totals]] = {}

    def forget(self) -> None:
        """Forgets every traced loop (after a layer moved to float32: tracing reads its dtype)."""
        self._by_mode = {}

    def compiled(self, mode: Any) -> Callable[..., Totals]:
        """The loop for compile mode `mode`, as a `tf.function` of (iterator, num_steps)."""
        if mode not in self._by_mode:
            self._by_mode[mode] = tracing.function(self._steps)
        return self._by_mode[mode]

    def _steps(self, iterator: Any, num_steps: tf.Tensor) -> Totals:
        """Up to `num_steps` train steps; per objective the sums `reporting.add_update` keeps and the
        guard's `stop_reason`, and whether the last batch's inputs were finite."""
        totals = {"objectives": {name: reporting.zero_totals(self.metric_names[name])
                                 for name in self.objectives},
                  "last_inputs_finite": tf.constant(True)}

        def going_on(step: tf.Tensor, totals: Totals) -> tf.Tensor:
            stopping = guard.any_stopping([t["stop_reason"] for t in totals["objectives"].values()])
            return tf.logical_and(step < num_steps, tf.logical_not(stopping))

        def update(step: tf.Tensor, totals: Totals) -> tuple[tf.Tensor, Totals]:
            return step + 1, self._counted(totals, self.train_step(next(iterator)))

        return tf.while_loop(going_on, update, (tf.zeros_like(num_steps), totals))[1]

    def _counted(self, totals: Totals, metrics: dict[str, Any]) -> Totals:
        """`totals` after the update whose step `metrics` these are; the skip counters moved on
        (the step itself counts the update in `global_step`)."""
        objectives = {}
        for name, report in metrics["objectives"].items():
            skips = self.state.skips[name]
            skips.record(report["ran"], report["applied"], self.train_step.nonfinite_gradients[name],
                         metrics["inputs_finite"])
            objectives[name] = {**reporting.add_update(totals["objectives"][name], report),
                                "stop_reason": guard.stop_reason(
                                    report, skips.consecutive_skips, self.max_consecutive_skips,
                                    guard.min_scale(self.objectives[name].loss_scale))}
        return {"objectives": objectives, "last_inputs_finite": metrics["inputs_finite"]}


def numpy_totals(totals: Optional[Totals]) -> Totals:
    """`totals` read back to the host, as NumPy values."""
    return tf.nest.map_structure(lambda value: value.numpy(), totals)
