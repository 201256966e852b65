"""Tracing: mixloop's own code is traced as written, the experiment's hooks through AutoGraph."""

import keras
import pytest
import tensorflow as tf
import tiny_experiment
from tensorflow.python.autograph.impl import api as autograph_api

from mixloop.errors import message_of


class BranchingTrainer(tiny_experiment.TinyTrainer):
    """compute_loss, model_inputs and eval_metrics with Python `if`s and a `for` over tensors: only
    AutoGraph's conversion makes them graph control flow (traced as written, they raise)."""

    def model_inputs(self, batch):
        features = batch[0]
        if tf.reduce_max(tf.abs(features)) > 100.0:
            features = features / 100.0
        return features

    def compute_loss(self, outputs, batch):
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            batch[1], outputs, from_logits=True))
        if loss > 1e6:
            loss = tf.constant(0.0)
        return loss

    def eval_metrics(self, outputs, batch):
        total = tf.constant(0.0)
        for row in tf.range(tf.shape(outputs)[0]):
            total += tf.reduce_max(outputs[row])
        return {"mean_max_logit": total / tf.cast(tf.shape(outputs)[0], tf.float32)}


class FailingTrainer(tiny_experiment.TinyTrainer):
    def compute_loss(self, outputs, batch):
        return tf.reshape(outputs, [7])  # Three logits per example: no shape of 7 values.


def make(cls, tmp_path, **train):
    config = tiny_experiment.get_config()
    config.precision.policy = "float32"
    config.jit_compile = False
    config.train.num_steps = 4
    config.train.update(train)
    return cls(config, str(tmp_path))


def test_the_experiments_hooks_are_converted_and_mixloops_code_is_not(tmp_path, monkeypatch):
    converted = []
    convert = autograph_api._convert_actual

    def recording(entity, program_ctx):
        converted.append(f"{entity.__module__}.{entity.__qualname__}")
        return convert(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", recording)
    trainer = make(BranchingTrainer, tmp_path)
    totals = trainer.train_loop(4)
    assert int(trainer.global_step.numpy()) == 4
    assert totals["objectives"]["model"]["num_applied"] == 4
    assert "mean_max_logit" in trainer.evaluate()
    hooks = {f"test_tracing.BranchingTrainer.{name}"
             for name in ("model_inputs", "compute_loss", "eval_metrics")}
    assert set(converted) == hooks, sorted(set(converted))


def test_an_error_in_a_hook_names_the_experiments_line(tmp_path):
    with pytest.raises(ValueError) as raised:  # Raised while the Trainer traces the loss once.
        make(FailingTrainer, tmp_path).train_loop(1)
    line = FailingTrainer.compute_loss.__code__.co_firstlineno + 1
    assert str(raised.value).startswith(f'in user code:\n\n    File "{__file__}", line {line}, '
                                        f'in compute_loss'), str(raised.value)
    assert message_of(raised.value).startswith("Cannot reshape a tensor with 48 elements")


def test_the_inner_loop_stops_at_its_count(tmp_path):
    trainer = make(BranchingTrainer, tmp_path)
    assert trainer.train_loop(3)["objectives"]["model"]["num_ran"] == 3
    assert trainer.train_loop(2)["objectives"]["model"]["num_ran"] == 2
    assert int(trainer.global_step.numpy()) == 5
