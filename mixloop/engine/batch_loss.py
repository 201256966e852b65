"""A loss over the whole global batch under accumulation and replicas: the pieces of GradCache's two passes.

A contrastive loss (NT-Xent, CLIP) couples the examples of a batch: each example's gradient depends
on every other one. Accumulation computes the loss per micro-batch and replicas per slice, which is
another loss (fewer negatives), not the same loss in pieces. The two passes (Gao et al. 2021,
"Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", luyug/GradCache) give
the large-batch gradient exactly, with accumulation's memory::

    pass 1, per micro-batch: forward without a tape; keep its float32 outputs (the embeddings)
    gather the outputs and the batch of every micro-batch and replica: the global batch's
    the loss on them in float32, and per objective its gradient with respect to the outputs
    put the random states and statistics the first pass moved back
    pass 2, per micro-batch: forward again under a tape (the same random draws), backward from the
        outputs with the loss scale times their output gradients; unscale into the accumulators

By the chain rule, sum over micro-batches of (d outputs_i / d weights)^T (d loss / d outputs_i) is
d loss / d weights. The memory held is the whole batch's outputs and one micro-batch's activations;
the cost is one more forward pass per micro-batch. `TrainStep(batch_loss=True)` runs the loops;
this module holds what they compute on the whole batch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import keras
import tensorflow as tf

from mixloop.engine.loss import Loss, as_losses, per_weight
from mixloop.errors import UserError

_BATCH_SHAPED_ADVICE = ("make every model output batch-shaped ([batch, ...]: take a statistic over "
                        "the batch, such as a mean, in compute_loss instead), or set "
                        "train.batch_loss=False")


def batch_shaped(outputs: Any, num_rows: Any, joined: str) -> Any:
    """`outputs` (one micro-batch's, of `num_rows` rows: an int, or a scalar tensor where the
    batch dimension is unknown) once each leaf's first dimension is checked to be `num_rows`: the
    two passes join outputs along it (`joined`: over what), so an output of another shape (a
    batch mean of shape [3]) would reach the loss as the pieces laid end to end ([6]), a loss
    on something else than the whole batch's.

    Raises:
      UserError: at trace time, where the shapes are static, naming the output and its shape;
        otherwise the check is an assertion (InvalidArgumentError with the same line when run).
    """
    checked = []
    for path, leaf in keras.tree.flatten_with_path(outputs):
        message = _not_batch_shaped(path, leaf.shape, num_rows, joined)
        size = _first_dimension(leaf.shape)
        if size == 0:  # A scalar has no rows to join.
            raise UserError(message)
        if isinstance(num_rows, int) and size is not None:
            if size != num_rows:
                raise UserError(message)
            checked.append(leaf)
            continue
        assertion = tf.debugging.assert_equal(tf.shape(leaf)[0], tf.cast(num_rows, tf.int32),
                                              message=message)
        with tf.control_dependencies([assertion]):
            checked.append(tf.identity(leaf))
    return tf.nest.pack_sequence_as(outputs, checked)


def _first_dimension(shape: tf.TensorShape) -> Optional[int]:
    """The static first dimension of `shape`; 0 for a scalar's; None where it is unknown."""
    if shape.rank is None:
        return None
    return shape[0] if shape.rank else 0


def _not_batch_shaped(path: tuple, shape: tf.TensorShape, num_rows: Any, joined: str) -> str:
    """The line refusing the output at `path` of `shape` in a micro-batch of `num_rows` rows
    (without quotes, which an assertion's message would show escaped)."""
    name = f"model output {'/'.join(map(str, path))}" if path else "the model output"
    size = f" {num_rows}" if isinstance(num_rows, int) else ""
    return (f"train.batch_loss: {name} has shape {shape}, whose first dimension is not the "
            f"micro-batch size{size}; the loss over the whole batch would read it {joined}, laid "
            f"end to end; {_BATCH_SHAPED_ADVICE}")


def gather_replicas(tree: Any) -> Any:
    """Every replica's rows of each tensor of `tree`, in replica order (the global batch's order:
    each replica holds one contiguous slice); `tree` itself on one replica. A replica-context call."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tree
    return tf.nest.map_structure(lambda t: _gathered(context, t), tree)


def _gathered(context: tf.distribute.ReplicaContext, tensor: tf.Tensor) -> tf.Tensor:
    """Every replica's rows of `tensor`, with the static batch dimension the all-gather forgets
    (replicas x rows), so a loss may loop over it in Python."""
    gathered = context.all_gather(tensor, axis=0)
    if tensor.shape.rank and tensor.shape[0] is not None:
        gathered.set_shape([tensor.shape[0] * context.num_replicas_in_sync, *tensor.shape[1:]])
    return gathered


def replica_rows(tree: Any, num_rows: int) -> Any:
    """This replica's `num_rows` rows of each tensor of `tree`, a structure `gather_replicas` made."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tree
    start = tf.cast(context.replica_id_in_sync_group, tf.int32) * num_rows
    return tf.nest.map_structure(lambda t: t[start:start + num_rows], tree)


def on_first_replica(tree: Any) -> Any:
    """`tree` on the first replica and zeros on the others: what every replica computes alike (the
    global batch's loss), counted once by the all-reduce that sums the replicas."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tree
    first = tf.equal(context.replica_id_in_sync_group, 0)
    return tf.nest.map_structure(lambda t: tf.where(first, t, tf.zeros_like(t)), tree)


def floating_leaves(tree: Any) -> list[tf.Tensor]:
    """The floating tensors of `tree`, in `tf.nest.flatten` order: the outputs a loss can be
    differentiated with respect to."""
    return [t for t in tf.nest.flatten(tree) if tf.as_dtype(t.dtype).is_floating]


def loss_and_output_gradients(
    loss_fn: Callable[[Any, Any], Any], outputs: Any, batch: Any, objective_names: Sequence[str],
) -> tuple[dict[str, Loss], dict[str, list[tf.Tensor]]]:
    """The losses `loss_fn(outputs, batch)` of the whole batch, and per objective the gradient of its
    loss per weight (`per_weight`: the mean the step scales) with respect to each floating leaf of
    `outputs` (zeros where the loss does not read a leaf), in float32.
    """
    leaves = floating_leaves(outputs)
    with tf.GradientTape(persistent=len(objective_names) > 1) as tape:
        tape.watch(leaves)
        losses = as_losses(loss_fn(outputs, batch), objective_names)
        means = {name: per_weight(loss.value, tf.stop_gradient(loss.weight))
                 for name, loss in losses.items()}
    grads = {name: tape.gradient(means[name], leaves,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
             for name in objective_names}
    return losses, grads
