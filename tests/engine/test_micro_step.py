"""One micro-batch (engine/micro_step.py): the forward half the step and the doctor share, and the
step's micro-step: scaled backward, unscaled float32 gradients, zeros for an objective not due."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.gradients import Partition
from mixloop.engine.loss import LossContractError
from mixloop.engine.micro_step import MicroStep, scaled_losses, weighted_sums, zero_sums
from mixloop.engine.objective import Objective
from mixloop.engine.policy import Policy


def model_and_batch():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="logits")(inputs))
    rng = np.random.default_rng(0)
    return model, (tf.constant(rng.normal(size=(4, 3)), tf.float32),
                   tf.constant(rng.normal(size=(4, 2)), tf.float32))


def token_loss(outputs, batch):
    """A (sum, weight) loss with a metric: the step scales its per-weight mean."""
    return mixloop.Loss(tf.reduce_sum(tf.square(outputs - batch[1])), 8.0,
                        {"mean_output": tf.reduce_mean(outputs)})


def test_scaled_losses_are_the_loss_per_weight_times_the_scale():
    model, batch = model_and_batch()
    losses, scaled = scaled_losses(model, Policy.from_string("float32"), lambda b: b[0], token_loss,
                                   batch, ["model"], {"model": tf.constant(1024.0)})
    assert float(scaled["model"]) == pytest.approx(float(losses["model"].value) / 8.0 * 1024.0)


@pytest.mark.parametrize("due", [None, True, False], ids=["every step", "due", "not due"])
def test_the_micro_step_gives_unscaled_weighted_gradients_and_zeros_when_not_due(due):
    model, batch = model_and_batch()
    every_steps = 1 if due is None else 2
    objectives = {"model": Objective(model, keras.optimizers.SGD(0.1),
                                     mixloop.StaticLossScale(256.0), every_steps=every_steps)}
    partitions = {"model": Partition(model.trainable_variables)}
    micro_step = MicroStep(model, Policy.from_string("float32"), token_loss, lambda b: b[0],
                           objectives, partitions)
    step_number = tf.constant(2 if due in (None, True) else 3, tf.int64)
    grads, sums = micro_step(batch, step_number)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.square(model(batch[0]) - batch[1]))
    expected = tape.gradient(loss, model.trainable_variables)  # The sum's gradient: mean x weight.
    for got, want in zip(grads["model"].derivatives, expected):
        np.testing.assert_allclose(got.numpy(), want.numpy() if due is not False else 0.0, rtol=1e-5)
    assert float(sums["model"]["weight"]) == 8.0
    assert float(sums["model"]["metrics"]["mean_output"]) == pytest.approx(
        8.0 * float(tf.reduce_mean(model(batch[0]))), rel=1e-5)


def test_metric_names_come_from_a_trace_and_a_bad_loss_is_one_error():
    model, _ = model_and_batch()
    spec = (tf.TensorSpec([4, 3]), tf.TensorSpec([4, 2]))
    objectives = {"model": Objective(model, keras.optimizers.SGD(0.1), mixloop.NoLossScale())}
    partitions = {"model": Partition(model.trainable_variables)}
    make = lambda loss_fn: MicroStep(model, Policy.from_string("float32"), loss_fn, lambda b: b[0],
                                     objectives, partitions)
    assert make(token_loss).metric_names(spec) == {"model": ["mean_output"]}
    with pytest.raises(LossContractError, match="shape"):
        make(lambda outputs, batch: tf.square(outputs - batch[1])).metric_names(spec)


def test_zero_sums_are_what_weighted_sums_of_nothing_are():
    zeros = zero_sums({"a": ["accuracy"]})
    assert {key: (float(value) if key != "metrics" else {k: float(v) for k, v in value.items()})
            for key, value in zeros["a"].items()} == {"loss": 0.0, "weight": 0.0,
                                                      "metrics": {"accuracy": 0.0}}
    sums = weighted_sums(mixloop.Loss(tf.constant(6.0), tf.constant(3.0), {"m": tf.constant(0.5)}))
    assert float(sums["metrics"]["m"]) == 1.5
