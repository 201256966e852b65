"""What crosses replicas in one update: sums, maxima, gathered rows, and the first replica's value.

Every function here is the identity on one replica (no collective in the graph), so the step reads
the same on one device as on many.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf


def sum_over_replicas(value: Any) -> Any:
    """Sums `value` (any structure of tensors) over the replicas, in one all-reduce."""
    context = _several_replicas()
    return value if context is None else context.all_reduce(tf.distribute.ReduceOp.SUM, value)


def max_over_replicas(value: Any) -> Any:
    """The element-wise maximum of `value` over the replicas, NaN wherever any replica has NaN
    (tf.distribute's all-reduce has no MAX: each tensor is gathered along a new first axis and
    reduced)."""
    context = _several_replicas()
    if context is None or not tf.nest.flatten(value):
        return value
    gathered = context.all_gather(tf.nest.map_structure(lambda t: t[tf.newaxis], value), axis=0)
    return tf.nest.map_structure(lambda t: nan_kept(tf.reduce_max(t, axis=0), t), gathered)


def maximum(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """The element-wise maximum, NaN where either is NaN: XLA's maximum on a CPU drops a NaN
    (max(1, NaN) = 1), which would hide an overflowed micro-batch's new value."""
    return tf.where(tf.math.is_nan(a + b), a + b, tf.maximum(a, b))


def nan_kept(reduced: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """`reduced` (a maximum of `values` along their first axis), NaN where any of them is NaN."""
    nan = tf.reduce_any(tf.math.is_nan(values), axis=0)
    return tf.where(nan, tf.constant(float("nan"), reduced.dtype), reduced)


def gather_replicas(tree: Any) -> Any:
    """Every replica's rows of each tensor of `tree`, in replica order (the global batch's order:
    each replica holds one contiguous slice). A replica-context call."""
    context = _several_replicas()
    if context is None:
        return tree
    return tf.nest.map_structure(lambda t: _gathered(context, t), tree)


def _gathered(context: tf.distribute.ReplicaContext, tensor: tf.Tensor) -> tf.Tensor:
    """Every replica's rows of `tensor`, with the static batch dimension the all-gather forgets
    (replicas x rows), so a loss may loop over it in Python."""
    gathered = context.all_gather(tensor, axis=0)
    if tensor.shape.rank and tensor.shape[0] is not None:
        gathered.set_shape([tensor.shape[0] * context.num_replicas_in_sync, *tensor.shape[1:]])
    return gathered


def replica_rows(tree: Any, num_rows: Any) -> Any:
    """This replica's `num_rows` rows of each tensor of `tree`, a structure `gather_replicas` made."""
    context = _several_replicas()
    if context is None:
        return tree
    start = tf.cast(context.replica_id_in_sync_group, tf.int32) * num_rows
    return tf.nest.map_structure(lambda t: t[start:start + num_rows], tree)


def on_first_replica(tree: Any) -> Any:
    """`tree` on the first replica and zeros on the others: what every replica computes alike (the
    global batch's loss), counted once by the all-reduce that sums the replicas."""
    context = _several_replicas()
    if context is None:
        return tree
    first = tf.equal(context.replica_id_in_sync_group, 0)
    return tf.nest.map_structure(lambda t: tf.where(first, t, tf.zeros_like(t)), tree)


def first_replica(strategy: tf.distribute.Strategy, value: Any) -> Any:
    """The first local replica's part of `value` (all replicas hold the same reduced values)."""
    return strategy.experimental_local_results(value)[0]


def _several_replicas() -> Optional[tf.distribute.ReplicaContext]:
    """The replica context when there are several replicas to communicate with, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context
