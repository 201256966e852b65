"""Keras's GELU of 16-bit inputs in float32, rounded once, its gradient from the input (engine/gelu.py)."""

import importlib
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from mixloop.engine import gelu, kernels

# One rounding to a 16-bit float: half its spacing, relative (7 and 10 stored mantissa bits).
ONE_ROUNDING = {tf.bfloat16: 2.0 ** -8, tf.float16: 2.0 ** -11}
_erfc = np.vectorize(math.erfc)


@pytest.fixture(autouse=True)
def mixloops_kernels():
    """Each test examines mixloop's GELU as mixloop's own traces see it: installed
    (engine/kernels.py; tests/test_kernels.py checks that nothing else does)."""
    with kernels.installed():
        yield


def _exact(x: np.ndarray, approximate: bool) -> tuple[np.ndarray, np.ndarray]:
    """GELU and its derivative at x, in float64."""
    if approximate:
        z = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
        s = 1 / (1 + np.exp(-2 * z))
        return x * s, s + x * s * (1 - s) * 2 * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x ** 2)
    cdf = 0.5 * _erfc(-x / math.sqrt(2))
    return x * cdf, cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _value_and_slope(function, x, mode="graph"):
    """GELU and its derivative at x as `function` computes them eagerly, traced, or under XLA, in
    float64; both in x's dtype."""
    def differentiate(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = function(x)
        return y, tape.gradient(y, x, output_gradients=tf.ones_like(x))
    if mode != "eager":
        differentiate = tf.function(differentiate, jit_compile=mode == "xla")
    results = differentiate(x)
    assert [t.dtype for t in results] == [x.dtype, x.dtype]
    return [tf.cast(t, tf.float64).numpy() for t in results]


def _worst_relative_error(got, want, dtype):
    """The largest relative error where the exact value is a normal number of `dtype`."""
    normal = (np.abs(want) >= np.finfo(dtype.as_numpy_dtype).tiny) & (np.abs(want) <= dtype.max)
    return np.max(np.abs(got[normal] - want[normal]) / np.abs(want[normal]))


def test_keras_computes_mixloops_gelu_in_every_path():
    x = tf.constant([[-3.5, -0.7, 0.2, 2.9]], tf.bfloat16)
    dense = keras.layers.Dense(4, activation="gelu", dtype="mixed_bfloat16")
    linear = keras.layers.Dense(4, dtype="mixed_bfloat16")
    linear.build(x.shape)
    dense.build(x.shape)
    linear.set_weights(dense.get_weights())
    np.testing.assert_array_equal(dense(x).numpy(), gelu.gelu(linear(x), False).numpy())
    for approximate in (True, False):
        ours = gelu.gelu(x, approximate).numpy()
        np.testing.assert_array_equal(keras.activations.gelu(x, approximate=approximate).numpy(), ours)
        np.testing.assert_array_equal(keras.ops.gelu(x, approximate=approximate).numpy(), ours)
        assert not np.array_equal(ours, tf.nn.gelu(x, approximate=approximate).numpy())


@pytest.mark.parametrize("approximate", [False, True], ids=["erf", "tanh"])
@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_16_bit_gelu_and_its_gradient_are_rounded_once(approximate, dtype, mode):
    # Below -10 the tanh approximation's float32 sigmoid is under float32's smallest normal number.
    x = tf.cast(tf.linspace(-10.0, 10.0, 20_001), dtype)
    exact_value, exact_slope = _exact(tf.cast(x, tf.float64).numpy(), approximate)
    ours = _value_and_slope(lambda x: gelu.gelu(x, approximate), x, mode)
    # One rounding, and float32's own error (a few parts in 1e7) on top.
    bound = ONE_ROUNDING[dtype] * (1 + 1e-4)
    assert _worst_relative_error(ours[0], exact_value, dtype) <= bound
    assert _worst_relative_error(ours[1], exact_slope, dtype) <= bound


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_wider_inputs_keep_kerass_gelu_bit_for_bit(dtype):
    """Keras's TensorFlow backend computes `tf.nn.gelu`: so do wider inputs, and ragged ones."""
    x = tf.cast(tf.linspace(-9.0, 9.0, 1001), dtype)
    for approximate in (False, True):
        ours = _value_and_slope(lambda x: keras.ops.gelu(x, approximate=approximate), x)
        tensorflows = _value_and_slope(lambda x: tf.nn.gelu(x, approximate=approximate), x)
        for a, b in zip(ours, tensorflows):
            np.testing.assert_array_equal(a, b)
    ragged = tf.ragged.constant([[-1.0, 2.0], [0.5]], dtype=dtype)
    np.testing.assert_array_equal(keras.ops.gelu(ragged).flat_values.numpy(),
                                  tf.nn.gelu(ragged.flat_values, approximate=True).numpy())


def test_a_reloaded_module_still_gives_wider_inputs_kerass_gelu():
    """A reload (IPython's autoreload) installs the new module's GELU, which holds no earlier one."""
    importlib.reload(gelu)
    gelu.install()
    x = tf.constant([-1.5, 0.5, 3.0])
    np.testing.assert_array_equal(keras.ops.gelu(x).numpy(), tf.nn.gelu(x, approximate=True).numpy())
    x16 = tf.cast(x, tf.bfloat16)
    np.testing.assert_array_equal(keras.ops.gelu(x16).numpy(), gelu.gelu(x16).numpy())


@pytest.mark.parametrize("approximate", [False, True], ids=["erf", "tanh"])
def test_second_derivative_through_the_recomputed_gradient(approximate):
    """A gradient penalty differentiates the gradient: it goes through the recomputation too."""
    x64 = np.linspace(-4.0, 4.0, 81)
    x = tf.constant(x64, tf.float64)

    @tf.function
    def curvature(x):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.cast(gelu.gelu(tf.cast(x, tf.bfloat16), approximate), tf.float64)
            slope = tf.cast(inner.gradient(y, x), tf.float64)
        return outer.gradient(slope, x)

    step = 1e-5
    numeric = (_exact(x64 + step, approximate)[1] - _exact(x64 - step, approximate)[1]) / (2 * step)
    # The bfloat16 input and the rounded slope: a few bfloat16 roundings of error.
    np.testing.assert_allclose(curvature(x).numpy(), numeric, rtol=0.03, atol=0.01)
