"""The loss contract: a mean, a (sum, weight) pair, or a Loss with metrics, read as float32 scalars."""

import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.loss import LossContractError, as_loss
from mixloop.errors import UserError


def test_a_mean_is_a_sum_of_weight_one():
    loss = as_loss(tf.constant(2.5, tf.float16))
    assert (loss.value.dtype, float(loss.value), float(loss.weight), dict(loss.metrics)) == (
        tf.float32, 2.5, 1.0, {})


def test_a_pair_is_a_sum_and_its_weight():
    loss = as_loss((tf.constant(12.0), tf.constant(4, tf.int32)))
    assert (float(loss.value), float(loss.weight), loss.weight.dtype) == (12.0, 4.0, tf.float32)


def test_a_loss_carries_float32_metrics_in_name_order():
    loss = as_loss(mixloop.Loss(np.float64(6.0), 3, metrics={"b": tf.constant(0.5, tf.bfloat16),
                                                             "a": 1}))
    assert list(loss.metrics) == ["a", "b"]
    assert {name: (value.dtype, float(value)) for name, value in loss.metrics.items()} == {
        "a": (tf.float32, 1.0), "b": (tf.float32, 0.5)}


@pytest.mark.parametrize("output, what", [
    (tf.ones([4]), "the loss has shape (4,)"),
    ((tf.constant(1.0), tf.ones([2])), "its weight has shape (2,)"),
    (mixloop.Loss(1.0, metrics={"accuracy": tf.ones([3])}), "metric 'accuracy' has shape (3,)"),
])
def test_anything_but_scalars_is_a_one_line_user_error(output, what):
    with pytest.raises(LossContractError) as raised:
        as_loss(output)
    assert isinstance(raised.value, UserError) and isinstance(raised.value, TypeError)
    assert str(raised.value).endswith(what) and "\n" not in str(raised.value)
