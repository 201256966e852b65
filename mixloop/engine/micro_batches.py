"""The step's default gradient source: a replica's batch split into micro-batches, taken one at a time,
each micro-step's gradients and sums added to accumulators (gradient accumulation).

A gradient source is called in replica context with the replica's batch and the number of the update
it is for, and returns per objective its accumulated `Gradients` (float32) and weighted sums, before
any communication; `loss_batch_spec` says what the loss sees of a global batch. The other source is
GradCache's two passes (engine/batch_loss.py).
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from mixloop.engine.accumulators import Accumulators, rounding_seed
from mixloop.engine.gradients import as_float32
from mixloop.engine.micro_step import MicroStep, zero_sums

Batch = Any
# How a source's loop body is compiled: as it is, or (under XLA with several micro-batches) as a
# function of its own that XLA compiles (`TrainStep`'s compile modes).
BodyCompiler = Callable[[Callable[..., Any]], Callable[..., Any]]


def split_micro_batches(batch: Batch, num_micro_batches: int) -> Batch:
    """Reshapes every tensor of `batch` from [B, ...] to [k, B/k, ...] (no copy).

    Raises:
      ValueError: when a static batch dimension is not divisible by `num_micro_batches`.
    """

    def split(tensor):
        size = tensor.shape[0]
        if size is not None and size % num_micro_batches:
            raise ValueError(
                f"batch dimension {size} is not divisible by accumulation_steps={num_micro_batches}"
            )
        micro_size = -1 if size is None else size // num_micro_batches
        return tf.reshape(tensor, tf.concat([[num_micro_batches, micro_size], tf.shape(tensor)[1:]], 0))

    return tf.nest.map_structure(split, batch)


def micro_batch_at(micro_batches: Batch, index: Any) -> Batch:
    """Micro-batch `index` of what `split_micro_batches` made."""
    return tf.nest.map_structure(lambda t: t[index], micro_batches)


def micro_batch_loop(num_micro_batches: int, body: Callable[[tf.Tensor, Any], Any], initial: Any,
                     start: Any = 0) -> Any:
    """`initial` carried through `body(i, carried)` for micro-batches i = start .. k-1, one at a
    time: a while loop runs up to 10 iterations at once by default, which would keep that many
    micro-batches' activations alive (docs/memory.md). `start` may be a tensor, to make the loop
    wait for what computed it."""
    _, carried = tf.while_loop(lambda i, _: i < num_micro_batches,
                               lambda i, carried: (i + 1, body(i, carried)),
                               (tf.convert_to_tensor(start), initial), parallel_iterations=1)
    return carried


def in_micro_batches(fn: Callable[[Batch], Any], batch: Batch, num_micro_batches: int) -> Any:
    """`fn(batch)` computed one micro-batch at a time (so one micro-batch's activations are alive
    at once), its outputs concatenated along the batch: what `fn(batch)` returns for a `fn` that
    treats examples independently (a model's forward at inference). `fn(batch)` itself when the
    batch's static size does not split into `num_micro_batches`, a part of the batch or of the
    outputs is not a dense tensor, or the outputs' shapes are not the whole batch's outputs' cut
    along the batch (an output that couples examples, such as a [B, B] similarity)."""
    size = _static_batch_size(batch)
    if num_micro_batches == 1 or size is None or size % num_micro_batches:
        return fn(batch)
    parts = split_micro_batches(batch, num_micro_batches)
    first = fn(micro_batch_at(parts, 0))
    whole = _output_shapes(fn, batch)
    if whole is None or _static_batch_size(first) != size // num_micro_batches or whole != [
            [size, *t.shape[1:]] for t in tf.nest.flatten(first)]:
        return fn(batch)
    arrays = tf.nest.map_structure(
        lambda t: tf.TensorArray(t.dtype, size=num_micro_batches, element_shape=t.shape).write(0, t),
        first)
    with tf.control_dependencies(tf.nest.flatten(first)):  # The rest after the first, not beside it.
        start = tf.identity(1)
    arrays = micro_batch_loop(
        num_micro_batches,
        lambda i, written: tf.nest.map_structure(lambda array, t: array.write(i, t), written,
                                                 fn(micro_batch_at(parts, i))),
        arrays, start=start)
    return tf.nest.map_structure(
        lambda array, t: tf.ensure_shape(array.concat(), [size, *t.shape[1:]]), arrays, first)


def _output_shapes(fn: Callable[[Batch], Any], batch: Batch) -> Any:
    """The shapes (as lists) of `fn(batch)`'s outputs, from a trace of its own (nothing of it
    runs or joins the caller's graph); None for an output that is not a dense tensor."""
    outputs = tf.function(fn, autograph=False).get_concrete_function(
        tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), batch)).structured_outputs
    leaves = tf.nest.flatten(outputs)
    if not all(isinstance(t, tf.Tensor) for t in leaves):
        return None
    return [t.shape.as_list() for t in leaves]


