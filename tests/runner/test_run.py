"""A run (runner/run.py), in-process: what it builds from the Trainer's hooks, its tools' seams, and
the door the outer loop drives."""

import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment

from mixloop.errors import ConfigError, UserError


def make_trainer(workdir, **train):
    config = tiny_experiment.get_config()
    config.jit_compile = False  # Decided: train_loop outside train() has no config.json to record in.
    config.train.update(train)
    return tiny_experiment.TinyTrainer(config, str(workdir))


def test_the_trainer_lends_what_its_run_built(tmp_path):
    trainer = make_trainer(tmp_path)
    run = trainer.run
    assert trainer.model is run.model and trainer.policy is run.policy
    assert trainer.objectives is run.objectives and trainer.eval_data is run.eval_data
    assert trainer.config is run.config and trainer.workdir == run.workdir == str(tmp_path)
    assert run.train_step.global_step is run.global_step and run.trainer is trainer


def test_train_loop_makes_the_updates_and_returns_numpy_totals(tmp_path):
    run = make_trainer(tmp_path).run
    totals = run.train_loop(3)
    assert int(run.global_step.numpy()) == 3
    assert int(totals["objectives"]["model"]["num_ran"]) == 3
    assert isinstance(totals["objectives"]["model"]["loss_sum"], np.floating)


def test_the_seams_train_on_given_data_with_given_metrics(tmp_path):
    rng = np.random.default_rng(1)
    data = tf.data.Dataset.from_tensor_slices(
        (rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 3, 64).astype("int32"))
    ).batch(32, drop_remainder=True)
    config = tiny_experiment.get_config()
    config.jit_compile = False
    trainer = tiny_experiment.TinyTrainer(
        config, str(tmp_path), datasets=(data, None),
        train_metrics=lambda outputs, batch: {"first": tf.reduce_mean(outputs[:, 0])})
    assert trainer.eval_data is None and trainer.run.num_train_batches() is None  # It repeats.
    assert trainer.run.train_metric_names == {"model": ["first"]}
    totals = trainer.run.train_loop(2)
    assert "first" in totals["objectives"]["model"]["metric_sums"]


def test_a_restore_puts_back_a_learning_rate_changed_for_the_resumed_run(tmp_path):
    make_trainer(tmp_path, num_steps=20).train()
    config = tiny_experiment.get_config()
    config.optimizer.learning_rate = 0.5
    run = tiny_experiment.TinyTrainer(config, str(tmp_path)).run
    assert run.restore().endswith("ckpt-20")
    assert float(run.objectives["model"].optimizer.learning_rate.numpy()) == 0.5


def test_a_batch_that_does_not_split_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ConfigError, match=r"batch_size=32 does not split into 1 replica\(s\) x 3"):
        make_trainer(tmp_path, accumulation_steps=3)


def test_an_empty_train_set_is_one_line(tmp_path):
    empty = tf.data.Dataset.from_tensor_slices(
        (np.zeros((0, 8), "float32"), np.zeros(0, "int32"))).batch(32, drop_remainder=True)
    config = tiny_experiment.get_config()
    config.train.repeat_dataset = False
    trainer = tiny_experiment.TinyTrainer(config, str(tmp_path), datasets=(empty, None))
    with pytest.raises(UserError, match="the train dataset is empty"):
        trainer.run.num_train_batches()


def test_a_resume_with_another_storage_dtype_names_the_changed_key(tmp_path):
    """int8 moments are other variables than float32 ones: the checkpoint cannot be read into them,
    and the line says which setting changed rather than TensorFlow's cut text."""
    config = tiny_experiment.get_config()
    config.jit_compile, config.optimizer.name = False, "adam"
    config.model.width = 512  # A kernel of 4,096 values or more: int8 quantizes its moments.
    config.train.num_steps = 10
    tiny_experiment.TinyTrainer(config, str(tmp_path)).train()
    config.optimizer.state_dtype = "int8"
    config.train.num_steps = 20
    with pytest.raises(UserError) as refused:
        tiny_experiment.TinyTrainer(config, str(tmp_path)).run.restore()
    assert str(refused.value) == (
        f"the checkpoint in {tmp_path}/checkpoints was written with other storage dtypes "
        "(optimizer.state_dtype: 'float32' -> 'int8'), which a checkpoint keeps: resume with the "
        "settings that wrote it, or use a new --workdir")
