"""An exponential moving average of the float32 master weights, advanced only by applied updates.

    average <- decay * average + (1 - decay) * weight     after every applied update
    average  = weight                                     at the start

A skipped update does not run the average's update at all, so it stays bit-identical. Averages
are float32 even for weights stored in bfloat16 (`precision.master_weights`), whose per-update
change of (1 - decay) x the difference bfloat16 would round away. The
averages are variables of the run: checkpointed, mirrored under replicas, swapped into the model
for eval and written by the export.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf


class ExponentialMovingAverage(tf.Module):
    """The moving average of `variables` with `decay` in [0, 1)."""

    def __init__(self, variables: list, decay: float, name: str = "ema"):
        super().__init__(name=name)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"the EMA decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self._variables = list(variables)
        self.averages = [
            tf.Variable(tf.cast(v.value, tf.float32), trainable=False, name=f"average_{index}",
                        synchronization=tf.VariableSynchronization.ON_WRITE,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for index, v in enumerate(self._variables)]

    def update(self) -> None:
        """Moves every average toward its variable's current value (call after an applied update)."""
        for average, variable in zip(self.averages, self._variables):
            average.assign(self.decay * average + (1.0 - self.decay) * tf.cast(variable, average.dtype))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averages in the variables for the `with` block; the trained values back afterwards."""
        trained = [tf.identity(v) for v in self._variables]
        for variable, average in zip(self._variables, self.averages):
            variable.assign(tf.cast(average, variable.dtype))
        try:
            yield
        finally:
            for variable, value in zip(self._variables, trained):
                variable.assign(value)
