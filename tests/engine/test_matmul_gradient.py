"""A batch of inputs times one matrix is differentiated as one 2-D product (engine/matmul_gradient.py)."""

import importlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

from mixloop.engine import kernels, matmul_gradient


@pytest.fixture(autouse=True)
def mixloops_kernels():
    """Each test examines mixloop's gradient as mixloop's own traces see it: installed
    (engine/kernels.py; tests/test_kernels.py checks that nothing else does)."""
    with kernels.installed():
        yield


def _gradients(x, w, grad, *, adjoint_b=False, tensorflows=False, jit_compile=None):
    """(dx, dw) of `tf.matmul(x, w, adjoint_b=...)` for the output gradient `grad`, traced."""
    registry = ops._gradient_registry._registry["BatchMatMulV2"]
    if tensorflows:
        registry["type"] = matmul_gradient._TENSORFLOWS
    try:
        @tf.function(jit_compile=jit_compile)
        def differentiate(x, w):
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                out = tf.matmul(x, w, adjoint_b=adjoint_b)
            return tape.gradient(out, [x, w], output_gradients=grad)
        return differentiate(x, w)
    finally:
        matmul_gradient.install()


def _assert_same(ours, theirs):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)


def test_the_registered_gradient_is_mixloops():
    assert ops._gradient_registry.lookup("BatchMatMulV2") is matmul_gradient.batch_times_matrix_gradient


@pytest.mark.parametrize("adjoint_b", [False, True])
@pytest.mark.parametrize("batch_shape", [(3,), (2, 3)])
def test_it_is_tensorflows_gradient_in_float64(batch_shape, adjoint_b):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((*batch_shape, 5, 4)))
    w = tf.constant(rng.standard_normal((6, 4) if adjoint_b else (4, 6)))
    grad = tf.constant(rng.standard_normal((*batch_shape, 5, 6)))
    _assert_same(_gradients(x, w, grad, adjoint_b=adjoint_b),
                 _gradients(x, w, grad, adjoint_b=adjoint_b, tensorflows=True))


def test_a_batch_times_a_batch_keeps_tensorflows_gradient_after_a_reload():
    """Attention scores (3-D times 3-D) fall back to TensorFlow's gradient; a reloaded module
    (IPython's autoreload) does not take its own gradient for TensorFlow's and recurse."""
    importlib.reload(matmul_gradient)
    try:
        rng = np.random.default_rng(1)
        x, w = tf.constant(rng.standard_normal((3, 5, 4))), tf.constant(rng.standard_normal((3, 4, 6)))
        grad = tf.constant(rng.standard_normal((3, 5, 6)))
        _assert_same(_gradients(x, w, grad), _gradients(x, w, grad, tensorflows=True))
    finally:
        matmul_gradient.install()


def test_in_bfloat16_the_weights_gradient_is_nearer_the_exact_one():
    """TensorFlow's rounds each batch item's product to bfloat16 before summing them. Under XLA, as
    with oneDNN's kernels, one product is accumulated in float32 and rounded once."""
    rng = np.random.default_rng(0)
    x = tf.cast(rng.standard_normal((16, 32, 64)), tf.bfloat16)
    w = tf.cast(rng.standard_normal((64, 48)), tf.bfloat16)
    grad = tf.cast(rng.standard_normal((16, 32, 48)), tf.bfloat16)
    exact = np.einsum("bmk,bmn->kn", *(tf.cast(t, tf.float64).numpy() for t in (x, grad)))

    def error(dw):
        return np.linalg.norm(tf.cast(dw, tf.float64).numpy() - exact) / np.linalg.norm(exact)

    ours = error(_gradients(x, w, grad, jit_compile=True)[1])
    theirs = error(_gradients(x, w, grad, tensorflows=True, jit_compile=True)[1])
    assert ours < 0.8 * theirs
    assert ours < 2 ** -8  # One rounding to bfloat16's 8 significant bits.


def test_an_attention_layers_gradient_sums_no_batch_of_weight_gradients():
    """Keras's MultiHeadAttention projections: no Sum over a batch of (k, n) products is left."""
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    x = tf.random.normal((4, 6, 16))
    layer(x, x)

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x, x))
        return tape.gradient(loss, layer.trainable_variables)

    graph = gradients.get_concrete_function(x).graph
    summed = [op for op in graph.get_operations() if op.type == "Sum"
              and op.inputs[0].op.type == "BatchMatMulV2" and op.inputs[0].shape.rank == 3]
    assert not summed, [op.name for op in summed]
    assert all(np.all(np.isfinite(g.numpy())) for g in gradients(x))
