"""A loss over the whole global batch under accumulation and replicas: GradCache's two passes, a gradient source.

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
the cost is one more forward pass per micro-batch. `TwoPasses` is the source `TrainStep` takes with
`batch_loss=True` (engine/micro_batches.py says what a gradient source is).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import keras
import tensorflow as tf

from mixloop.engine import replicas
from mixloop.engine.accumulators import Accumulators, rounding_seed
from mixloop.engine.gradients import Gradients, Partition, as_float32
from mixloop.engine.loss import Loss, as_losses, per_weight
from mixloop.engine.micro_batches import BodyCompiler, micro_batch_at, micro_batch_loop, split_micro_batches
from mixloop.engine.micro_step import forward, weighted_sums, when
from mixloop.engine.objective import Objective, due_at
from mixloop.engine.policy import Policy, floating_leaves
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


class TwoPasses:
    """The gradient of the loss of the whole global batch, `num_micro_batches` micro-batches per
    replica: GradCache's two passes (the module docstring), added up in `accumulators`. Every replica
    computes that loss alike; the first one reports it."""

    def __init__(self, model: keras.Model, policy: Policy, loss_fn: Callable[[Any, Any], Any],
                 input_fn: Callable[[Any], Any], objectives: Mapping[str, Objective],
                 partitions: Mapping[str, Partition], num_micro_batches: int,
                 accumulators: Accumulators, num_replicas: int,
                 compile_body: BodyCompiler = lambda body: body):
        self.model, self.policy = model, policy
        self.loss_fn, self.input_fn = loss_fn, input_fn
        self.objectives, self.partitions = objectives, partitions
        self.num_micro_batches = num_micro_batches
        self.accumulators = accumulators
        self.num_replicas = num_replicas
        self._forward = compile_body(self._forward_micro_batch)
        self._add_backward = compile_body(self._added_backward)
        self.bodies = [self._forward, self._add_backward]  # The loops' bodies, as compiled.

    def loss_batch_spec(self, batch_spec: Any) -> Any:
        """What the loss sees of global batches of `batch_spec`: the whole batch."""
        return batch_spec

    def __call__(self, batch: Any, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        micro_batches = split_micro_batches(batch, self.num_micro_batches)
        state = self.model.non_trainable_variables  # Seed states, BatchNorm statistics.
        saved = [tf.identity(variable) for variable in state]
        outputs = self._concatenated(lambda i: self._forward(micro_batches, i))
        for variable, value in zip(state, saved):
            variable.assign(value)  # The second pass draws the first's noise; statistics move once.
        losses, output_grads = loss_and_output_gradients(
            self.loss_fn, replicas.gather_replicas(outputs), replicas.gather_replicas(batch),
            list(self.objectives))
        num_rows = tf.shape(tf.nest.flatten(batch)[0])[0]
        output_grads = split_micro_batches(replicas.replica_rows(output_grads, num_rows),
                                           self.num_micro_batches)
        grads = as_float32(micro_batch_loop(
            self.num_micro_batches,
            lambda i, accumulated: self._add_backward(micro_batches, output_grads, i, step_number,
                                                      accumulated),
            self.accumulators.zeros()))
        grads = {name: partition.weighted(grads[name], losses[name].weight)
                 for name, partition in self.partitions.items()}
        return grads, replicas.on_first_replica(
            {name: weighted_sums(loss) for name, loss in losses.items()})

    def _concatenated(self, forward_fn: Callable[[tf.Tensor], Any]) -> Any:
        """`forward_fn(i)`'s outputs for every micro-batch index i, concatenated along the batch (in
        a `tf.while_loop`; the first outside it, which gives the outputs' structure)."""
        first = forward_fn(tf.constant(0))
        arrays = [tf.TensorArray(t.dtype, size=self.num_micro_batches, element_shape=t.shape).write(0, t)
                  for t in tf.nest.flatten(first)]
        arrays = micro_batch_loop(
            self.num_micro_batches,
            lambda i, arrays: [array.write(i, t) for array, t in zip(arrays, tf.nest.flatten(forward_fn(i)))],
            arrays, start=1)
        return tf.nest.pack_sequence_as(first, [
            tf.reshape(array.stack(), tf.concat([[-1], tf.shape(t)[1:]], 0))
            for array, t in zip(arrays, tf.nest.flatten(first))])

    def _forward_micro_batch(self, micro_batches: Any, index: tf.Tensor) -> Any:
        """The first pass on micro-batch `index`: the float32 outputs of a forward without a tape."""
        micro_batch = micro_batch_at(micro_batches, index)
        outputs = forward(self.model, self.policy, self.input_fn(micro_batch), training=True)
        return batch_shaped(outputs, _num_rows(micro_batch), self._joined_over())

    def _joined_over(self) -> str:
        """'joined over 2 micro-batches and 2 replicas': what the two passes join outputs over."""
        counts = {"micro-batches": self.num_micro_batches, "replicas": self.num_replicas}
        return "joined over " + " and ".join(f"{n} {what}" for what, n in counts.items() if n > 1)

    def _added_backward(self, micro_batches: Any, output_grads: dict, index: tf.Tensor,
                        step_number: tf.Tensor, accumulated: dict) -> dict:
        """The second pass on micro-batch `index`: `accumulated` plus, per objective due, its
        unscaled float32 gradients from the forward again and a backward that starts at the
        outputs with the loss scale times `output_grads` (the whole batch's loss's gradient with
        respect to those outputs, [k, micro-batch, ...] per floating output)."""
        inputs = self.input_fn(micro_batch_at(micro_batches, index))
        with tf.GradientTape(persistent=len(self.objectives) > 1) as tape:
            leaves = floating_leaves(forward(self.model, self.policy, inputs, training=True))
        due = due_at(self.objectives, step_number)
        grads = {}
        for name, objective in self.objectives.items():
            partition = self.partitions[name]

            def gradients() -> Gradients:
                scale = objective.loss_scale.scale
                seeds = [g[index] * scale for g in output_grads[name]]
                return partition.from_backward(
                    tape.gradient(leaves, objective.variables, output_gradients=seeds), scale)

            grads[name] = when(due[name], gradients, partition.zeros)
        return self.accumulators.added(accumulated, grads, rounding_seed(step_number, index))


def _num_rows(batch: Any) -> Any:
    """The batch dimension of `batch`: an int where a leaf knows it statically (the first such),
    else the first leaf's as a tensor."""
    leaves = tf.nest.flatten(batch)
    static = next((leaf.shape[0] for leaf in leaves if leaf.shape.rank and leaf.shape[0] is not None),
                  None)
    return static if static is not None else tf.shape(leaves[0])[0]
