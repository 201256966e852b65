"""One micro-batch through the model in a policy: forward in the compute dtype, losses in float32,
each objective's loss scaled, differentiated by its own variables and unscaled into float32.

The train step runs it on every micro-batch; the precision doctor and probe run its forward half
(`scaled_losses`) under a tape of their own, so what they measure is what the step differentiates.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import keras
import tensorflow as tf

from mixloop.engine import tracing
from mixloop.engine.gradients import Gradients, Partition
from mixloop.engine.loss import Loss, LossContractError, as_losses, per_weight
from mixloop.engine.objective import Objective, due_at
from mixloop.engine.policy import Policy
from mixloop.errors import UserError, described

Batch = Any


def default_input_fn(batch: Batch) -> Any:
    """Keras's convention: a tuple `(inputs, targets, ...)` feeds its first element to the model."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def forward(model: keras.Model, policy: Policy, inputs: Any, *,
            training: Optional[bool] = None) -> Any:
    """The model on `inputs` in `policy`: floating inputs cast to the compute dtype, floating outputs
    to the output dtype (float32), which is what a loss reads. The step, eval, the doctor and the
    benchmark all run the model through here.

    Raises:
      TypeError: when `policy` is not a `Policy` (a string such as "mixed_float16"), `training` is
        not given as True or False, or `model` is not callable: one line, even from a traced loss.
    """
    _check_forward_arguments(model, policy, training)
    return policy.cast_to_output(model(policy.cast_to_compute(inputs), training=training))


def _check_forward_arguments(model: Any, policy: Any, training: Any) -> None:
    """Refuses what `forward` cannot run, in a line that names the argument and what to pass."""
    if not isinstance(policy, Policy):
        raise TypeError(f"mixloop.forward: policy={policy!r} is a {type(policy).__name__}, not a "
                        "mixloop.Policy; pass self.policy (the run's), or "
                        "mixloop.Policy.from_string(...)")
    if not isinstance(training, bool):
        raise TypeError(f"mixloop.forward: training={training!r}; pass training=True (dropout and "
                        "BatchNorm as in training, inside compute_loss) or training=False")
    if not callable(model):
        raise TypeError(f"mixloop.forward: model is a {type(model).__name__}, not a Keras model "
                        "or layer; pass the model to run (self.model, or a layer of it)")


def scaled_losses(model: keras.Model, policy: Policy, input_fn: Callable[[Batch], Any],
                  loss_fn: Callable[[Any, Batch], Any], micro_batch: Batch,
                  objective_names: Sequence[str], scales: Mapping[str, tf.Tensor]
                  ) -> tuple[dict[str, Loss], dict[str, tf.Tensor]]:
    """The forward half of a micro-step, to run under a tape: the losses of `micro_batch` (float32,
    one per objective) and, per objective in `scales`, its loss per weight times its scale.

    The scale multiplies the micro-batch's *mean* loss (sum / weight), so a token-weighted sum over
    thousands of tokens reaches the 16-bit backward with a mean's magnitudes; the weight goes back
    onto the gradients in float32 (`Partition.from_backward`), which keeps the accumulated update
    exactly token-weighted.
    """
    outputs = forward(model, policy, input_fn(micro_batch), training=True)
    losses = as_losses(loss_fn(outputs, micro_batch), objective_names)
    return losses, {name: per_weight(losses[name].value, tf.stop_gradient(losses[name].weight)) * scale
                    for name, scale in scales.items()}


