"""Data sources: a Python generator resumes exactly; a pipeline that raises, a batch of the wrong
shape and a train set batched wrongly are each one line naming them (train_data.py, controller.py)."""

import glob
import logging
import os
import re

import cli_runs
import faulty_experiment
import numpy as np
import pytest
import tensorflow as tf

from mixloop.errors import UserError
from mixloop.runner import train_data

FIXTURES_DIR = cli_runs.FIXTURES_DIR
FAULTY_CONFIG = os.path.join(FIXTURES_DIR, "faulty_experiment.py")


def make_config(**overrides):
    config = faulty_experiment.get_config()
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return config


def checkpoint_steps(directory):
    return sorted(int(path.rsplit("-", 1)[1].split(".")[0])
                  for path in glob.glob(os.path.join(directory, "checkpoints", "ckpt-*.index")))


# ----- A generator's iterator cannot be checkpointed: the data is fast-forwarded -----

def test_a_generator_run_stopped_and_resumed_ends_with_the_same_weights(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    generated = {"data.generator": True, "train.num_steps": 12}
    straight = faulty_experiment.FaultyTrainer(make_config(**generated), str(tmp_path / "straight"))
    straight.train()
    notices = [r.getMessage() for r in caplog.records if "cannot be checkpointed" in r.getMessage()]
    assert len(notices) == 1 and "PyFunc is stateful" in notices[0]
    assert not straight.run.iterator_in_checkpoint

    half = make_config(**{**generated, "train.num_steps": 6})
    faulty_experiment.FaultyTrainer(half, str(tmp_path / "resumed")).train()
    assert checkpoint_steps(tmp_path / "resumed") == [4, 6]
    resumed = faulty_experiment.FaultyTrainer(make_config(**generated), str(tmp_path / "resumed"))
    resumed.train()

    assert int(resumed.run.global_step.numpy()) == 12
    # Bit-identical: the resumed run read batches 6..11, as the straight one did (restarting the
    # generator at batch 0 instead differs at the first update after the resume).
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_tensor_dataset_keeps_its_iterator_in_the_checkpoint(tmp_path):
    trainer = faulty_experiment.FaultyTrainer(make_config(), str(tmp_path))
    assert trainer.run.iterator_in_checkpoint and "train_iterator" in trainer.run.checkpointed


# ----- A data pipeline that raises mid-run -----

def test_a_generator_that_raises_is_one_line_naming_the_pipeline_and_the_step(tmp_path):
    # Batch 4 is step 5, the first of the second inner loop (steps_per_loop=4).
    trainer = faulty_experiment.FaultyTrainer(make_config(**{"data.raise_at_batch": 4}),
                                              str(tmp_path))
    with pytest.raises(UserError) as raised:
        trainer.train()
    assert str(raised.value) == (
        "the train data pipeline failed near step 5: ValueError: record 128 of the generator is "
        f"corrupt; the last checkpoint ({tmp_path / 'checkpoints' / 'ckpt-4'}) is kept")
    assert checkpoint_steps(tmp_path) == [4]


def test_a_generator_that_raises_while_its_batches_are_counted_is_one_line(tmp_path):
    # Not repeated and of unknown length: the batches are counted by one pass before training.
    config = make_config(**{"data.raise_at_batch": 20, "train.repeat_dataset": False})
    with pytest.raises(UserError, match=r"^the train data pipeline failed while its batches were "
                                        r"counted \(one pass, .*\): ValueError: record 640 of the "
                                        r"generator is corrupt$"):
        faulty_experiment.FaultyTrainer(config, str(tmp_path)).train()
    assert checkpoint_steps(tmp_path) == []


class PyFunctionTrainer(faulty_experiment.FaultyTrainer):
    """Train batches through a `tf.py_function` that raises RuntimeError (TensorFlow's
    UnknownError) at the first batch."""

    def build_datasets(self):
        train, evaluation = super().build_datasets()

        def check(index, *batch):
            if int(index) == 0:
                raise RuntimeError("cannot decode batch 0")
            return batch

        def checked(index, batch):
            outputs = tf.py_function(check, [index, *batch], [s.dtype for s in train.element_spec])
            return tuple(tf.ensure_shape(t, s.shape) for t, s in zip(outputs, train.element_spec))

        return train.enumerate().map(checked), evaluation


def test_a_py_function_that_raises_is_one_line_before_any_checkpoint(tmp_path):
    trainer = PyFunctionTrainer(make_config(), str(tmp_path))
    with pytest.raises(UserError, match=r"^the train data pipeline failed near step 1: "
                                        r"RuntimeError: cannot decode batch 0; no checkpoint was "
                                        r"saved yet$"):
        trainer.train()
    assert checkpoint_steps(tmp_path) == []


# ----- A batch of the wrong shape mid-stream -----

@pytest.mark.parametrize("jit_compile", [True, False])
def test_a_batch_of_the_wrong_shape_names_the_shapes(tmp_path, jit_compile):
    trainer = faulty_experiment.FaultyTrainer(
        make_config(**{"data.bad_shape_batch": 4, "jit_compile": jit_compile}), str(tmp_path))
    assert trainer.run.train_step.jit_compile is jit_compile
    with pytest.raises(UserError) as raised:
        trainer.train()
    assert str(raised.value) == ("the train step failed near step 5: Matrix size-incompatible: "
                                 "In[0]: [32,9], In[1]: [8,16]")
    assert checkpoint_steps(tmp_path) == [4]


# ----- The train data's batch dimension, checked at startup -----

def test_a_train_set_batched_without_drop_remainder_is_refused_at_startup(tmp_path):
    with pytest.raises(UserError) as raised:
        faulty_experiment.FaultyTrainer(make_config(**{"data.no_drop_remainder": True}),
                                        str(tmp_path / "run"))
    assert str(raised.value) == (
        "the train dataset's batch dimension is unknown (element [0] of shape (None, 8)): batch "
        "it with drop_remainder=True (a generator: put the batch size in its output_signature) "
        "so every batch has config.train.batch_size=32 examples")
    assert not (tmp_path / "run").exists()


class RebatchedTrainer(faulty_experiment.FaultyTrainer):
    """Batches of 16, whatever `config.train.batch_size` says."""

    def build_datasets(self):
        train, evaluation = super().build_datasets()
        return train.unbatch().batch(16, drop_remainder=True), evaluation


def test_batches_of_another_size_than_the_config_are_refused_at_startup(tmp_path):
    with pytest.raises(UserError, match=r"^the train dataset's batches hold 16 examples \(element "
                                        r"\[0\] of shape \(16, 8\)\), but "
                                        r"config.train.batch_size=32: build_datasets\(\) must batch"):
        RebatchedTrainer(make_config(), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def spec(*shape, dtype=tf.float32):
    return tf.TensorSpec(shape, dtype)


@pytest.mark.parametrize("element_spec", [
    spec(32, 8),
    (spec(32, 8), spec(32), spec()),  # A scalar leaf has no batch dimension.
    {"x": spec(32, 8), "boost": spec(None)},  # Lost in a map; the sibling knows it.
    {"ids": tf.RaggedTensorSpec([32, None], tf.int32), "mask": tf.SparseTensorSpec([32, 5], tf.float32)},
])
def test_batch_dimensions_that_fit(element_spec):
    train_data.check_batches(element_spec, 32)


@pytest.mark.parametrize("element_spec, message", [
    (spec(None, 8), r"is unknown \(shape \(None, 8\)\)"),
    ({"x": spec(None, 8), "y": spec(None)}, r"is unknown \(element \['x'\] of shape \(None, 8\)\)"),
    (tf.TensorSpec(None, tf.float32), r"is unknown \(shape <unknown>\)"),
    ({"x": spec(32, 8), "ids": tf.RaggedTensorSpec([16, None], tf.int32)},
     r"hold 16 examples \(element \['ids'\] of shape \(16, None\)\)"),
    ((spec(32, 8), (spec(32), spec(64, 2))), r"hold 64 examples \(element \[1\]\[1\] of shape"),
])
def test_batch_dimensions_that_do_not_fit(element_spec, message):
    with pytest.raises(UserError, match=message):
        train_data.check_batches(element_spec, 32)


# ----- Through the command line, where the user meets them -----

@pytest.mark.slow
@pytest.mark.parametrize("knob, line", [
    ("data.raise_at_batch=4", r"error: the train data pipeline failed near step 5: ValueError: "
                              r"record 128 of the generator is corrupt; the last checkpoint "
                              r"\(.*/checkpoints/ckpt-4\) is kept"),
    ("data.bad_shape_batch=4", r"error: the train step failed near step 5: Matrix "
                               r"size-incompatible: In\[0\]: \[32,9\], In\[1\]: \[8,16\]"),
    ("data.no_drop_remainder=True", r"error: the train dataset's batch dimension is unknown "
                                    r"\(element \[0\] of shape \(None, 8\)\): batch it with "
                                    r"drop_remainder=True"),
])
def test_the_command_line_prints_one_line(tmp_path, knob, line):
    result = cli_runs.run("mixloop.train", f"--config={FAULTY_CONFIG}",
                          f"--workdir={tmp_path / 'run'}", f"--config.{knob}")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(line + ".*", last), result.stderr
    assert "Traceback" not in result.stderr
    if "no_drop_remainder" in knob:
        assert not (tmp_path / "run").exists()  # Refused before anything is written.
    else:
        assert checkpoint_steps(tmp_path / "run") == [4]
