"""Storing in fewer bits (engine/low_bit.py): int8 round trips within the code book's bound, and
unbiased, reproducible stochastic rounding to bfloat16."""

import re

import numpy as np
import pytest
import tensorflow as tf

from mixloop.engine import low_bit

JIT = pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
BF16_ULP_AT_1 = 2.0**-7  # The gap between 1 and the next bfloat16.


def quantization_input(signed):
    """1000 values (not a multiple of 256): normal ones, an all-zero block, a block with one huge
    value among them; squared (never negative) for the unsigned book."""
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    x[256:512] = 0.0
    x[600] = 1e6
    return x if signed else np.square(x)


@JIT
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_int8_round_trip_is_the_nearest_code_within_half_the_gap_around_it(signed, jit_compile):
    x = quantization_input(signed)
    quantize = tf.function(lambda x: low_bit.quantize_blockwise(x, signed), jit_compile=jit_compile)
    dequantize = tf.function(lambda c, s: low_bit.dequantize_blockwise(c, s, [1000], signed),
                             jit_compile=jit_compile)
    codes, scales = quantize(tf.constant(x))
    restored = dequantize(codes, scales).numpy()
    assert codes.dtype == tf.uint8 and codes.shape == (4, 256) and scales.shape == (4,)
    padded = np.pad(x, (0, 24)).reshape(4, 256)
    np.testing.assert_array_equal(scales.numpy(), np.abs(padded).max(axis=1))
    assert scales[1] == 0.0 and np.all(restored[256:512] == 0.0)
    assert restored[600] == x[600] == scales[2]  # A block's maximum is code 1.0 times its scale: exact.

    book = low_bit.dynamic_code_book(signed)
    scale = np.repeat(scales.numpy(), 256)[:1000]
    normalized = np.divide(x, scale, out=np.zeros_like(x), where=scale > 0)
    nearest = np.abs(normalized[:, None] - book[None, :]).min(axis=1) * scale
    error = np.abs(restored - x)
    np.testing.assert_allclose(error, nearest, rtol=1e-5, atol=1e-6 * scale.max())
    # Half the largest gap between the code points around each value (its interval and the next ones).
    gaps = np.diff(book)
    below = np.clip(np.searchsorted(book, normalized) - 1, 0, len(gaps) - 1)
    around = np.maximum.reduce([gaps[np.clip(below + k, 0, len(gaps) - 1)] for k in (-1, 0, 1)])
    assert np.all(error <= around / 2 * scale * (1 + 1e-5))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_xla_quantizes_as_tensorflows_kernel_does_without_a_value_by_code_table(signed):
    """Under XLA the codes come from a binary search (XLA on a CPU compiles searchsorted into a
    table of every value against every code: 1 GB for a million values); it must agree with the
    kernel on every value, the midpoints between codes (ties) and the book's ends included."""
    book = low_bit.dynamic_code_book(signed)
    midpoints = (book[:-1] + book[1:]) / 2
    values = np.concatenate([book, midpoints, np.nextafter(midpoints, np.float32(2)),
                             np.random.default_rng(1).uniform(-1 if signed else 0, 1, 3000)])
    # Each block of 256: 255 of them and a 1.0, so that its scale is 1 and they are quantized as given.
    rows = np.pad(values, (0, -len(values) % 255)).reshape(-1, 255)
    x = np.concatenate([rows, np.ones((len(rows), 1))], axis=1).reshape(-1)
    x = tf.constant(x.astype(np.float32))

    def quantize(values):
        return low_bit.quantize_blockwise(values, signed)

    by_kernel = tf.function(quantize)(x)[0].numpy()
    by_xla = tf.function(quantize, jit_compile=True)
    np.testing.assert_array_equal(by_xla(x)[0].numpy(), by_kernel)
    hlo = by_xla.experimental_get_compiler_ir(x)(stage="optimized_hlo")
    largest = max(int(np.prod([int(d) for d in dims.split(",") if d]))
                  for dims in re.findall(r"\[([\d,]*)\]", hlo))
    assert largest <= 2 * x.shape[0]  # The values' size, not values x 255.


