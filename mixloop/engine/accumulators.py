"""Where micro-batches' gradients add up: float32 accumulators, or bfloat16 ones rounded stochastically.

A bfloat16 accumulator (`train.accumulation_dtype="bfloat16"`, half the bytes) gets each sum computed
in float32 and rounded stochastically, each variable with its own draws from a seed keyed by the
update's number and the micro-batch's index: a plain rounding would drop a micro-batch's gradient
wherever it is below half the accumulated value's spacing, and the same seeds make a resumed run
round as the straight one did. New values (`gradients.Gradients`) combine by maximum, in float32.
"""

from __future__ import annotations

from typing import Mapping

import tensorflow as tf

from mixloop.engine import low_bit
from mixloop.engine.gradients import Gradients, Partition
from mixloop.engine.replicas import maximum


class Accumulators:
    """Accumulators of `dtype` (float32 or bfloat16) for each objective's `Partition`."""

    def __init__(self, partitions: Mapping[str, Partition], dtype: tf.DType = tf.float32):
        self.partitions = partitions
        self.dtype = tf.as_dtype(dtype)

    def zeros(self) -> dict[str, Gradients]:
        """Per objective, accumulators holding nothing yet."""
        return {name: partition.zeros(self.dtype) for name, partition in self.partitions.items()}

    def added(self, accumulated: Mapping[str, Gradients], grads: Mapping[str, Gradients],
              seed: tf.Tensor) -> dict[str, Gradients]:
        """Per objective, float32 `grads` added to `accumulated`; a bfloat16 accumulator rounds each
        variable's sum stochastically with draws from `seed` (`rounding_seed`) and its position."""
        return {name: Gradients(
                    [self._add(a, g, seed, position) for a, g, position in zip(
                        accumulated[name].derivatives, grads[name].derivatives,
                        partition.derivative_positions)],
                    [maximum(a, g) for a, g in zip(accumulated[name].new_values, grads[name].new_values)])
                for name, partition in self.partitions.items()}

    @staticmethod
    def _add(accumulated: tf.Tensor, grad: tf.Tensor, seed: tf.Tensor, position: int) -> tf.Tensor:
        if accumulated.dtype == tf.float32:
            return accumulated + grad
        return low_bit.stochastic_round_to_bfloat16(tf.cast(accumulated, tf.float32) + grad,
                                                    seed + tf.constant([0, 1]) * position)


def rounding_seed(step_number: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """The stateless seed of micro-batch `index`'s stochastic roundings at update `step_number`
    (the same in a resumed run: both come from the checkpointed step); variables then add their
    position to its second element, in steps of 2^16, so no two draws share a seed."""
    return tf.stack([tf.cast(step_number, tf.int32), tf.cast(index, tf.int32) * (1 << 16)])
