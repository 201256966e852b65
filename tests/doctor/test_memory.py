"""Memory: the persistent bytes per parameter by part, counted from the variables as stored; the
peak of a process, and of a process of its own; the start line and `memory/peak_bytes` of a run."""

import glob
import os
import subprocess
import sys
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf
import tiny_experiment

import cli_runs
from cli_runs import TINY_CONFIG
from mixloop.doctor import memory

# tiny_experiment's MLP: Dense(8 -> 16) and Dense(16 -> 3), weights and biases.
TINY_PARAMETERS = 8 * 16 + 16 + 16 * 3 + 3


def make_trainer(workdir, **overrides):
    config = tiny_experiment.get_config()
    for key, value in overrides.items():
        section, field = key.split(".")
        config[section][field] = value
    return tiny_experiment.TinyTrainer(config, str(workdir))


@pytest.mark.parametrize("overrides, per_parameter", [
    # Adam's two float32 moments; two micro-batches accumulate in float32.
    ({"precision.policy": "float32"}, [4, 8, 4, 0]),
    ({"precision.policy": "float32", "train.ema_decay": 0.999}, [4, 8, 4, 4]),
    ({"precision.policy": "float32", "train.accumulation_steps": 1}, [4, 8, 0, 0]),
    # Mixed precision keeps float32 master weights; bfloat16 accumulators take half.
    ({"precision.policy": "mixed_bfloat16", "train.accumulation_dtype": "bfloat16"}, [4, 8, 2, 0]),
    # SGD keeps no state, momentum one buffer.
    ({"optimizer.name": "sgd"}, [4, 0, 4, 0]),
    ({"optimizer.name": "momentum"}, [4, 4, 4, 0]),
])
def test_persistent_bytes_per_parameter_by_part(tmp_path, overrides, per_parameter):
    state = memory.persistent_state(make_trainer(tmp_path, **overrides).run)

    assert state.num_parameters == TINY_PARAMETERS
    assert state.part_bytes == dict(zip(memory.PARTS, [TINY_PARAMETERS * b for b in per_parameter]))
    assert state.total_bytes == TINY_PARAMETERS * sum(per_parameter)


def test_fp8_scales_and_amax_histories_are_no_parameters(tmp_path):
    """Keras overwrites FP8's scales and amax histories with their "gradient": their bytes are the
    weights', not their values parameters (they would dilute every bytes-per-parameter figure)."""
    run = make_trainer(tmp_path, **{"precision.policy": "mixed_bfloat16",
                                    "precision.float8_layers": "auto"}).run
    overwritten = [v for v in run.model.trainable_variables if v.overwrite_with_gradient]
    assert overwritten  # Keras's float8 Dense layers made them.
    state = memory.persistent_state(run)
    assert state.num_parameters == TINY_PARAMETERS
    assert state.part_bytes["weights"] == 4 * TINY_PARAMETERS + memory.stored_bytes(overwritten)


def test_the_start_line_shows_each_part_per_parameter_and_the_total():
    state = memory.PersistentState(1_234_567, {"weights": 4 * 1_234_567,
                                               "optimizer state": 8 * 1_234_567,
                                               "accumulators": 4 * 1_234_567, "EMA": 0})
    assert state.describe() == (
        "memory: 1,234,567 parameters; persistent state 16.00 B/param (weights 4.00, optimizer "
        "state 8.00, accumulators 4.00, EMA 0.00) = 19.8 MB")


def test_optimizer_state_counts_each_variable_as_stored_but_not_the_scalars():
    """An int8-quantized moment: 1 byte a code, a float32 scale per block of 250; a bfloat16
    moment 2 bytes; the step counter and learning rate are per run, not per parameter."""
    optimizer = SimpleNamespace(variables=[
        keras.Variable(np.zeros([1000], np.int8)), keras.Variable(np.zeros([4], np.float32)),
        keras.Variable(np.zeros([10, 100], "bfloat16")),
        keras.Variable(0, dtype="int64", name="iteration"),
        keras.Variable(1e-3, dtype="float32", name="learning_rate")])
    objectives = {"model": SimpleNamespace(optimizer=optimizer)}

    state = memory.optimizer_state(objectives)
    assert [v.dtype for v in state] == ["int8", "float32", "bfloat16"]
    assert memory.stored_bytes(state) == 1000 * 1 + 4 * 4 + 1000 * 2
    assert memory.num_elements(state) == 2004


