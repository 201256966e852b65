"""Accumulators (engine/accumulators.py): float32 sums exactly, bfloat16 rounds each sum stochastically
with draws of its own per variable and micro-batch, new values combine by maximum."""

import numpy as np
import tensorflow as tf

from mixloop.engine.accumulators import Accumulators, rounding_seed
from mixloop.engine.gradients import Gradients, Partition


def partitions():
    kernel, scale = tf.Variable(tf.zeros([4096])), tf.Variable(0.0)
    scale.overwrite_with_gradient = True
    bias = tf.Variable(tf.zeros([4096]))
    return {"model": Partition([kernel, scale, bias])}


def test_float32_accumulators_add_exactly_and_take_the_maximum_of_new_values():
    accumulators = Accumulators(partitions())
    total = accumulators.zeros()
    for i, new_value in enumerate([2.0, float("nan"), 1.0]):
        grads = {"model": Gradients([tf.fill([4096], 0.25 * (i + 1)), tf.fill([4096], 1.0)],
                                    [tf.constant(new_value)])}
        total = accumulators.added(total, grads, rounding_seed(tf.constant(7), tf.constant(i)))
    np.testing.assert_array_equal(total["model"].derivatives[0].numpy(), np.full(4096, 1.5, np.float32))
    assert np.isnan(total["model"].new_values[0].numpy())  # A NaN new value is kept, not dropped.


def test_bfloat16_accumulators_keep_small_additions_in_expectation_with_draws_per_variable():
    """1 + 2**-12 is below half of bfloat16's spacing at 1 (2**-8): rounding to nearest would keep
    1 every time, stochastic rounding keeps the sum's expectation; the two variables draw apart."""
    accumulators = Accumulators(partitions(), tf.bfloat16)
    start = accumulators.zeros()
    start = {"model": Gradients([tf.ones([4096], tf.bfloat16), tf.ones([4096], tf.bfloat16)],
                                start["model"].new_values)}
    small = {"model": Gradients([tf.fill([4096], 2.0**-12)] * 2, [tf.constant(0.0)])}
    total = accumulators.added(start, small, rounding_seed(tf.constant(3), tf.constant(1)))
    first, second = (tf.cast(d, tf.float32).numpy() for d in total["model"].derivatives)
    assert total["model"].derivatives[0].dtype == tf.bfloat16
    assert set(np.unique(first)) <= {1.0, 1.0 + 2.0**-7}  # Rounded to a neighbour each time.
    assert abs(first.mean() - (1 + 2.0**-12)) < 2.0**-13  # About 4.5 standard errors.
    assert not np.array_equal(first, second)  # Each variable its own draws.
    again = accumulators.added(start, small, rounding_seed(tf.constant(3), tf.constant(1)))
    np.testing.assert_array_equal(tf.cast(again["model"].derivatives[0], tf.float32).numpy(), first)


def test_the_rounding_seed_is_the_update_and_the_micro_batch_apart():
    assert rounding_seed(tf.constant(5, tf.int64), tf.constant(2)).numpy().tolist() == [5, 2 << 16]
