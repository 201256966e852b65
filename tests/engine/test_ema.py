"""The moving average of the master weights (engine/ema.py): the formula, started at the weights,
float32 for bfloat16 weights, swapped in and back out."""

import keras
import numpy as np
import pytest

from mixloop.engine.ema import ExponentialMovingAverage


def test_the_average_follows_its_formula_from_the_initial_weights():
    weight = keras.Variable([0.0, 10.0])
    average = ExponentialMovingAverage([weight], 0.9)
    expected = np.array([0.0, 10.0], np.float32)
    for value in ([1.0, 0.0], [2.0, -10.0]):
        weight.assign(value)
        average.update()
        expected = np.float32(0.9) * expected + np.float32(0.1) * np.array(value, np.float32)
    np.testing.assert_array_equal(average.averages[0].numpy(), expected)


def test_the_average_of_bfloat16_weights_is_float32_and_keeps_moves_below_their_spacing():
    weight = keras.Variable([1.0], dtype="bfloat16")
    average = ExponentialMovingAverage([weight], 0.999)
    weight.assign([1.0078125])  # One bfloat16 step above 1.
    for _ in range(3):
        average.update()
    assert average.averages[0].dtype == "float32"
    assert 1.0 < float(average.averages[0].numpy()[0]) < 1.0001  # Three thousandths of a step.


def test_swapped_in_puts_the_trained_weights_back_even_on_an_error():
    weight = keras.Variable([3.0])
    average = ExponentialMovingAverage([weight], 0.5)
    weight.assign([5.0])
    average.update()
    with pytest.raises(RuntimeError):
        with average.swapped_in():
            assert weight.numpy().tolist() == [4.0]
            raise RuntimeError("an eval that fails")
    assert weight.numpy().tolist() == [5.0]
    with pytest.raises(ValueError, match=r"the EMA decay must be in \[0, 1\)"):
        ExponentialMovingAverage([weight], 1.0)