@pytest.mark.parametrize("num_bytes, shown", [
    (950, "950 B"), (999.6, "1.00 kB"), (3120, "3.12 kB"), (19_753_072, "19.8 MB"),
    (99_960_000, "100 MB"), (999_600_000, "1.00 GB"), (1_920_000_000, "1.92 GB")])
def test_bytes_are_shown_in_decimal_units_to_three_digits(num_bytes, shown):
    assert memory.format_bytes(num_bytes) == shown


def _allocate(num_bytes):
    """Starts TensorFlow's runtime (which reading the peak would start after the array is gone),
    then touches `num_bytes` of new memory (np.ones writes every page)."""
    tf.constant(0)
    return int(np.ones(num_bytes, np.uint8)[::4096].sum())


MB = 1_000_000


def test_the_peak_grows_by_what_a_process_of_its_own_allocates_and_holds_none_of_ours():
    ballast = np.ones(600 * MB, np.uint8)  # Held here: a process of its own does not count it.
    assert memory.peak_bytes() >= ballast.nbytes

    idle, busy = memory.peak_of(_allocate, 1), memory.peak_of(_allocate, 300 * MB)
    assert busy - idle == pytest.approx(300 * MB, abs=10 * MB)
    assert idle < ballast.nbytes


class _ShapeError(Exception):
    """An exception that pickles but does not unpickle: its constructor's arguments are not its
    `args`."""

    def __init__(self, shape, dtype):
        super().__init__(f"cannot hold {shape} values of {dtype}")


def _fail(shape):
    raise _ShapeError(shape, "int8")


def test_what_a_process_of_its_own_raises_is_raised_here():
    with pytest.raises(MemoryError, match="^Unable to allocate 1.00 EiB for an array"):
        memory.peak_of(_allocate, 1 << 60)
    with pytest.raises(RuntimeError, match=r"(?s)^Traceback.*_ShapeError: cannot hold \(3,\)"):
        memory.peak_of(_fail, (3,))
    with pytest.raises(RuntimeError, match="^the process measuring _exit ended with exit code 3 "
                                           "before reporting its peak$"):
        memory.peak_of(os._exit, 3)  # As the kernel's out-of-memory killer leaves it: no word.


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    result = cli_runs.run("mixloop.train", f"--config={TINY_CONFIG}", f"--workdir={workdir}",
                          "--config.train.num_steps=20", "--config.jit_compile=False")
    assert result.returncode == 0, result.stderr
    return workdir, result


def test_a_run_logs_its_persistent_state_once_at_the_start(short_run):
    _, result = short_run
    lines = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if "] memory: " in line]
    # mixed_float16 keeps float32 master weights; Adam; two micro-batches in float32.
    assert lines == [f"memory: {TINY_PARAMETERS} parameters; persistent state 16.00 B/param "
                     f"(weights 4.00, optimizer state 8.00, accumulators 4.00, EMA 0.00) = 3.12 kB"]
    assert result.stderr.index("] memory: ") < result.stderr.index("] step 10/20")


