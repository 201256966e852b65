"""The outer loop (runner/controller.py), in-process: compiled loops end at every boundary the
schedule knows, a stop saves and returns, the end of the data saves and says so."""

import logging
import os
import signal

import cli_runs
import numpy as np
import tensorflow as tf
import tiny_experiment

import mixloop
from mixloop.runner import controller


class Stepping(tiny_experiment.TinyTrainer):
    """The tiny trainer with an action every 7 updates that records when it ran."""

    def actions(self):
        self.action_steps = []
        return [mixloop.Action(self.action_steps.append, every_steps=7)]


def make(trainer_class, workdir, **train):
    config = tiny_experiment.get_config()
    config.jit_compile = False
    config.train.update(train)
    return trainer_class(config, str(workdir))


def test_each_loop_ends_where_the_next_log_eval_checkpoint_or_action_is_due(tmp_path, monkeypatch):
    trainer = make(Stepping, tmp_path, num_steps=21)  # steps_per_loop 5, log 10, eval and save 20.
    lengths, train_loop = [], trainer.run.train_loop
    monkeypatch.setattr(trainer.run, "train_loop", lambda n: lengths.append(n) or train_loop(n))
    trainer.train()
    assert lengths == [1, 4, 2, 3, 4, 1, 5, 1]  # To steps 1 (compiled apart), 5, 7, 10, 14, 15, 20, 21.
    assert trainer.action_steps == [7, 14, 21]
    assert cli_runs.checkpoint_steps(tmp_path) == [20, 21]


class StoppedBySigterm(tiny_experiment.TinyTrainer):
    def actions(self):
        return [mixloop.Action(lambda step: os.kill(os.getpid(), signal.SIGTERM), every_steps=10)]


def test_a_stop_saves_the_step_it_reached_and_returns(tmp_path, caplog):
    trainer = make(StoppedBySigterm, tmp_path)
    with caplog.at_level(logging.INFO):
        controller.train(trainer.run)
    assert int(trainer.run.global_step.numpy()) == 10
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-10")
    assert any("Stopped by SIGTERM at step 10; checkpoint saved" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "model.keras").exists()  # No export for a run that did not finish.


class FiniteData(tiny_experiment.TinyTrainer):
    def build_datasets(self):
        rng = np.random.default_rng(0)
        data = tf.data.Dataset.from_tensor_slices(
            (rng.normal(size=(96, 8)).astype("float32"), rng.integers(0, 3, 96).astype("int32")))
        return data.batch(32, drop_remainder=True), None  # Three batches.


def test_the_end_of_the_data_saves_and_says_how_to_repeat_it(tmp_path, caplog):
    trainer = make(FiniteData, tmp_path, repeat_dataset=False)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert int(trainer.run.global_step.numpy()) == 3
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith("ckpt-3")
    assert [r.getMessage() for r in caplog.records if "ended" in r.getMessage()] == [
        "The train dataset ended at step 3 of 40; checkpoint saved. Set "
        "config.train.repeat_dataset=True to repeat it."]
