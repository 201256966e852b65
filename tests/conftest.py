"""Shared test setup: the helpers and fixture experiments importable from every test folder, quiet
TensorFlow, seeded randomness, Keras's float32 default and a garbage collection after every test."""

import os
import sys

# tests/ (cli_runs, command_server) and tests/fixtures/ (the fixture experiments, which configs name
# as `tiny_experiment.TinyTrainer`), whatever folder a test file is in.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS_DIR, os.path.join(_TESTS_DIR, "fixtures")]

# Set before TensorFlow is first imported, so its C++ start-up logging stays quiet.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One core's worth of threads per pytest-xdist worker (and the CLI runs it starts, which inherit
    # the environment): two workers each running TensorFlow's default pools of one thread per core
    # oversubscribe the two cores.
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")

import gc  # noqa: E402

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def seeded():
    """Seeds Python, NumPy, TensorFlow and Keras so every test builds the same weights."""
    keras.utils.set_random_seed(1234)


@pytest.fixture(autouse=True)
def float32_keras_default():
    """Resets Keras's global dtype policy after each test, so no test leaks a mixed default."""
    yield
    keras.config.set_dtype_policy("float32")

import tensorflow as tf  # noqa: E402

# Two logical CPUs, so MirroredStrategy tests have two replicas on a machine without GPUs. It must
# happen before TensorFlow starts its runtime; the default strategy keeps using the first one.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
)


# The modules' own objects (TensorFlow's and Keras's, several hundred thousand) are never garbage:
# left out of every collection, which then walks only what the tests made.
gc.freeze()


@pytest.fixture(autouse=True)
def garbage_collected():
    """Collects the garbage each test leaves, then freezes what survives out of later collections.
    A `tf.function` that becomes cyclic garbage is freed only by a full collection, and each one
    freed removes its graphs from the eager context's function library at a cost that grows with
    that library; left to Python's schedule, single collections mid-suite took 15 to 50 s
    (measured with `gc.callbacks`) and the suite 14 minutes. Collected after each test, but each
    collection walking every object the earlier tests left alive, they took 332 s of a suite's
    1,195; with the survivors frozen, 58 s (what a later test releases of them stays unfreed: a
    worker peaks at 3.5 GB either way)."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def compile_mode_cache(tmp_path_factory, monkeypatch):
    """A compile-mode cache of each test's own (`compile_cache`), which the CLI runs it starts
    inherit: no test reads a choice another measured, nor writes the user's cache."""
    folder = tmp_path_factory.mktemp("compile-cache")
    monkeypatch.setenv("MIXLOOP_CACHE_DIR", str(folder))
    return folder
