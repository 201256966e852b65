"""Storing float32 values in fewer bits: bfloat16 by stochastic rounding, and 8 bits a value by
block-wise dynamic quantization (what low-precision optimizer state and bfloat16 master weights are).

Stochastic rounding to bfloat16. A bfloat16 is the top 16 bits of a float32. Adding a uniform random
integer in [0, 2**16) to a float32's bit pattern and dropping the low 16 bits rounds its magnitude up
with probability (low 16 bits) / 2**16 and down otherwise, so the expected result is the value
itself: many updates too small for one bfloat16 step add up in expectation, where round-to-nearest
loses every one of them. The draws come from a counter-based generator (Philox) keyed by a seed, so
a seed rounds the same way in graph mode, under XLA and in a resumed run.

Block-wise dynamic quantization (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
Quantization"; how bitsandbytes and torchao store Adam's moments):

    flatten x; pad with zeros to a multiple of 256; split into blocks of 256 values
    scale[b]   = max |x| over block b                               (float32)
    code[b, i] = index of the code-book value nearest x[b, i] / scale[b]   (uint8)
    x[b, i]   ~= code_book[code[b, i]] * scale[b]

The code book is bitsandbytes' dynamic map: its values are spread over seven decades below 1, the
most of them in the top decade, so a value small against its block's largest keeps a few relative
digits where a linear map would flush it to zero. The signed book (for Adam's first moment) spends
one bit on the sign; the unsigned one (for the second moment, never negative) spends it on precision.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

BLOCK_SIZE = 256  # Values sharing one float32 scale.
_NUM_DECADES = 7  # The dynamic code book's decades: [1e-7, 1e-6), ..., [0.1, 1).
_LOW_16_BITS_CLEARED = -(1 << 16)  # 0xFFFF0000 as an int32.
_BFLOAT16_MAX = float(tf.bfloat16.max)


def stochastic_round_to_bfloat16(x: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """`x` (float32) rounded to a neighbouring bfloat16 at random, up with a probability equal to the
    distance to the lower neighbour over the gap: the expected result is `x`.

    `seed` is an int32 (or int64) tensor of shape [2]; the same seed gives the same rounding.
    Values already in bfloat16 are unchanged; inf and NaN are kept; a finite value saturates at
    the largest finite bfloat16 instead of rounding up to inf.
    """
    x = tf.convert_to_tensor(x, tf.float32)
    # Philox named, not auto-selected: the same draws on every device and in both compile modes.
    noise = tf.random.stateless_uniform(tf.shape(x), seed, minval=0, maxval=1 << 16, dtype=tf.int32,
                                        alg="philox")
    bits = tf.bitwise.bitwise_and(tf.bitcast(x, tf.int32) + noise, _LOW_16_BITS_CLEARED)
    rounded = tf.clip_by_value(tf.bitcast(bits, tf.float32), -_BFLOAT16_MAX, _BFLOAT16_MAX)
    # The low bits now being zero, the cast is exact.
    return tf.cast(tf.where(tf.math.is_finite(x), rounded, x), tf.bfloat16)


def dynamic_code_book(signed: bool) -> np.ndarray:
    """The 256 values (float32, ascending, in [-1, 1] or [0, 1]) codes index: bitsandbytes'
    `create_dynamic_map(signed)`. Decade k of seven (values in [10**(k-7), 10**(k-6))) holds the
    midpoints of 2**k equal steps from 0.1 to 1 times 10**(k-6), twice as many if unsigned; with
    0 and 1 that makes 254 + 2 values (the signed book mirrors its 127 magnitudes and has no -1)."""
    magnitudes = []
    for decade in range(_NUM_DECADES):
        bounds = np.linspace(0.1, 1.0, 2 ** (decade + (0 if signed else 1)) + 1)
        magnitudes.extend(10.0 ** (decade - _NUM_DECADES + 1) * (bounds[:-1] + bounds[1:]) / 2)
    values = magnitudes + ([-m for m in magnitudes] if signed else []) + [0.0, 1.0]
    return np.sort(np.array(values, np.float32))


def num_blocks(num_values: int) -> int:
    """How many blocks of `BLOCK_SIZE` hold `num_values` values (the last one padded)."""
    return -(-num_values // BLOCK_SIZE)


def quantize_blockwise(x: tf.Tensor, signed: bool) -> tuple[tf.Tensor, tf.Tensor]:
    """`x` (any float dtype, a fully known shape) as `(codes, scales)`: uint8 indices into
    `dynamic_code_book(signed)` of shape [num_blocks, BLOCK_SIZE], and the float32 absolute maximum
    of each block, shape [num_blocks]. An all-zero block has scale 0 and decodes to zeros."""
    flat = tf.reshape(tf.cast(x, tf.float32), [-1])
    size = flat.shape[0]
    blocks = tf.reshape(tf.pad(flat, [[0, num_blocks(size) * BLOCK_SIZE - size]]), [-1, BLOCK_SIZE])
    scales = tf.reduce_max(tf.abs(blocks), axis=1)
    normalized = tf.math.divide_no_nan(blocks, scales[:, None])
    book = dynamic_code_book(signed)
    # The nearest code is the number of midpoints between neighbouring codes below the value.
    codes = _count_below(tf.constant((book[:-1] + book[1:]) / 2), normalized)
    return tf.cast(codes, tf.uint8), scales


def _count_below(ascending: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """How many of the 255 `ascending` values are below each of `values` (int32, `values`' shape).

    `tf.searchsorted` where TensorFlow's kernel runs it; under XLA, which on a CPU compiles it into
    a comparison of every value with every entry (a tensor of 255 times the values), a binary
    search of eight gathers: the same codes, faster and lighter.
    """
    if not control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        flat = tf.searchsorted(ascending[None, :], tf.reshape(values, [1, -1]))
        return tf.reshape(flat, tf.shape(values))
    count = tf.zeros_like(values, tf.int32)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):  # The count's bits, highest first.
        higher = count + step
        count = tf.where(tf.gather(ascending, higher - 1) < values, higher, count)
    return count


def dequantize_blockwise(codes: tf.Tensor, scales: tf.Tensor, shape: Sequence[int],
                         signed: bool) -> tf.Tensor:
    """The float32 tensor of `shape` that `quantize_blockwise(x, signed)` returned `codes` and
    `scales` for: each code's book value times its block's scale, the padding dropped."""
    values = tf.gather(tf.constant(dynamic_code_book(signed)), tf.cast(codes, tf.int32))
    flat = tf.reshape(values * scales[:, None], [-1])
    return tf.reshape(flat[:int(np.prod(shape))], shape)
