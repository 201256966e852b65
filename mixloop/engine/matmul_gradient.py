"""The gradient of a batch of inputs times one weight matrix: one 2-D matrix product, not a product
per batch item summed.

Keras 3 on TensorFlow computes an `EinsumDense` of static shapes (every `MultiHeadAttention`
projection of a fixed sequence length, keras-hub's Transformers) as `tf.matmul(x, w)`: one
`BatchMatMulV2` with x of shape (batch..., m, k) and w of (k, n), broadcast over the batch.
TensorFlow differentiates it as it does any broadcast: w's gradient is a (k, n) product per batch
item, each of inner size m only, then summed over the batch. That costs the batch size times w's
memory and, under a 16-bit policy, rounds each item's product to 16 bits before the sum. Here the
inputs and the output gradient are flattened to (batch * m, k) and (batch * m, n) and multiplied
once: the same gradient, faster (charlm at width 512; CHANGELOG.md), and nearer the exact one (with
oneDNN's kernels or XLA, accumulated in float32 and rounded once). Every other case keeps
TensorFlow's gradient.

TensorFlow's GradientTape looks a gradient up by the op's type when it differentiates, so this one
is registered for `BatchMatMulV2` only while mixloop's own functions trace (engine/kernels.py), and
TensorFlow's is put back after: a user's own computation in the same process keeps TensorFlow's.
`_gradient_registry` is private to TensorFlow: if it changes, TensorFlow's gradient stays (with a
warning) and tests/engine/test_matmul_gradient.py fails loudly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import tensorflow as tf
from absl import logging
from tensorflow.python.framework import ops
from tensorflow.python.ops import math_grad

_OP_TYPE = "BatchMatMulV2"
# TensorFlow's own, named rather than looked up: a reload of this module must not take ours for it.
_TENSORFLOWS = math_grad._BatchMatMulV2


def batch_times_matrix_gradient(op: tf.Operation, grad: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The gradients of `BatchMatMulV2(x, w)` for x of rank 3 or more and w a matrix, with w's as
    one 2-D product; TensorFlow's own for any other shapes or an adjoint x."""
    x, w = op.inputs
    if op.get_attr("adj_x") or w.shape.rank != 2 or x.shape.rank is None or x.shape.rank <= 2:
        return _TENSORFLOWS(op, grad)
    flat_x = tf.reshape(x, [-1, tf.shape(x)[-1]])
    flat_grad = tf.reshape(grad, [-1, tf.shape(grad)[-1]])
    if op.get_attr("adj_y"):  # x @ w^H with w of shape (n, k).
        return (tf.linalg.matmul(grad, w, grad_a=True),
                tf.linalg.matmul(flat_grad, flat_x, adjoint_a=True, grad_b=True))
    return (tf.linalg.matmul(grad, w, adjoint_b=True, grad_a=True),
            tf.linalg.matmul(flat_x, flat_grad, adjoint_a=True, grad_b=True))


def install(gradient: Callable[..., Any] = batch_times_matrix_gradient) -> Optional[Callable[..., Any]]:
    """Makes `gradient` the one every tape takes for `BatchMatMulV2`; returns the one it replaced
    (for `install(previous)` to put back), or None when the registry changed and nothing moved."""
    try:
        entry = ops._gradient_registry._registry[_OP_TYPE]
        previous, entry["type"] = entry["type"], gradient
        return previous
    except (AttributeError, KeyError, TypeError) as error:
        logging.warning("Kept TensorFlow's gradient for %s: its gradient registry changed (%r)",
                        _OP_TYPE, error)
        return None