def test_the_peak_is_written_to_tensorboard_at_every_progress_line(short_run):
    workdir, _ = short_run
    peaks = []
    for path in glob.glob(os.path.join(workdir, "train", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            peaks += [(event.step, float(tf.make_ndarray(value.tensor)))
                      for value in event.summary.value if value.tag == "memory/peak_bytes"]
    assert [step for step, _ in peaks] == [10, 20]
    # A TensorFlow process: hundreds of MB, never less later.
    assert 100 * MB < peaks[0][1] <= peaks[1][1] < 100_000 * MB


# tiny_experiment 512 wide: Dense(8 -> 512)'s kernel, 4,096 values, is the one tensor that int8
# moments quantize; the other 512 + 512 * 3 + 3 values keep float32 moments.
WIDE = {"model.width": 512}
WIDE_PARAMETERS = 8 * 512 + 512 + 512 * 3 + 3
INT8_MOMENTS = 2 * (4096 * 1 + 4096 // 256 * 4) + 2 * (512 + 512 * 3 + 3) * 4  # Codes, scales; float32.


def settings_of(options):
    return [option.settings for option in options]


def test_each_lighter_setting_is_counted_from_the_variables_shapes(tmp_path):
    trainer = make_trainer(tmp_path, **{"precision.policy": "float32", **WIDE})  # Adam, 2 micro-batches.
    options = memory.lighter_options(trainer.run)

    assert settings_of(options) == [
        {"precision.master_weights": "bfloat16"}, {"optimizer.state_dtype": "bfloat16"},
        {"optimizer.state_dtype": "int8"}, {"train.accumulation_dtype": "bfloat16"},
        # int8 moments weigh more than bfloat16 ones here, most values being in small tensors.
        {"optimizer.state_dtype": "bfloat16", "train.accumulation_dtype": "bfloat16"}]
    master, bfloat16, int8, accumulation, together = options
    parts = lambda option: list(option.state.part_bytes.values())
    P = WIDE_PARAMETERS
    assert master.needs == {"precision.policy": "mixed_bfloat16"}  # float32 computes in float32.
    assert parts(master) == [2 * P, 8 * P, 4 * P, 0]
    assert parts(bfloat16) == [4 * P, 4 * P, 4 * P, 0] and not bfloat16.needs
    assert parts(int8) == [4 * P, INT8_MOMENTS, 4 * P, 0] == [4 * P, 24_728, 4 * P, 0]
    assert parts(accumulation) == [4 * P, 8 * P, 2 * P, 0]
    assert parts(together) == [4 * P, 4 * P, 2 * P, 0] and not together.needs
    assert all(option.state.num_parameters == P for option in options)


@pytest.mark.parametrize("overrides, settings", [
    # SGD has no moments; master weights need a bfloat16 policy; one setting alone is no "together".
    ({"optimizer.name": "sgd"}, [{"precision.master_weights": "bfloat16"},
                                 {"train.accumulation_dtype": "bfloat16"}]),
    # One micro-batch keeps no accumulators; every tensor of 16 wide is under 4,096 values, so int8
    # saves nothing.
    ({"train.accumulation_steps": 1, "precision.policy": "mixed_bfloat16"},
     [{"precision.master_weights": "bfloat16"}, {"optimizer.state_dtype": "bfloat16"},
      {"precision.master_weights": "bfloat16", "optimizer.state_dtype": "bfloat16"}]),
])
def test_only_the_settings_that_make_a_run_lighter_are_listed(tmp_path, overrides, settings):
    options = memory.lighter_options(make_trainer(tmp_path, **overrides).run)
    assert settings_of(options) == settings
    assert not any(option.needs for option in options[1:])


@pytest.mark.parametrize("option_index", [2, 4], ids=["int8", "together"])
def test_a_run_built_with_a_lighter_setting_keeps_what_it_was_counted_to(tmp_path, option_index):
    overrides = {"precision.policy": "mixed_bfloat16", **WIDE}
    option = memory.lighter_options(make_trainer(tmp_path / "now", **overrides).run)[option_index]
    lighter = make_trainer(tmp_path / "lighter", **overrides, **option.settings)

    assert memory.persistent_state(lighter.run) == option.state
    # int8 moments weigh more than bfloat16 ones here: all together leaves nothing lighter, and
    # bfloat16 moments are lighter than int8 ones.
    assert settings_of(memory.lighter_options(lighter.run)) == (
        [] if option_index == 4 else [{"precision.master_weights": "bfloat16"},
                                      {"optimizer.state_dtype": "bfloat16"},
                                      {"train.accumulation_dtype": "bfloat16"},
                                      {"precision.master_weights": "bfloat16",
                                       "optimizer.state_dtype": "bfloat16",
                                       "train.accumulation_dtype": "bfloat16"}])


def test_a_process_started_by_a_larger_one_reports_its_own_peak():
    """Linux carries ru_maxrss across exec: a run's memory probe, started by a run (or a test
    worker) holding more, reported its parent's peak as its own."""
    ballast = np.ones(1500 * 2**20 // 8)  # 1.5 GiB, every page touched.
    child = subprocess.run(
        [sys.executable, "-c", "from mixloop.doctor import memory; print(memory.peak_bytes())"],
        capture_output=True, text=True, check=True)
    assert int(child.stdout.split()[-1]) < ballast.nbytes
