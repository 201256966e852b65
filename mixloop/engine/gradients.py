"""An objective's gradient as two kinds of value, kept apart from the backward pass to the update.

Most variables get a derivative: unscaled into float32, weighted by the loss weight, summed over
micro-batches and replicas, averaged by the total weight, clipped. A variable Keras overwrites with
its "gradient" (`overwrite_with_gradient`: float8's scales and amax histories) gets its new value
instead: never unscaled or weighted, combined over micro-batches and replicas by maximum (as Keras's
accumulation does), left out of the norm and the clipping, checked for finiteness like the rest.
`Gradients` carries the two lists apart; a `Partition` splits a backward pass's list into them and
merges them back, in the variables' order, once, for the optimizer.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import tensorflow as tf

from mixloop.engine.loss_scale import leaves_finite


class Gradients(NamedTuple):
    """One objective's gradient: `derivatives` (one per variable not overwritten, in order) and
    `new_values` (one per overwritten variable, in order); a structure `tf.nest` walks."""

    derivatives: list
    new_values: list


class Partition:
    """Which of an objective's `variables` get a derivative and which a new value, and which its
    loss does not reach (known once a backward pass is traced)."""

    def __init__(self, variables: Sequence[Any]):
        self.variables = list(variables)
        self.overwritten = [bool(getattr(v, "overwrite_with_gradient", False)) for v in self.variables]
        # The variables' positions among all of the objective's: a bfloat16 accumulator seeds each
        # variable's rounding by its position.
        self.derivative_positions = [i for i, new in enumerate(self.overwritten) if not new]
        # Per variable, while tracing: the loss does not reach it (its gradient is None). It gets
        # zeros, which change neither the norm nor the finiteness check, and no update.
        self.unreached = [False] * len(self.variables)

    def split(self, values: list) -> Gradients:
        """`values`, one per variable, as `Gradients`."""
        return Gradients([v for v, new in zip(values, self.overwritten) if not new],
                         [v for v, new in zip(values, self.overwritten) if new])

    def merged(self, gradients: Gradients) -> list:
        """One value per variable, in the variables' order: the inverse of `split`."""
        derivatives, new_values = iter(gradients.derivatives), iter(gradients.new_values)
        return [next(new_values) if new else next(derivatives) for new in self.overwritten]

    def zeros(self, dtype: tf.DType = tf.float32) -> Gradients:
        """What adds nothing to accumulated gradients: zero derivatives in `dtype`, and the lowest
        float32 as each new value (combined by maximum)."""
        return self.split([tf.fill(v.shape, tf.float32.min) if new else tf.zeros(v.shape, dtype)
                           for v, new in zip(self.variables, self.overwritten)])

    def from_backward(self, scaled: list, scale: tf.Tensor, weight: Optional[tf.Tensor] = None
                      ) -> Gradients:
        """The gradients of a backward pass of loss scale `scale` (`scaled`: one per variable, None
        where the loss does not reach it): derivatives unscaled into float32 and times the loss
        `weight` (none for a mean's weight of 1); new values as they came (an output gradient's amax
        is measured on the scaled backward it quantizes, as under Keras's LossScaleOptimizer)."""
        self.unreached = [grad is None for grad in scaled]
        gradients = self.split([tf.zeros(v.shape, tf.float32) if g is None else g
                                for g, v in zip(scaled, self.variables)])
        inverse = 1.0 / scale
        derivatives = [tf.cast(g, tf.float32) * inverse for g in gradients.derivatives]
        if weight is not None:
            derivatives = [times_weight(g, weight) for g in derivatives]
        return Gradients(derivatives, gradients.new_values)

    def weighted(self, gradients: Gradients, weight: tf.Tensor) -> Gradients:
        """`gradients` with the derivatives times the loss `weight`."""
        return Gradients([times_weight(g, weight) for g in gradients.derivatives], gradients.new_values)

    def reached(self, values: list) -> list:
        """The entries of `values` (one per variable) whose variable the loss reaches."""
        return [value for value, unreached in zip(values, self.unreached) if not unreached]


def averaged(gradients: Gradients, weight: tf.Tensor) -> Gradients:
    """Summed derivatives divided by the total loss `weight`; new values as they are. A weight of
    0 makes NaN, which the finiteness check then catches."""
    return Gradients([g / weight for g in gradients.derivatives], gradients.new_values)


def finite_per_variable(partition: Partition, gradients: Gradients) -> tf.Tensor:
    """A bool per variable, in order: its derivative or new value holds no inf or NaN."""
    return leaves_finite(partition.merged(gradients))


def clipped(gradients: Gradients, clip_global_norm: Optional[float], norm: tf.Tensor) -> Gradients:
    """The derivatives scaled down to `clip_global_norm` where their global `norm` exceeds it
    (unchanged for None); new values as they are."""
    if clip_global_norm is None:
        return gradients
    derivatives, _ = tf.clip_by_global_norm(gradients.derivatives, clip_global_norm, use_norm=norm)
    return Gradients(derivatives, gradients.new_values)


def times_weight(value: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """`value * weight`; `value` itself for the weight 1 of a plain mean loss."""
    return value if tf.get_static_value(weight) == 1.0 else value * weight


def as_float32(gradients: Any) -> Any:
    """`gradients` (any structure) in float32, whatever the accumulators held."""
    return tf.nest.map_structure(lambda g: tf.cast(g, tf.float32), gradients)
