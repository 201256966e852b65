"""Evaluation (runner/evaluation.py): a mean over examples, not batches; the EMA weights swapped in and
out; the random states put back."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.engine.ema import ExponentialMovingAverage
from mixloop.errors import UserError
from mixloop.runner import evaluation


def test_the_mean_counts_each_batch_by_its_examples():
    inputs = keras.Input((1,))
    model = keras.Model(inputs, keras.layers.Identity()(inputs))
    data = tf.data.Dataset.from_tensor_slices(np.arange(5, dtype="float32")[:, None]).batch(4)
    eval_step = evaluation.Evaluation(model, mixloop.Policy.from_string("float32"), lambda b: b,
                                      lambda outputs, batch: {"mean": tf.reduce_mean(outputs)}, 0)
    # Batches [0..3] (mean 1.5) and [4]: the examples' mean 2.0, not the batches' 2.75.
    assert eval_step.mean_metrics(data) == {"mean": pytest.approx(2.0)}
    first_only = evaluation.Evaluation(model, mixloop.Policy.from_string("float32"), lambda b: b,
                                       lambda outputs, batch: {"mean": tf.reduce_mean(outputs)}, 1)
    assert first_only.mean_metrics(data) == {"mean": pytest.approx(1.5)}
    with pytest.raises(UserError, match="the eval dataset is empty"):
        eval_step.mean_metrics(data.take(0))


def test_the_averages_are_swapped_in_and_the_trained_weights_back():
    weight = keras.Variable([1.0, 2.0])
    average = ExponentialMovingAverage([weight], 0.5)
    weight.assign([3.0, 4.0])
    average.update()  # [2, 3]
    with evaluation.ema_swapped_in({"model": average}, tf.distribute.get_strategy()):
        assert weight.numpy().tolist() == [2.0, 3.0]
    assert weight.numpy().tolist() == [3.0, 4.0]


def test_random_states_are_the_seed_generators_and_the_research_generators_and_come_back():
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dropout(0.5, seed=3)(keras.layers.Dense(4)(inputs)))
    generator = tf.random.Generator.from_seed(1)
    states = evaluation.random_states(model, {"noise": generator, "count": tf.Variable(0)})
    assert len(states) == 2 and states[-1] is generator.state
    before = [s.numpy().copy() for s in states]
    with evaluation.states_kept(states, tf.distribute.get_strategy()):
        model(tf.ones([2, 4]), training=True)
        generator.normal([3])
        assert any((s.numpy() != b).any() for s, b in zip(states, before))
    assert all((s.numpy() == b).all() for s, b in zip(states, before))
