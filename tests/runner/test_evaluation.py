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


def test_the_forward_runs_in_the_train_steps_micro_batches_and_the_metrics_see_the_whole_batch():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3, activation="gelu")])
    data = tf.data.Dataset.from_tensor_slices(np.random.default_rng(0).normal(
        size=(12, 2)).astype("float32")).batch(6, drop_remainder=True)  # Static: split in 3.
    seen = []

    def metrics(outputs, batch):
        seen.append(outputs.shape[0])  # The whole batch's outputs, put back together.
        return {"mean": tf.reduce_mean(outputs), "max": tf.reduce_max(outputs)}

    policy = mixloop.Policy.from_string("float32")
    whole = evaluation.Evaluation(model, policy, lambda b: b, metrics, 0, micro_batches=1)
    split = evaluation.Evaluation(model, policy, lambda b: b, metrics, 0, micro_batches=3)
    assert split.mean_metrics(data) == pytest.approx(whole.mean_metrics(data), rel=1e-6)
    assert set(seen) == {6}
    graph = split.step.get_concrete_function(tf.TensorSpec([6, 2])).graph
    assert any(op.type in ("While", "StatelessWhile") for op in graph.get_operations())
    config = mixloop.config.base_config()
    config.train.accumulation_steps = 4
    assert evaluation.micro_batches(config) == 4
    config.eval.micro_batches = 1
    assert evaluation.micro_batches(config) == 1


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
