"""An objective's gradient as derivatives and new values apart (engine/gradients.py): split and merged
in the variables' order, zeros that add nothing, a backward pass unscaled and weighted, averaged,
checked and clipped."""

import numpy as np
import pytest
import tensorflow as tf

from mixloop.engine.gradients import (Gradients, Partition, averaged, clipped, finite_per_variable,
                                      times_weight)


def variables():
    """Four variables, the second and fourth overwritten with their "gradient" (as float8's scales)."""
    made = [tf.Variable(tf.zeros(shape), name=f"v{i}") for i, shape in enumerate([(2,), (), (3,), ()])]
    made[1].overwrite_with_gradient = True
    made[3].overwrite_with_gradient = True
    return made


def test_split_and_merged_keep_the_variables_order():
    partition = Partition(variables())
    assert partition.overwritten == [False, True, False, True]
    assert partition.derivative_positions == [0, 2]
    gradients = partition.split(["a", "b", "c", "d"])
    assert gradients == Gradients(["a", "c"], ["b", "d"])
    assert partition.merged(gradients) == ["a", "b", "c", "d"]


def test_zeros_add_nothing_to_a_sum_or_a_maximum():
    partition = Partition(variables())
    zeros = partition.zeros(tf.bfloat16)
    assert [z.dtype for z in zeros.derivatives] == [tf.bfloat16, tf.bfloat16]
    assert all(not np.any(z.numpy()) for z in zeros.derivatives)
    assert all(float(v) == np.finfo(np.float32).min for v in zeros.new_values)


def test_from_backward_unscales_and_weights_derivatives_only_and_notes_unreached_variables():
    partition = Partition(variables())
    scaled = [tf.constant([8.0, -4.0]), tf.constant(5.0), None, tf.constant(7.0)]
    gradients = partition.from_backward(scaled, tf.constant(4.0), tf.constant(3.0))
    np.testing.assert_array_equal(gradients.derivatives[0].numpy(), [6.0, -3.0])  # 8 / 4 * 3.
    np.testing.assert_array_equal(gradients.derivatives[1].numpy(), [0.0, 0.0, 0.0])  # Unreached.
    assert [float(v) for v in gradients.new_values] == [5.0, 7.0]  # Neither unscaled nor weighted.
    assert partition.unreached == [False, False, True, False]
    assert partition.reached(["a", "b", "c", "d"]) == ["a", "b", "d"]


def test_a_weight_of_one_leaves_the_tensor_as_it_is():
    value = tf.constant([1.0, 2.0])
    assert times_weight(value, tf.constant(1.0)) is value
    np.testing.assert_array_equal(times_weight(value, tf.constant(2.0)).numpy(), [2.0, 4.0])


def test_average_check_and_clip_act_on_derivatives_and_a_zero_weight_is_not_finite():
    partition = Partition(variables())
    summed = Gradients([tf.constant([6.0, 8.0]), tf.constant([0.0, 0.0, 0.0])],
                       [tf.constant(3.0), tf.constant(float("inf"))])
    mean = averaged(summed, tf.constant(2.0))
    np.testing.assert_array_equal(mean.derivatives[0].numpy(), [3.0, 4.0])
    assert mean.new_values == summed.new_values
    assert finite_per_variable(partition, mean).numpy().tolist() == [True, True, True, False]
    norm = tf.linalg.global_norm(mean.derivatives)
    assert float(norm) == 5.0
    np.testing.assert_allclose(clipped(mean, 1.0, norm).derivatives[0].numpy(), [0.6, 0.8], rtol=1e-6)
    assert clipped(mean, None, norm) is mean
    nan = averaged(summed, tf.constant(0.0))
    assert not finite_per_variable(partition, nan).numpy()[0]


@pytest.mark.parametrize("weight", [0.5, 3.0])
def test_weighted_scales_derivatives_not_new_values(weight):
    partition = Partition(variables())
    gradients = Gradients([tf.constant([2.0, 2.0]), tf.constant([1.0, 1.0, 1.0])],
                          [tf.constant(9.0), tf.constant(1.0)])
    weighted = partition.weighted(gradients, tf.constant(weight))
    np.testing.assert_array_equal(weighted.derivatives[0].numpy(), [2 * weight, 2 * weight])
    assert weighted.new_values == gradients.new_values
