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

from typing import Any, Callable, Sequence

import tensorflow as tf

from mixloop.engine.loss import Loss, as_losses, per_weight


def gather_replicas(tree: Any) -> Any:
    """Every replica's rows of each tensor of `tree`, in replica order (the global batch's order:
    each replica holds one contiguous slice); `tree` itself on one replica. A replica-context call."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tree
    return tf.nest.map_structure(lambda t: context.all_gather(t, axis=0), tree)


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
