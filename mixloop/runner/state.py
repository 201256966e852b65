"""The run's counters: updates made, and per objective the skipped ones, kept in variables so a
checkpoint carries them and the compiled inner loop updates them."""

from __future__ import annotations

import tensorflow as tf


def _counter(name: str) -> tf.Variable:
    return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)


class SkipCounters(tf.Module):
    """One objective's skipped updates: in total, in a row, and which gradients started the streak."""

    def __init__(self, num_variables: int, name: str):
        super().__init__(name=name)
        self.skipped_total = _counter("skipped_total")
        self.consecutive_skips = _counter("consecutive_skips")
        # Which gradients were non-finite in the first skipped update of the latest streak, and
        # whether that update's batch had finite floating inputs.
        self.first_nonfinite = tf.Variable(tf.zeros([num_variables], tf.bool), trainable=False,
                                           name="first_nonfinite")
        self.first_inputs_finite = tf.Variable(True, trainable=False, name="first_inputs_finite")

    def record(self, ran: tf.Tensor, applied: tf.Tensor, nonfinite_gradients: tf.Variable,
               inputs_finite: tf.Tensor) -> None:
        """Counts one step of this objective: an update applied or skipped where it `ran`, nothing
        where it was not due (`Objective.every_steps`). Graph-safe."""
        skipped = tf.logical_and(ran, tf.logical_not(applied))
        starts_streak = tf.logical_and(skipped, self.consecutive_skips == 0)
        self.first_nonfinite.assign(tf.where(starts_streak, nonfinite_gradients, self.first_nonfinite))
        self.first_inputs_finite.assign(
            tf.where(starts_streak, inputs_finite, self.first_inputs_finite))
        self.consecutive_skips.assign(tf.where(
            ran, tf.where(applied, tf.constant(0, tf.int64), self.consecutive_skips + 1),
            self.consecutive_skips))
        self.skipped_total.assign_add(tf.cast(skipped, tf.int64))


class RunState(tf.Module):
    """The update counter shared by all objectives, and one `SkipCounters` per objective."""

    def __init__(self, num_variables: dict[str, int]):
        super().__init__(name="run_state")
        self.global_step = _counter("global_step")  # Updates made, skipped ones included.
        self.skips = {name: SkipCounters(count, name=f"skips_{name}")
                      for name, count in num_variables.items()}

    def skipped_totals(self) -> dict[str, int]:
        """Per objective, the updates skipped so far in the run."""
        return {name: int(counters.skipped_total.numpy()) for name, counters in self.skips.items()}
