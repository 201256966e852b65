"""What a loss function returns: a mean, a `(loss_sum, weight)` pair, or a `Loss` with train metrics."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

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
    if isinstance(output, Loss):
        loss = output
    elif isinstance(output, (tuple, list)) and len(output) == 2:
        loss = Loss(*output)
    else:
        loss = Loss(output)
    loss = Loss(_float32_scalar(loss.value, "the loss"), _float32_scalar(loss.weight, "its weight"),
                {name: _float32_scalar(value, f"metric {name!r}")
                 for name, value in sorted(loss.metrics.items())})
    return loss


def _float32_scalar(value: Any, what: str) -> tf.Tensor:
    tensor = tf.cast(value, tf.float32)
    if tensor.shape.rank != 0:
        raise LossContractError(
            f"compute_loss must return a scalar mean, (loss_sum, weight) or mixloop.Loss(value, "
            f"weight, metrics) of scalars; {what} has shape {tuple(tensor.shape)}")
    return tensor
