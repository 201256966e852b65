"""The one line an error becomes (mixloop/errors.py): a TensorFlow op error's own words, and where in
the experiment's code an exception was raised."""

import numpy as np
import pytest
import tensorflow as tf

from mixloop import errors


def op_error(fn):
    with pytest.raises(tf.errors.OpError) as raised:
        fn()
    return raised.value


def test_an_op_error_is_its_last_meaningful_line_and_names_an_index_out_of_range():
    error = op_error(lambda: tf.gather(tf.zeros([3]), tf.constant([5])).numpy())
    summary = errors.op_error_summary(error)
    assert "5" in summary and summary.endswith(
        "(an integer input, such as a label, outside its valid range)")
    assert "\n" not in summary and "Traceback" not in summary


def test_a_data_pipeline_exception_is_its_python_line():
    def broken(x):
        raise ValueError(f"bad value {x}")

    data = tf.data.Dataset.range(1).map(lambda x: tf.py_function(broken, [x], tf.int64))
    error = op_error(lambda: next(iter(data)))
    assert errors.op_error_summary(error) == "ValueError: bad value 0"


def test_described_names_the_experiments_own_line():
    try:
        np.zeros(2).reshape(3)
    except ValueError as error:
        line = errors.described(error)
    assert line.startswith("ValueError: cannot reshape array of size 2 into shape (3,)")
    assert "test_errors.py:" in line  # This file is the experiment's code here.


def test_the_empty_data_lines_name_the_batch_size():
    assert "config.train.batch_size=32" in errors.empty_train_data(32)
    assert isinstance(errors.ConfigError("x"), errors.UserError) and errors.UserError.exit_code == 2
