"""Kill at any moment: SIGTERM and Ctrl-C save and exit 0; SIGKILL (mid-loop or mid-checkpoint
write) loses nothing but time. Every restart ends bit-identical to an uninterrupted run."""

import glob
import os
import re
import signal
import subprocess
import threading
import time

import cli_runs
import numpy as np
import pytest
import tensorflow as tf

FIXTURES_DIR = cli_runs.FIXTURES_DIR
FAULTY_CONFIG = os.path.join(FIXTURES_DIR, "faulty_experiment.py")
# Slow enough steps and checkpoints to be hit mid-way: 8 MB of ballast per checkpoint. Without XLA
# and without the float16 probes (fixed placement and scale): each of the file's 8 runs starts in
# seconds instead of paying an XLA compile and a probe that kills and resumes do not depend on
# (tests/test_compile_mode.py and tests/test_auto_precision.py resume those).
RUN_FLAGS = ["--config.train.num_steps=240", "--config.model.width=64", "--config.model.depth=3",
             "--config.checkpoint.every_steps=40", "--config.model.ballast=2000000",
             "--config.train.log_every_steps=8", "--config.jit_compile=False",
             "--config.precision.float32_layers=", "--config.precision.initial_scale=32768"]

pytestmark = pytest.mark.slow


class Run:
    """`python -m mixloop.train` on the faulty experiment, with its stderr read as it comes."""

    def __init__(self, workdir, *flags):
        self.process = cli_runs.start("mixloop.train", f"--config={FAULTY_CONFIG}",
                                      f"--workdir={workdir}", *RUN_FLAGS, *flags)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, text, timeout=120):
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, "".join(self.lines[-20:])
            assert time.monotonic() < deadline, f"no {text!r} in time"
            time.sleep(0.005)

    def finish(self, timeout=300):
        self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.process.returncode, "".join(self.lines)


def final_state(workdir):
    """Every model and optimizer tensor of the newest checkpoint."""
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model_variables/", "objectives/"))}


def assert_every_checkpoint_restores(workdir):
    for index in glob.glob(os.path.join(workdir, "checkpoints", "ckpt-*.index")):
        reader = tf.train.load_checkpoint(index[:-len(".index")])
        dtypes = reader.get_variable_to_dtype_map()
        assert any(name.startswith("train_iterator/") for name in dtypes)
        for name, dtype in dtypes.items():
            if dtype != tf.variant:  # The data position, only restorable into an iterator.
                reader.get_tensor(name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reference")
    code, output = Run(workdir).finish()
    assert code == 0, output
    return final_state(workdir)


def wait_until_saved(process, workdir, step):
    """Waits until checkpoint `step` is whole: the checkpoint state file names it once the save is
    complete (its index file appears mid-write)."""
    state_file = workdir / "checkpoints" / "checkpoint"
    deadline = time.monotonic() + 240
    while not (state_file.exists() and f'"ckpt-{step}"' in state_file.read_text()):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)


def assert_same_state(workdir, reference):
    state = final_state(workdir)
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)


