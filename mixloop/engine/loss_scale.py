"""Loss scaling: no-op, static and dynamic scales behind one small interface, with graph-safe updates.

The interface (as in jmp and PyTorch's GradScaler): `scale` is the current float32 factor;
`scale_loss(loss)` multiplies a float32 loss by it before differentiation; `unscale(grads)` divides
gradients by it in float32; `update(grads_finite)` adjusts the scale once per optimizer update.
Every piece of state is a `tf.Variable`, so `tf.train.Checkpoint` saves and restores it.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf


def leaves_finite(tree: Any) -> tf.Tensor:
    """A [num_leaves] tf.bool vector: whether each tensor of `tree` holds only finite values.

    `None` leaves (unconnected variables) are left out.
    """
    flags = [tf.reduce_all(tf.math.is_finite(t)) for t in tf.nest.flatten(tree) if t is not None]
    # tf.stack([]) would be a float32 vector, which reduce_all rejects.
    return tf.stack(flags) if flags else tf.zeros([0], tf.bool)


def all_finite(grads: Any) -> tf.Tensor:
    """Returns a scalar tf.bool: whether every element of every tensor in `grads` is finite.

    Inside a `tf.distribute` replica context the answer is agreed by all replicas, so one replica's
    inf or NaN skips the update on every replica. `None` leaves (unconnected variables) are ignored.
    (The train step all-reduces its gradients first, after which `leaves_finite` suffices.)
    """
    local = tf.reduce_all(leaves_finite(grads))
    replica_context = tf.distribute.get_replica_context()
    if replica_context is None or replica_context.num_replicas_in_sync == 1:
        return local
    num_non_finite = replica_context.all_reduce(
        tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(local), tf.float32)
    )
    return tf.equal(num_non_finite, 0.0)


class LossScale(tf.Module):
    """The shared interface; subclasses define how the scale reacts to `update`."""

    def __init__(self, initial_scale: float, name: str):
        super().__init__(name=name)
        self._scale = tf.Variable(
            initial_scale, dtype=tf.float32, trainable=False, name="scale",
            synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )

    @property
    def scale(self) -> tf.Tensor:
        """The current loss scale, a float32 scalar."""
        return tf.convert_to_tensor(self._scale)

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Multiplies `loss` by the current scale (in the loss's own dtype, normally float32)."""
        return loss * tf.cast(self._scale, loss.dtype)

    def unscale(self, grads: Any) -> Any:
        """Divides every gradient by the current scale, returning float32 tensors."""
        inverse = 1.0 / self._scale
        return tf.nest.map_structure(
            lambda g: None if g is None else tf.cast(g, tf.float32) * inverse, grads
        )

    def update(self, grads_finite: tf.Tensor) -> None:
        """Adjusts the scale after one optimizer update whose gradients were (not) all finite."""
        del grads_finite  # A fixed scale ignores overflows.


class NoLossScale(LossScale):
    """A scale of exactly 1 that never changes: for float32 and bfloat16 runs."""

    def __init__(self, name: str = "no_loss_scale"):
        super().__init__(1.0, name=name)


class StaticLossScale(LossScale):
    """A fixed scale, for models whose gradient range is known in advance."""

    def __init__(self, value: float, name: str = "static_loss_scale"):
        # An infinite scale would turn every gradient into inf and skip every update.
        if not 0 < value < math.inf:
            raise ValueError(f"StaticLossScale value must be positive and finite, got {value!r}")
        super().__init__(value, name=name)


