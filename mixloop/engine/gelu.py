"""GELU of 16-bit inputs: in float32, rounded once, its gradient recomputed from the input alone.

Keras 3 on TensorFlow computes `gelu` (`Dense(activation="gelu")`, keras-hub's Transformers) as
TensorFlow's chain of elementwise ops in the input's dtype, and TensorFlow differentiates each op.
Under a 16-bit policy that rounds every intermediate to 16 bits (in bfloat16 the tanh approximation
is 0 for every input below -3.06, where its true value is -0.003), and the forward pass keeps three
intermediates the size of the layer's output for the backward pass to read, where the input alone
would do. Here a bfloat16 or float16 tensor is widened to float32, its GELU rounded once to the
input's dtype, and the gradient recomputed from the input alone: the same function, nearer the
exact values, and under XLA less to write and read (docs/speed.md has the figures). Every other
input (float32, float64, ragged) gets Keras's own, bit for bit.

Keras looks its backend's `gelu` up at every call, so this one is its backend's only while
mixloop's own functions trace (engine/kernels.py), and Keras's is put back after: a user's own
model in the same process computes Keras's. A model exported to `.keras` names only "gelu": loaded
anywhere, it computes Keras's own. The backend's name is private to Keras: it lives in
`keras_adapter`, and tests/engine/test_keras_adapter.py fails loudly, naming it, if a Keras release
changes it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import keras
import tensorflow as tf

from mixloop.engine import keras_adapter

_SIXTEEN_BIT = (tf.bfloat16, tf.float16)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_CUBIC = 0.044715  # The tanh approximation's cubic coefficient (Hendrycks and Gimpel 2016).


def gelu(x: Any, approximate: bool = True) -> Any:
    """Keras's backend `gelu(x, approximate)`: for a bfloat16 or float16 tensor, `x * Phi(x)` (the
    tanh approximation with `approximate`) in float32, rounded once; Keras's own for the rest."""
    x = keras.ops.convert_to_tensor(x)
    if isinstance(x, tf.Tensor) and x.dtype in _SIXTEEN_BIT:
        return _tanh_gelu(x) if approximate else _erf_gelu(x)
    return tf.nn.gelu(x, approximate=approximate)  # What Keras's backend computes.


def _widened(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(x, tf.float32)


def _recomputed(x: tf.Tensor, upstream: tf.Tensor) -> tf.Tensor:
    """x widened again for the backward pass, once `upstream` exists. Widened without waiting,
    Grappler merges it and what follows with the forward pass's identical ops (`tf.recompute_grad`
    waits likewise), which kept two float32 tensors the size of the layer's output alive from the
    forward pass to the backward one."""
    with tf.control_dependencies([upstream]):
        return _widened(tf.identity(x))


@tf.custom_gradient
def _erf_gelu(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """x * Phi(x), Phi the normal CDF, from erfc (accurate far below zero, as TensorFlow's)."""
    wide = _widened(x)
    output = 0.5 * wide * tf.math.erfc(-wide * _SQRT_HALF)

    def gradient(upstream: tf.Tensor) -> tf.Tensor:
        wide = _recomputed(x, upstream)
        slope = (0.5 * tf.math.erfc(-wide * _SQRT_HALF)
                 + wide * tf.exp(-0.5 * wide * wide) * _INV_SQRT_2PI)
        return tf.cast(_widened(upstream) * slope, x.dtype)

    return tf.cast(output, x.dtype), gradient


@tf.custom_gradient
def _tanh_gelu(x: tf.Tensor) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """0.5 * x * (1 + tanh(z)), z = sqrt(2 / pi) * (x + 0.044715 * x^3), TensorFlow's approximation,
    as x * sigmoid(2 z): the same function, without 1 + tanh's cancellation far below zero."""
    wide = _widened(x)
    output = wide * tf.sigmoid(_tanh_argument(wide) * 2.0)

    def gradient(upstream: tf.Tensor) -> tf.Tensor:
        wide = _recomputed(x, upstream)
        half_plus_half_tanh = tf.sigmoid(_tanh_argument(wide) * 2.0)
        slope = half_plus_half_tanh + wide * half_plus_half_tanh * (1.0 - half_plus_half_tanh) * (
            2 * _SQRT_2_OVER_PI) * (1.0 + 3 * _CUBIC * wide * wide)
        return tf.cast(_widened(upstream) * slope, x.dtype)

    return tf.cast(output, x.dtype), gradient


def _tanh_argument(wide: tf.Tensor) -> tf.Tensor:
    return _SQRT_2_OVER_PI * (wide + _CUBIC * wide * wide * wide)


def install(function: Callable[[Any, bool], Any] = gelu) -> Callable[[Any, bool], Any]:
    """Makes `function` the GELU Keras's TensorFlow backend computes; returns the one it replaced
    (for `install(previous)` to put back)."""
    return keras_adapter.replace_backend_gelu(function)
