"""Tracing: mixloop's own code is traced as written, the experiment's hooks through AutoGraph."""

import json

import keras
import pytest
import tensorflow as tf
import tiny_experiment
from tensorflow.python.autograph.impl import api as autograph_api

import mixloop
from mixloop.engine import tracing
from mixloop.engine.loss import LossContractError, as_losses
from mixloop.errors import message_of


class BranchingTrainer(tiny_experiment.TinyTrainer):
    """Hooks with Python `if`s and a `for` over tensors: only AutoGraph's conversion makes them
    graph control flow (traced as written, they raise)."""

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

    def build_objectives(self):
        self.clipped = tf.Variable(0, dtype=tf.int32, trainable=False)

        def clip_after_update():  # Counts the updates whose weights it had to clip.
            kernel = self.model.layers[1].kernel
            if tf.reduce_max(tf.abs(kernel)) > 0.05:
                kernel.assign(tf.clip_by_value(kernel, -0.05, 0.05))
                self.clipped.assign_add(1)

        return {"model": mixloop.Objective(self.model, self.build_optimizer(),
                                           after_update=clip_after_update)}


class FailingTrainer(tiny_experiment.TinyTrainer):
    def compute_loss(self, outputs, batch):
        return tf.reshape(outputs, [7])  # Three logits per example: no shape of 7 values.


class ContractTrainer(tiny_experiment.TinyTrainer):
    def compute_loss(self, outputs, batch):
        return as_losses(tf.zeros([2, 2]), self.objectives)  # Not a scalar: mixloop's one line.


def make(cls, tmp_path, policy="float32"):
    config = tiny_experiment.get_config()
    config.precision.policy = policy
    config.jit_compile = False
    config.train.num_steps = 4
    return cls(config, str(tmp_path))


@pytest.fixture
def converted(monkeypatch):
    """The functions AutoGraph converts, as 'module.qualname', in order."""
    names, convert = [], autograph_api._convert_actual

    def recording(entity, program_ctx):
        names.append(f"{entity.__module__}.{entity.__qualname__}")
        return convert(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", recording)
    return names


def test_the_experiments_hooks_are_converted_and_mixloops_code_is_not(tmp_path, converted):
    trainer = make(BranchingTrainer, tmp_path)
    totals = trainer.run.train_loop(4)
    assert int(trainer.run.global_step.numpy()) == 4
    assert totals["objectives"]["model"]["num_applied"] == 4
    assert int(trainer.clipped.numpy()) == 4  # lr 1e-2 from weights of about 0.3: every update.
    assert "mean_max_logit" in trainer.evaluate()
    own = {f"test_tracing.BranchingTrainer.{name}"
           for name in ("model_inputs", "compute_loss", "eval_metrics")}
    after_update = "test_tracing.BranchingTrainer.build_objectives.<locals>.clip_after_update"
    assert set(converted) == own | {after_update}, sorted(set(converted))


def test_mixloops_default_hooks_run_as_written_and_convert_what_they_call(tmp_path, converted):
    trainer = make(tiny_experiment.TinyTrainer, tmp_path)  # Its own compute_loss, eval_metrics.
    trainer.run.train_loop(2)
    trainer.evaluate()
    assert set(converted) == {"tiny_experiment.TinyTrainer.compute_loss",
                              "tiny_experiment.TinyTrainer.eval_metrics"}
    converted.clear()

    class DefaultEval(tiny_experiment.TinyTrainer):
        eval_metrics = mixloop.Trainer.eval_metrics  # Calls compute_loss: converted, it alone.

    metrics = make(DefaultEval, tmp_path / "default").evaluate()
    assert "loss" in metrics
    assert set(converted) == {"tiny_experiment.TinyTrainer.compute_loss"}


def test_the_float16_probe_traces_the_hooks_converted(tmp_path):
    # float32_layers=auto and initial_scale=auto: the probe runs before the first update.
    metrics = make(BranchingTrainer, tmp_path, policy="mixed_float16").train()
    assert metrics["skipped_total"] == 0 and "eval_mean_max_logit" in metrics
    resolved = json.loads((tmp_path / "config.json").read_text())["resolved"]
    assert resolved["precision.initial_scale"] == 32768  # What the probe found.


def test_a_hook_run_eagerly_is_not_converted(converted):
    def loss(x):
        return x * 2.0

    assert float(tracing.hook(loss)(tf.constant(1.0))) == 2.0
    assert converted == []
    assert float(tf.function(tracing.hook(loss), autograph=False)(tf.constant(1.0))) == 2.0
    assert converted == ["test_tracing.test_a_hook_run_eagerly_is_not_converted.<locals>.loss"]


def test_an_error_in_a_hook_names_the_experiments_line(tmp_path):
    with pytest.raises(ValueError) as raised:  # Raised while the Trainer traces the loss once.
        make(FailingTrainer, tmp_path).train_loop(1)
    line = FailingTrainer.compute_loss.__code__.co_firstlineno + 1
    assert str(raised.value).startswith(f'in user code:\n\n    File "{__file__}", line {line}, '
                                        f'in compute_loss'), str(raised.value)
    assert message_of(raised.value).startswith("Cannot reshape a tensor with 48 elements")


def test_mixloops_one_line_error_raised_inside_a_hook_comes_out_as_raised(tmp_path):
    with pytest.raises(LossContractError) as raised:
        make(ContractTrainer, tmp_path).train_loop(1)
    assert "\n" not in str(raised.value) and "in user code" not in str(raised.value)


def test_the_inner_loop_stops_at_its_count(tmp_path):
    trainer = make(BranchingTrainer, tmp_path)
    assert trainer.run.train_loop(3)["objectives"]["model"]["num_ran"] == 3
    assert trainer.run.train_loop(2)["objectives"]["model"]["num_ran"] == 2
    assert int(trainer.run.global_step.numpy()) == 5