def test_the_dynamic_code_books_are_bitsandbytes_maps():
    signed, unsigned = low_bit.dynamic_code_book(True), low_bit.dynamic_code_book(False)
    for book in (signed, unsigned):
        assert book.shape == (256,) and np.all(np.diff(book) > 0) and book[-1] == 1.0
    assert signed[0] == pytest.approx(-(1 - 0.9 / 128)) and np.sum(signed == 0) == 1
    assert unsigned[0] == 0.0 and unsigned[1] == pytest.approx(1e-6 * (0.1 + 0.9 / 4))
    # Fine near zero: seven decades, the smallest nonzero magnitudes 5.5e-7 and 3.25e-7 of the block's
    # maximum; 1, 2, 4, 8 magnitudes in each of the four decades below 1e-3.
    assert np.min(np.abs(signed[signed != 0])) == pytest.approx(5.5e-7)
    assert np.sum(np.abs(signed) < 1e-3) == 2 * (1 + 2 + 4 + 8) + 1


# Traced once per compile mode and shape, the seed a tensor argument.
ROUND = {jit: tf.function(low_bit.stochastic_round_to_bfloat16, jit_compile=jit) for jit in (False, True)}


def rounded(x, seed, jit_compile=False):
    return ROUND[jit_compile](tf.constant(x, tf.float32), tf.constant(seed, tf.int32))


@JIT
def test_stochastic_rounding_is_unbiased(jit_compile):
    """Each value 30% (70%) of the way to its upper bfloat16 neighbour rounds up about that often, and
    10,000 roundings (100 steps' seeds x 100 copies) average to it."""
    values = np.array([1 + 0.3 * BF16_ULP_AT_1, -(3 + 0.7 * 2 * BF16_ULP_AT_1)], np.float32)
    draws = np.stack([rounded(np.repeat(values[:, None], 100, axis=1), [step, 7], jit_compile)
                      .numpy().astype(np.float32) for step in range(100)])
    np.testing.assert_allclose(draws.mean(axis=(0, 2)), values, rtol=1e-4)
    lower = np.array([1.0, -3.0], np.float32)
    assert set(np.unique(draws[:, 0])) == {1.0, 1.0 + BF16_ULP_AT_1}
    assert set(np.unique(draws[:, 1])) == {-3.0, -3.0 - 2 * BF16_ULP_AT_1}
    np.testing.assert_allclose((draws != lower[None, :, None]).mean(axis=(0, 2)), [0.3, 0.7], atol=0.02)


def test_stochastic_rounding_is_the_same_for_a_seed_in_both_compile_modes_and_differs_between_seeds():
    x = np.full([1000], 1 + 0.5 * BF16_ULP_AT_1, np.float32)
    first = rounded(x, [5, 1]).numpy()
    np.testing.assert_array_equal(rounded(x, [5, 1]).numpy(), first)
    np.testing.assert_array_equal(rounded(x, [5, 1], jit_compile=True).numpy(), first)
    assert np.mean(rounded(x, [6, 1]).numpy() != first) > 0.4  # Another step: other draws.
    assert np.mean(rounded(x, [5, 2]).numpy() != first) > 0.4  # Another variable: other draws.


@JIT
def test_stochastic_rounding_keeps_bfloat16_values_and_non_finite_ones_and_saturates(jit_compile):
    bfloat16_max, float32_max = float(tf.bfloat16.max), float(np.finfo(np.float32).max)
    exact = np.concatenate([np.random.default_rng(1).normal(size=100).astype(tf.bfloat16.as_numpy_dtype),
                            [0.0, -0.0, bfloat16_max, -bfloat16_max, 2.0**-126]]).astype(np.float32)
    for step in range(3):
        same = rounded(exact, [step, 0], jit_compile).numpy().astype(np.float32)
        np.testing.assert_array_equal(same, exact)
    special = rounded([np.inf, -np.inf, np.nan, float32_max, -float32_max], [0, 0], jit_compile)
    special = special.numpy().astype(np.float32)
    np.testing.assert_array_equal(special[:2], [np.inf, -np.inf])
    assert np.isnan(special[2])
    np.testing.assert_array_equal(special[3:], [bfloat16_max, -bfloat16_max])
