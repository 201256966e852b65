"""What a loss function returns: a mean, a `(loss_sum, weight)` pair, or a `Loss` with train metrics."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence, Union

import tensorflow as tf

from mixloop.errors import UserError


class LossContractError(UserError, TypeError):
    """A loss function returned something other than the forms `as_loss` reads."""


@dataclasses.dataclass(frozen=True)
class Loss:
    """One micro-batch's loss, what it is summed over, and metrics to report beside it.

    Attributes:
      value: the loss summed over `weight` units (tokens, examples); with the default weight of 1,
        simply a mean. The update is normalized by the total weight over micro-batches and replicas.
      weight: how many units `value` sums over (e.g. the number of unpadded tokens).
      metrics: name -> scalar, the micro-batch's mean per unit of weight (e.g. token accuracy).
        Each is averaged by weight over micro-batches, replicas and the logging interval, written to
        TensorBoard beside the train loss and shown on the progress line; eval reports them too.
    """

    value: Any
    weight: Any = 1.0
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)


LossOutput = Union[tf.Tensor, tuple, Loss]


def as_loss(output: LossOutput) -> Loss:
    """Reads a loss function's result as a float32 `Loss`: a mean is a sum of weight 1, a pair is
    `(loss_sum, weight)`.

    Raises:
      LossContractError: for a value, weight or metric that is not a scalar (a per-example loss
        vector), naming which and the accepted forms.
    """
    if isinstance(output, Mapping):
        raise LossContractError(
            f"compute_loss returned a dict (keys {sorted(output)}); a dict is for several objectives "
            f"(Trainer.build_objectives). With one, return a scalar mean, (loss_sum, weight) or "
            f"mixloop.Loss(value, metrics={{...}}) to report metrics beside the loss")
    if isinstance(output, Loss):
        loss = output
    elif isinstance(output, (tuple, list)) and len(output) == 2:
        loss = Loss(*output)
    else:
        loss = Loss(output)
    if not isinstance(loss.metrics, Mapping):
        raise LossContractError(f"mixloop.Loss metrics must be a dict of name -> scalar, got "
                                f"{type(loss.metrics).__name__}")
    loss = Loss(_float32_scalar(loss.value, "the loss"), _float32_scalar(loss.weight, "its weight"),
                {name: _float32_scalar(value, f"metric {name!r}")
                 for name, value in sorted(loss.metrics.items())})
    return loss


def as_losses(output: Any, objective_names: Sequence[str]) -> dict[str, Loss]:
    """Reads a loss function's result as one `Loss` per objective: any form of `as_loss` for a single
    objective; for several, a dict of such forms keyed by exactly the objective names.

    Raises:
      LossContractError: for a form `as_loss` cannot read, a dict whose keys are not the objective
        names, or a metric name that two objectives both report.
    """
    names = list(objective_names)
    if len(names) == 1:
        return {names[0]: as_loss(output)}
    if not isinstance(output, Mapping) or sorted(output) != sorted(names):
        got = sorted(output) if isinstance(output, Mapping) else type(output).__name__
        raise LossContractError(f"with several objectives compute_loss must return a dict with one "
                                f"loss per objective, keys {sorted(names)}; got {got}")
    losses = {name: as_loss(output[name]) for name in names}
    metric_names = [metric for loss in losses.values() for metric in loss.metrics]
    shared = sorted({metric for metric in metric_names if metric_names.count(metric) > 1})
    if shared:
        raise LossContractError(f"two objectives report the metric(s) {shared}; a train metric name "
                                f"must be unique over the objectives")
    return losses


def per_weight(value: tf.Tensor, weight: tf.Tensor) -> tf.Tensor:
    """`value / weight` (0 for a weight of 0); `value` itself for the weight 1 of a plain mean loss.

    The loss scale multiplies a micro-batch's loss per weight (its mean), whatever the loss's form.
    """
    return value if tf.get_static_value(weight) == 1.0 else tf.math.divide_no_nan(value, weight)


def _float32_scalar(value: Any, what: str) -> tf.Tensor:
    try:
        tensor = tf.cast(value, tf.float32)
    except (TypeError, ValueError):
        raise LossContractError(
            f"compute_loss must return a scalar mean, (loss_sum, weight) or mixloop.Loss(value, "
            f"weight, metrics) of scalars; {what} is a {type(value).__name__}") from None
    if tensor.shape.rank != 0:
        raise LossContractError(
            f"compute_loss must return a scalar mean, (loss_sum, weight) or mixloop.Loss(value, "
            f"weight, metrics) of scalars; {what} has shape {tuple(tensor.shape)}")
    return tensor
