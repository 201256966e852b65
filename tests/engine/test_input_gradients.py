"""mixloop.input_gradients: a gradient penalty's inner gradient, exact in float32, differentiable again,
and in float16 within float16 rounding of float32 however it is scaled."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop


def critic_and_inputs(policy):
    keras.utils.set_random_seed(3)
    policy = mixloop.Policy.from_string(policy)
    critic = mixloop.build_model(lambda: keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)]), policy)
    inputs = tf.constant(np.random.default_rng(0).normal(size=(16, 8)), tf.float32)
    return (lambda x: mixloop.forward(critic, policy, x, training=True)), critic, inputs


def penalty_and_its_gradient(policy, scale=1.0):
    """The WGAN-GP penalty of a small critic and its gradient with respect to the critic's weights."""
    fn, critic, inputs = critic_and_inputs(policy)
    with tf.GradientTape() as tape:
        grads = mixloop.input_gradients(fn, inputs, scale=scale)
        penalty = tf.reduce_mean(tf.square(tf.norm(grads, axis=-1) - 1.0))
    outer = tape.gradient(penalty, critic.trainable_variables)
    # The last bias does not move the input gradient: no gradient, zeros here.
    return grads, penalty, [tf.zeros(v.shape) if g is None else g
                            for g, v in zip(outer, critic.trainable_variables)]


def test_the_inner_gradient_is_each_examples_own_and_float32():
    fn, critic, inputs = critic_and_inputs("float32")
    grads = mixloop.input_gradients(fn, inputs)
    assert grads.dtype == tf.float32 and grads.shape == inputs.shape
    for row in (0, 5):  # Each row: the gradient of that example's own output.
        with tf.GradientTape() as tape:
            x = inputs[row:row + 1]
            tape.watch(x)
            output = critic(x)
        np.testing.assert_allclose(grads[row], tape.gradient(output, x)[0], rtol=1e-5, atol=1e-7)


def test_the_penalty_is_differentiable_through_the_inner_backward():
    """The outer gradient (second order, through the inner backward) is the penalty's central
    difference, at the first-layer weight it moves most."""
    fn, critic, inputs = critic_and_inputs("float32")
    _, _, outer = penalty_and_its_gradient("float32")
    kernel = critic.trainable_variables[0]
    index = np.unravel_index(np.argmax(np.abs(outer[0])), kernel.shape)
    step = 1e-2

    def penalty_moved_by(delta):
        kernel.assign_add(delta * tf.scatter_nd([index], [1.0], kernel.shape))
        grads = mixloop.input_gradients(fn, inputs)
        penalty = float(tf.reduce_mean(tf.square(tf.norm(grads, axis=-1) - 1.0)))
        kernel.assign_add(-delta * tf.scatter_nd([index], [1.0], kernel.shape))
        return penalty

    difference = (penalty_moved_by(step) - penalty_moved_by(-step)) / (2 * step)
    assert float(outer[0][index]) == pytest.approx(difference, rel=1e-2)


@pytest.mark.parametrize("scale", [1.0, 1024.0])
def test_in_float16_the_penalty_and_its_gradient_match_float32_to_float16_rounding(scale):
    grads32, penalty32, outer32 = penalty_and_its_gradient("float32")
    grads16, penalty16, outer16 = penalty_and_its_gradient("mixed_float16", scale=scale)
    assert grads16.dtype == tf.float32
    np.testing.assert_allclose(grads16, grads32, rtol=0, atol=4e-3 * float(tf.reduce_max(tf.abs(grads32))))
    assert float(penalty16) == pytest.approx(float(penalty32), rel=1e-2)
    largest = max(float(tf.reduce_max(tf.abs(g))) for g in outer32)
    for g16, g32 in zip(outer16, outer32):
        np.testing.assert_allclose(g16, g32, rtol=0, atol=1e-2 * largest)