class MicroStep:
    """The train step's micro-step over `objectives` (name -> `Objective`, each with a loss scale):
    called with a micro-batch and the number of the update it belongs to, it returns per objective
    its `Gradients` (those of an objective not due at that update: zeros, its backward not run) and
    its weighted sums (`weighted_sums`)."""

    def __init__(self, model: keras.Model, policy: Policy, loss_fn: Callable[[Any, Batch], Any],
                 input_fn: Callable[[Batch], Any], objectives: Mapping[str, Objective],
                 partitions: Mapping[str, Partition]):
        self.model, self.policy = model, policy
        self.loss_fn, self.input_fn = loss_fn, input_fn
        self.objectives, self.partitions = objectives, partitions

    def __call__(self, micro_batch: Batch, step_number: tf.Tensor
                 ) -> tuple[dict[str, Gradients], dict[str, Any]]:
        scales = {name: objective.loss_scale.scale for name, objective in self.objectives.items()}
        with tf.GradientTape(persistent=len(self.objectives) > 1) as tape:
            losses, scaled = scaled_losses(self.model, self.policy, self.input_fn, self.loss_fn,
                                           micro_batch, list(self.objectives), scales)
        due = due_at(self.objectives, step_number)
        grads = {}
        for name, objective in self.objectives.items():
            partition = self.partitions[name]

            def gradients():
                return partition.from_backward(tape.gradient(scaled[name], objective.variables),
                                               scales[name], losses[name].weight)

            grads[name] = when(due[name], gradients, partition.zeros)
        return grads, {name: weighted_sums(loss) for name, loss in losses.items()}

    def metric_names(self, loss_spec: Any) -> dict[str, list[str]]:
        """Per objective, the names of the metrics `loss_fn` returns beside its loss, from a trace
        (never run) of the forward pass and `loss_fn` on a batch of `loss_spec` (what the loss sees).

        Raises:
          LossContractError: when `loss_fn` returns what `as_losses` cannot read.
          UserError: when `loss_fn` fails on a batch whose batch dimension is unknown, naming the
            leaf of `loss_spec` without one.
        """
        names, errors = {}, []

        def forward_and_loss(batch):
            outputs = forward(self.model, self.policy, self.input_fn(batch), training=True)
            try:
                losses = as_losses(self.loss_fn(outputs, batch), self.objectives)
            except LossContractError as error:  # Raised after the trace, in one line.
                errors.append(error)
                return
            names.update({name: list(loss.metrics) for name, loss in losses.items()})

        try:
            tracing.function(forward_and_loss).get_concrete_function(loss_spec)
        except (TypeError, ValueError) as error:
            unknown = _unknown_batch_leaf(loss_spec)
            if unknown is None:
                raise
            raise UserError(
                f"compute_loss failed on a batch whose batch dimension is unknown ({unknown}): "
                f"{described(error)}; give every element of the train data a static batch "
                f"dimension (batch with drop_remainder=True; after a map, set_shape), or read "
                f"the batch size as tf.shape(x)[0]") from None
        if errors:
            raise errors[0]
        return names


def weighted_sums(loss: Loss) -> dict[str, Any]:
    """A micro-batch's loss, weight and metrics (times the weight): sums to add up over
    micro-batches and replicas, and to divide by the total weight at the end."""
    return {"loss": loss.value, "weight": loss.weight,
            "metrics": {name: value * loss.weight for name, value in loss.metrics.items()}}


def zero_sums(metric_names: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """Per objective, `weighted_sums` of nothing: where accumulated sums start."""
    return {name: weighted_sums(Loss(0.0, 0.0, {metric: 0.0 for metric in metrics}))
            for name, metrics in metric_names.items()}


def when(due: Optional[tf.Tensor], fn: Callable[[], Any], otherwise: Callable[[], Any]) -> Any:
    """`fn()` where an objective is `due` and `otherwise()` where not, in a graph conditional that
    runs only one of them; `fn()` itself for an objective due on every step (`due` None)."""
    return fn() if due is None else tf.cond(due, fn, otherwise)


def _unknown_batch_leaf(spec: Any) -> Optional[str]:
    """'element [1] of shape (None, 3)': the first leaf of `spec` whose batch dimension is
    unknown, or None when every leaf knows it."""
    for path, leaf in keras.tree.flatten_with_path(spec):
        if leaf.shape.rank and leaf.shape[0] is None:
            place = "".join(f"[{key!r}]" for key in path)
            return f"element {place} of shape {leaf.shape}" if place else f"shape {leaf.shape}"
    return None
