"""Helpers the test folders share: an experiment's trainer run to its end with its log, TensorBoard
events read back, and the step tests' small regression problem."""

import collections
import contextlib
import glob
import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from mixloop.cli import import_trainer
from mixloop.runner import guard

# Tracing without XLA: seconds less per run (the CLI tests keep the run's own choice).
FAST = {"jit_compile": False}
AUTO = {"precision.float32_layers": "auto"}  # The automatic placement, as a config override.


def make_trainer(module, variant, directory, **overrides):
    """The experiment `module`'s trainer for `variant`, with `overrides` ("section.key": value)."""
    keras.utils.set_random_seed(1234)  # Module-scoped fixtures run before conftest's seeding.
    config = module.get_config(variant)
    for key, value in {**FAST, **overrides}.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return import_trainer(config.trainer)(config, str(directory))


@contextlib.contextmanager
def absl_messages():
    """The messages absl.logging emits inside the block, INFO and up (caplog is per test)."""
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


Run = collections.namedtuple("Run", "trainer metrics error log directory")


def train(module, variant, directory, **overrides):
    """Trains to the end or to a divergence; the run's trainer, metrics, TrainingDiverged and log."""
    with absl_messages() as log:
        trainer = make_trainer(module, variant, directory, **overrides)
        try:
            metrics, error = trainer.train(), None
        except guard.TrainingDiverged as diverged:
            metrics, error = None, diverged
    keras.config.set_dtype_policy("float32")
    return Run(trainer, metrics, error, log, directory)


def lines_with(run, text):
    return [message for message in run.log if text in message]



def events(directory):
    """{tag: [(step, value)]} for scalars, and {tag: [(step, text)]} for text summaries."""
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                array = tf.make_ndarray(value.tensor)
                item = array.item().decode() if array.dtype == object else float(array)
                found.setdefault(value.tag, []).append((event.step, item))
    return found



# ----- The step tests' regression problem. -----

NUM_INPUTS, NUM_HIDDEN, BATCH_SIZE = 8, 16, 8


JIT = pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])


def mse(outputs, batch):
    return tf.reduce_mean(tf.square(outputs - batch[1]))


def regression_batch(batch_size=BATCH_SIZE, *, seed=0, target_scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch_size, NUM_INPUTS)).astype(np.float32)
    y = (target_scale * rng.normal(size=(batch_size, 1))).astype(np.float32)
    return tf.constant(x), tf.constant(y)


def with_nan_rows(batch, rows):
    x = batch[0].numpy()
    x[list(rows), 0] = np.nan
    return tf.constant(x), batch[1]


def state_of(step):
    """Every model variable (BatchNorm statistics and dropout seeds included) and every optimizer
    variable (iterations, learning rate, slots), as NumPy copies keyed by path."""
    variables = step.model.variables + step.objectives["model"].optimizer.variables
    assert len({v.path for v in variables}) == len(variables)
    return {v.path: np.array(v.numpy(), copy=True) for v in variables}


def assert_bit_identical(before, after):
    assert before.keys() == after.keys()
    for path in before:
        assert before[path].dtype == after[path].dtype, path
        np.testing.assert_array_equal(after[path], before[path], err_msg=path, strict=True)