def _static_batch_size(structure: Any) -> Any:
    """The batch (first) dimension every leaf of `structure` shares statically, else None (a
    leaf that is not a dense tensor: ragged, sparse, None)."""
    leaves = tf.nest.flatten(structure)
    if not leaves or not all(isinstance(t, tf.Tensor) for t in leaves):
        return None
    sizes = {t.shape[0] if t.shape.rank else None for t in leaves}
    return sizes.pop() if len(sizes) == 1 else None


def batch_divided(spec: tf.TensorSpec, num_slices: int) -> tf.TensorSpec:
    """`spec` with its batch (first) dimension divided by `num_slices`: unknown where it is
    unknown or does not divide; a scalar's as it is."""
    if not spec.shape.rank:
        return spec
    size = spec.shape[0]
    sliced = size // num_slices if size is not None and size % num_slices == 0 else None
    return tf.TensorSpec([sliced, *spec.shape[1:]], spec.dtype)


class MicroBatches:
    """Gradient accumulation over `num_micro_batches` micro-batches of `micro_step`, added up in
    `accumulators`; `metric_names(spec)` gives the train metrics' names (for the sums' zeros), and
    `compile_body` compiles the loop's body."""

    def __init__(self, micro_step: MicroStep, num_micro_batches: int, accumulators: Accumulators,
                 metric_names: Callable[[Any], dict[str, list[str]]], num_replicas: int,
                 compile_body: BodyCompiler = lambda body: body):
        self.micro_step = micro_step
        self.num_micro_batches = num_micro_batches
        self.accumulators = accumulators
        self.metric_names = metric_names
        self.num_replicas = num_replicas
        self._add_micro_batch = compile_body(self._added_micro_batch)
        self.bodies = [self._add_micro_batch]  # The loop's bodies, as compiled.

    def loss_batch_spec(self, batch_spec: Any) -> Any:
        """What the loss sees of global batches of `batch_spec`: one micro-batch of one replica,
        whose batch dimension is the global one divided by replicas x micro-batches."""
        num_slices = self.num_replicas * self.num_micro_batches
        return tf.nest.map_structure(lambda spec: batch_divided(spec, num_slices), batch_spec)

    def __call__(self, batch: Batch, step_number: tf.Tensor) -> tuple[dict, dict[str, Any]]:
        """Each objective's unscaled float32 gradients and weighted sums, summed over the
        micro-batches of this replica's `batch`."""
        if self.num_micro_batches == 1:
            return self.micro_step(batch, step_number)
        micro_batches = split_micro_batches(batch, self.num_micro_batches)
        names = self.metric_names(tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape[1:], t.dtype), micro_batches))
        grads, sums = micro_batch_loop(
            self.num_micro_batches,
            lambda i, accumulated: self._add_micro_batch(micro_batches, i, step_number, accumulated),
            (self.accumulators.zeros(), zero_sums(names)))
        return as_float32(grads), sums

    def _added_micro_batch(self, micro_batches: Batch, index: tf.Tensor, step_number: tf.Tensor,
                           accumulated: tuple) -> tuple:
        """`accumulated` (gradients and sums) plus those of micro-batch `index`."""
        grads, sums = self.micro_step(micro_batch_at(micro_batches, index), step_number)
        return (self.accumulators.added(accumulated[0], grads, rounding_seed(step_number, index)),
                tf.nest.map_structure(tf.add, accumulated[1], sums))
