"""Overflow retries (engine/retries.py), on a step of its own making: an attempt is retried only when
every update due overflowed curably, its count and kept state then put back; the loop stops at the
limit and counts an uncured step as one skip."""

import keras
import tensorflow as tf

import mixloop
from mixloop.engine.objective import Objective
from mixloop.engine.retries import OverflowRetries, without_retries


def setup(max_retries=2, scale=2.0**10):
    """An objective on a Dense layer of a model whose dropout's seed state no skip of that objective
    rolls back: a retry must."""
    inputs = keras.Input((2,))
    dense = keras.layers.Dense(1)
    model = keras.Model(inputs, keras.layers.Dropout(0.5, seed=1)(dense(inputs)))
    loss_scale = mixloop.DynamicLossScale(initial_scale=scale)
    objectives = {"model": Objective(dense, keras.optimizers.SGD(0.1), loss_scale)}
    global_step = tf.Variable(0, dtype=tf.int64)
    return OverflowRetries(objectives, max_retries, model, global_step), loss_scale, global_step, model


def overflowing_step(loss_scale, global_step, model, cured_below):
    """A step that overflows while the scale is at or above `cured_below`, backing it off, and
    moves the model's seed state (what a retry must put back)."""
    def step(batch):
        del batch
        used = loss_scale.scale
        finite = used < cured_below
        loss_scale.update(finite)
        for variable in model.non_trainable_variables:
            variable.assign_add(tf.ones_like(variable))
        global_step.assign_add(1)
        return {"objectives": {"model": {"loss": tf.constant(1.0), "loss_scale": used,
                                         "ran": tf.constant(True), "applied": finite}},
                "inputs_finite": tf.constant(True)}
    return step


def test_an_overflow_is_retried_at_the_backed_off_scale_and_the_step_counts_once():
    retries, loss_scale, global_step, model = setup()
    seed_states = [v.numpy().copy() for v in model.non_trainable_variables]
    attempt = tf.function(retries.attempt(overflowing_step(loss_scale, global_step, model, 2.0**10)))
    report = tf.function(lambda: retries(attempt, tf.zeros([1]), jit_compile=False))()
    assert int(report["objectives"]["model"]["retries"]) == 1 and bool(report["objectives"]["model"]["applied"])
    assert float(report["objectives"]["model"]["loss_scale"]) == 2.0**9
    assert int(global_step.numpy()) == 1  # One step, whatever its attempts.
    for before, after in zip(seed_states, model.non_trainable_variables):  # Moved once, not twice.
        assert (after.numpy() == before + 1).all()


def test_an_overflow_no_retry_cures_counts_as_one_skip_one_back_off_from_its_first_scale():
    retries, loss_scale, global_step, model = setup(max_retries=2)
    attempt = tf.function(retries.attempt(overflowing_step(loss_scale, global_step, model, 1.0)))
    report = tf.function(lambda: retries(attempt, tf.zeros([1]), jit_compile=True))()["objectives"]["model"]
    assert int(report["retries"]) == 2 and not bool(report["applied"])
    assert float(report["loss_scale"]) == 2.0**10  # The first attempt's.
    assert float(loss_scale.scale) == 2.0**9  # One back-off from it, as without retries.
    assert int(global_step.numpy()) == 1


def test_without_a_dynamic_scale_there_is_nothing_to_retry():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    objectives = {"model": Objective(model, keras.optimizers.SGD(0.1), mixloop.StaticLossScale(8.0))}
    assert OverflowRetries(objectives, 3, model, tf.Variable(0, dtype=tf.int64)).max_retries == 0
    report = without_retries({"objectives": {"model": {}}})
    assert int(report["objectives"]["model"]["retries"]) == 0
