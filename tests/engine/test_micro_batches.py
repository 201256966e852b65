"""The default gradient source (engine/micro_batches.py): a batch in micro-batches, one at a time, whose
accumulated gradient is the whole batch's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.accumulators import Accumulators
from mixloop.engine.gradients import Partition
from mixloop.engine.micro_batches import (MicroBatches, batch_divided, in_micro_batches,
                                          micro_batch_at, micro_batch_loop, split_micro_batches)
from mixloop.engine.micro_step import MicroStep
from mixloop.engine.objective import Objective
from mixloop.engine.policy import Policy


def test_split_reshapes_without_copying_and_refuses_an_uneven_split():
    batch = {"x": tf.reshape(tf.range(12.0), [6, 2]), "y": tf.range(6)}
    split = split_micro_batches(batch, 3)
    assert split["x"].shape == (3, 2, 2) and split["y"].shape == (3, 2)
    assert micro_batch_at(split, 1)["y"].numpy().tolist() == [2, 3]
    with pytest.raises(ValueError, match="batch dimension 6 is not divisible by accumulation_steps=4"):
        split_micro_batches(batch, 4)


def test_batch_divided_knows_the_micro_batch_where_it_divides():
    assert batch_divided(tf.TensorSpec([8, 3]), 4).shape == (2, 3)
    assert batch_divided(tf.TensorSpec([6, 3]), 4).shape.as_list() == [None, 3]
    assert batch_divided(tf.TensorSpec([]), 4).shape == ()


def test_the_loop_runs_one_micro_batch_at_a_time_in_order():
    order = micro_batch_loop(4, lambda i, seen: seen.write(i, i), tf.TensorArray(tf.int32, size=4))
    assert order.stack().numpy().tolist() == [0, 1, 2, 3]
    graph = tf.function(lambda: micro_batch_loop(3, lambda i, total: total + i, tf.constant(0))
                        ).get_concrete_function().graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops and all(op.get_attr("parallel_iterations") == 1 for op in loops)


def test_a_forward_in_micro_batches_is_the_whole_batch_s_one_micro_batch_at_a_time():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, activation="relu")])
    batch = {"x": tf.random.normal([8, 3]), "mask": tf.ones([8])}
    calls = []

    def forward(inputs):
        calls.append(inputs["x"].shape[0])
        return {"y": model(inputs["x"]), "mask": inputs["mask"]}

    whole = forward(batch)
    calls.clear()
    chunked = tf.function(lambda b: in_micro_batches(forward, b, 4))(batch)
    # Traced for the first micro-batch, for the whole batch's shapes and for the loop's body.
    assert calls == [2, 8, 2]
    np.testing.assert_allclose(chunked["y"], whole["y"], rtol=1e-6)
    assert chunked["mask"].shape == (8,)
    graph = tf.function(lambda b: in_micro_batches(forward, b, 4)).get_concrete_function(batch).graph
    loops = [op for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]
    assert loops and all(op.get_attr("parallel_iterations") == 1 for op in loops)


def test_a_forward_in_micro_batches_falls_back_to_the_whole_batch():
    batch = tf.random.normal([6, 2])
    calls = []

    def total(x):  # No batch dimension in its output: chunks cannot be concatenated.
        calls.append(x.shape[0])
        return tf.reduce_sum(x)

    assert float(in_micro_batches(total, batch, 3)) == pytest.approx(float(tf.reduce_sum(batch)), rel=1e-5)
    assert calls == [2, 6, 6]
    calls.clear()
    in_micro_batches(total, batch, 4)  # 6 does not split into 4.
    assert calls == [6]

    def similarities(x):  # [B, B]: its rows are not the micro-batches' rows put together.
        return tf.matmul(x, x, transpose_b=True)

    np.testing.assert_allclose(in_micro_batches(similarities, batch, 3), similarities(batch),
                               rtol=1e-6)
    ragged = tf.ragged.constant([[1.0], [2.0, 3.0], [4.0], [5.0]])
    assert in_micro_batches(lambda r: r.row_lengths(), ragged, 2).numpy().tolist() == [1, 2, 1, 1]


def test_four_micro_batches_accumulate_the_whole_batch_gradient():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    objectives = {"model": Objective(model, keras.optimizers.SGD(0.1), mixloop.NoLossScale())}
    partitions = {"model": Partition(model.trainable_variables)}

    def loss(outputs, batch):
        return tf.reduce_sum(tf.square(outputs - batch[1])), tf.cast(tf.shape(outputs)[0], tf.float32)

    micro_step = MicroStep(model, Policy.from_string("float32"), loss, lambda b: b[0], objectives,
                           partitions)
    rng = np.random.default_rng(1)
    batch = (tf.constant(rng.normal(size=(8, 3)), tf.float32), tf.constant(rng.normal(size=(8, 1)), tf.float32))
    source = MicroBatches(micro_step, 4, Accumulators(partitions), lambda spec: {"model": []}, 1)
    grads, sums = source(batch, tf.constant(1, tf.int64))
    whole, whole_sums = MicroBatches(micro_step, 1, Accumulators(partitions), None, 1)(
        batch, tf.constant(1, tf.int64))
    for a, b in zip(grads["model"].derivatives, whole["model"].derivatives):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert float(sums["model"]["weight"]) == float(whole_sums["model"]["weight"]) == 8.0
    assert source.loss_batch_spec((tf.TensorSpec([8, 3]),))[0].shape == (2, 3)