def kill_after_checkpoint_and_resume(command, tmp_path, step, cwd=None):
    """Runs the command line `command(workdir)` to its end in `tmp_path / "straight"`; in
    `tmp_path / "killed"` SIGKILLs it once checkpoint `step` is whole, then runs it again to its end.
    Asserts both runs' ends bit-identical; returns the step of the checkpoint the second run restored
    (`step` or later)."""
    straight = cli_runs.run(*command(tmp_path / "straight"), cwd=cwd)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = cli_runs.start(*command(tmp_path / "killed"), cwd=cwd, stderr=subprocess.DEVNULL)
    wait_until_saved(killed, tmp_path / "killed", step)
    killed.kill()
    killed.wait(timeout=60)
    resumed = cli_runs.run(*command(tmp_path / "killed"), cwd=cwd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checkpoints = re.escape(str(tmp_path / "killed" / "checkpoints"))
    restored = re.search(rf"Restored {checkpoints}/ckpt-(\d+)", resumed.stderr)
    assert restored and int(restored.group(1)) >= step, resumed.stderr[-3000:]
    assert_same_state(tmp_path / "killed", final_state(tmp_path / "straight"))
    return int(restored.group(1))


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_save_and_exit_cleanly(tmp_path, reference, signal_number):
    run = Run(tmp_path)
    run.wait_for("step 96/240")
    run.process.send_signal(signal_number)
    code, output = run.finish()

    assert code == 0, output
    stopped = [line for line in output.splitlines() if "Stopped by" in line]
    assert len(stopped) == 1 and signal.Signals(signal_number).name in stopped[0]
    assert "Run the same command to resume" in stopped[0]
    step = int(stopped[0].split(" at step ")[1].split(";")[0])
    assert 96 <= step < 240
    assert tf.train.latest_checkpoint(tmp_path / "checkpoints").endswith(f"ckpt-{step}")

    code, output = Run(tmp_path).finish()
    assert code == 0, output
    assert_same_state(tmp_path, reference)


def kill_mid_loop(run, workdir):
    run.wait_for("step 64/240")
    time.sleep(0.05)


def kill_mid_checkpoint_write(run, workdir):
    """Waits until TensorFlow's temporary checkpoint files exist: the write is under way."""
    pattern = os.path.join(workdir, "checkpoints", "*_temp*")
    deadline = time.monotonic() + 120
    while not glob.glob(pattern):
        assert run.process.poll() is None and time.monotonic() < deadline, "".join(run.lines[-20:])
        time.sleep(0.001)


def test_sigkill_anywhere_loses_nothing(tmp_path, reference):
    kills = 0
    for wait in (kill_mid_loop, kill_mid_checkpoint_write, kill_mid_checkpoint_write):
        run = Run(tmp_path)
        wait(run, tmp_path)
        run.process.kill()
        code, _ = run.finish()
        assert code == -signal.SIGKILL
        kills += 1
        assert_every_checkpoint_restores(tmp_path)
    code, output = Run(tmp_path).finish()
    assert code == 0, output
    assert "Removing the stale lock" in output
    assert kills == 3
    assert_every_checkpoint_restores(tmp_path)
    assert_same_state(tmp_path, reference)


def test_sigkill_keeps_the_cadence_of_an_objective_every_5_steps(tmp_path):
    """wgan_gp_digits' generator updates every 5 steps: killed after the checkpoint of step 48 and
    resumed, the run goes on with the generator's updates at 50, 55, ... and ends bit-identical to
    a straight run (its optimizer iterations, slots and loss scale included)."""
    repo = cli_runs.REPO

    def command(workdir):
        # Without XLA and the float16 probes: the cadence depends on neither, and each run starts
        # without an XLA compile of the penalty's double backward or a probe (half a run's time).
        return ["mixloop.train", "--config=experiments/wgan_gp_digits.py:quick",
                f"--workdir={workdir}", "--config.checkpoint.every_steps=48", "--config.jit_compile=False",
                "--config.precision.float32_layers=", "--config.precision.initial_scale=16384"]

    assert kill_after_checkpoint_and_resume(command, tmp_path, 48, cwd=repo) == 48
    assert any(name.startswith("objectives/generator") for name in final_state(tmp_path / "killed"))


def test_sigkill_resumes_float8_training_bit_identical(tmp_path):
    """Keras's float8 layers in mixed_float16 (tests/fixtures/float8_experiment.py): killed after the
    checkpoint of step 10 and resumed, every scale and amax history ends as in a straight run."""
    def command(workdir):
        # Without the float16 probes, which the float8 state does not depend on.
        return ["mixloop.train", f"--config={os.path.join(FIXTURES_DIR, 'float8_experiment.py')}:quick",
                f"--workdir={workdir}", "--config.jit_compile=False",
                "--config.precision.float32_layers=", "--config.precision.initial_scale=32768"]

    assert kill_after_checkpoint_and_resume(command, tmp_path, 10) == 10
    state = final_state(tmp_path / "killed")
    histories = [value for value in state.values() if value.shape == (1024,)]  # Keras's amax length.
    assert len(histories) == 9 and all(history[0] > 0 for history in histories)  # 3 layers, trained.


def test_sigkill_resumes_a_lighter_run_bit_identical(tmp_path):
    """Every lighter-run option on (issue 34): bfloat16 weights (the logits read theirs cast up
    to float32), int8 Adam moments (the hidden kernel's 8 x 512 = 4096 values, the smallest size
    quantized), bfloat16 accumulators over 2 micro-batches, Dense and Dropout recomputed, an EMA.
    Killed after a checkpoint and resumed, the weights, the uint8 codes and float32 scales, the
    other moments and the averages end as in a straight run: every stochastic rounding is keyed by
    checkpointed counters, and the recomputed dropout redraws the forward's mask."""
    def command(workdir):
        # 400 quick updates, a checkpoint every 40: the kill lands long before the end.
        return ["mixloop.train", f"--config={cli_runs.TINY_CONFIG}", f"--workdir={workdir}",
                "--config.model.width=512", "--config.precision.policy=mixed_bfloat16",
                "--config.precision.master_weights=bfloat16", "--config.optimizer.state_dtype=int8",
                "--config.train.accumulation_dtype=bfloat16", "--config.train.recompute=dense|dropout",
                "--config.train.ema_decay=0.99", "--config.train.num_steps=400",
                "--config.train.steps_per_loop=20", "--config.train.log_every_steps=200",
                "--config.eval.every_steps=400", "--config.checkpoint.every_steps=40",
                "--config.jit_compile=False"]

    def averages(workdir):
        reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints"))
        return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
                if name.startswith("ema/")}

    assert kill_after_checkpoint_and_resume(command, tmp_path, 40) < 400
    dtypes = {value.dtype.name for value in final_state(tmp_path / "killed").values()}
    assert {"bfloat16", "uint8"} <= dtypes, dtypes
    expected, actual = averages(tmp_path / "straight"), averages(tmp_path / "killed")
    assert len(expected) == 4 and actual.keys() == expected.keys()
    for name, value in expected.items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(actual[name], value, err_msg=name)


def test_sigkill_resumes_a_momentum_target_bit_identical(tmp_path):
    """byol_digits (issue 35): the target network follows the online one through
    `Objective(after_update=...)` inside the compiled step, in mixed_float16 with 2 micro-batches.
    Killed after a checkpoint and resumed, the target (and all else) ends as in a
    straight run: the hook writes only checkpointed variables, once per applied update."""
    repo = cli_runs.REPO

    def command(workdir):
        # Without XLA and the float16 probes, which the target does not depend on.
        return ["mixloop.train", "--config=experiments/byol_digits.py:quick", f"--workdir={workdir}",
                "--config.precision.policy=mixed_float16", "--config.train.accumulation_steps=2",
                "--config.jit_compile=False", "--config.precision.float32_layers=",
                "--config.precision.initial_scale=32768", "--config.train.num_steps=200",
                "--config.eval.every_steps=200", "--config.checkpoint.every_steps=20"]

    assert kill_after_checkpoint_and_resume(command, tmp_path, 20, cwd=repo) < 200