class DynamicLossScale(LossScale):
    """A scale that grows while gradients stay finite and backs off when they overflow.

    Per optimizer update, with `good_steps` and `hysteresis_left` as state::

        if grads_finite:
            good_steps += 1
            if good_steps == growth_interval:
                scale = min(scale * growth_factor, max_scale)
                good_steps = 0
                hysteresis_left = hysteresis
        else:
            good_steps = 0
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:
                scale = max(scale * backoff_factor, min_scale)

    With `hysteresis=1` (the default) every overflow backs off, as in PyTorch's GradScaler; with a
    larger value the first `hysteresis - 1` overflows since the last growth leave the scale alone and
    every later one backs off, as DeepSpeed does.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        name: str = "dynamic_loss_scale",
    ):
        _check_dynamic_arguments(
            initial_scale=initial_scale, growth_interval=growth_interval,
            growth_factor=growth_factor, backoff_factor=backoff_factor, hysteresis=hysteresis,
            min_scale=min_scale, max_scale=max_scale,
        )
        super().__init__(initial_scale, name=name)
        self.growth_interval = int(growth_interval)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        replicated = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_WRITE,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        self.good_steps = tf.Variable(0, dtype=tf.int64, name="good_steps", **replicated)
        self.hysteresis_left = tf.Variable(
            self.hysteresis, dtype=tf.int64, name="hysteresis_left", **replicated
        )

    def start_at(self, scale: float) -> float:
        """Sets the scale to `scale`, clipped into [min_scale, max_scale], before the first update
        (the probe's advice for `precision.initial_scale=auto`); returns the scale set."""
        clipped = min(max(float(scale), self.min_scale), self.max_scale)
        self._scale.assign(clipped)
        return clipped

    def back_off_once_from(self, scale: tf.Tensor, where: tf.Tensor) -> None:
        """Where `where` holds, sets the scale to one back-off from `scale` (graph-safe): a step
        that overflowed at `scale` and again at each lower scale its retries tried costs what it
        costs without retries (`TrainStep`'s `overflow_retries`), not one back-off per attempt."""
        self._scale.assign(tf.where(where, self._backed_off(scale), self._scale))

    def _backed_off(self, scale: tf.Tensor) -> tf.Tensor:
        return tf.maximum(scale * self.backoff_factor, self.min_scale)

    def update(self, grads_finite: tf.Tensor) -> None:
        """Applies one step of the algorithm in the class docstring, branch-free (XLA-friendly)."""
        finite = tf.convert_to_tensor(grads_finite, dtype=tf.bool)
        good_steps = tf.where(finite, self.good_steps + 1, 0)
        grow = tf.logical_and(finite, good_steps >= self.growth_interval)
        hysteresis_left = tf.where(finite, self.hysteresis_left, tf.maximum(self.hysteresis_left - 1, 0))
        back_off = tf.logical_and(tf.logical_not(finite), tf.equal(hysteresis_left, 0))
        scale = tf.where(grow, tf.minimum(self._scale * self.growth_factor, self.max_scale), self._scale)
        scale = tf.where(back_off, self._backed_off(scale), scale)
        self._scale.assign(scale)
        self.good_steps.assign(tf.where(grow, tf.constant(0, tf.int64), good_steps))
        self.hysteresis_left.assign(tf.where(grow, tf.constant(self.hysteresis, tf.int64), hysteresis_left))


def _check_dynamic_arguments(
    *, initial_scale, growth_interval, growth_factor, backoff_factor, hysteresis, min_scale, max_scale
) -> None:
    problems = []
    if not growth_factor > 1:
        problems.append(f"growth_factor must be above 1, got {growth_factor!r}")
    if not 0 < backoff_factor < 1:
        problems.append(f"backoff_factor must lie in (0, 1), got {backoff_factor!r}")
    if not growth_interval >= 1:
        problems.append(f"growth_interval must be at least 1, got {growth_interval!r}")
    if not hysteresis >= 1:
        problems.append(f"hysteresis must be at least 1, got {hysteresis!r}")
    if not min_scale > 0:
        problems.append(f"min_scale must be positive, got {min_scale!r}")
    if not max_scale < math.inf:
        # The scale would grow to inf, where backing off (inf * backoff_factor) can never bring it down.
        problems.append(f"max_scale must be finite, got {max_scale!r}")
    elif not min_scale <= max_scale:
        problems.append(f"min_scale ({min_scale!r}) must not exceed max_scale ({max_scale!r})")
    elif not min_scale <= initial_scale <= max_scale:
        problems.append(
            f"initial_scale must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}], "
            f"got {initial_scale!r}"
        )
    if problems:
        raise ValueError("DynamicLossScale: " + "; ".join(problems))
