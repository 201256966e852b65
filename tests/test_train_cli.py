"""`python -m mixloop.train` end to end, and its one-line refusals of bad input."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import slow_start_experiment

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_CONFIG = os.path.join(TESTS_DIR, "tiny_experiment.py")

pytestmark = pytest.mark.slow


def cli_command(*args, prefix=()):
    """The command line and environment of `python -m mixloop.train args`, run via `prefix`."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    return [*prefix, sys.executable, "-m", "mixloop.train", *args], env


def run_cli(*args, cwd=None, prefix=()):
    command, env = cli_command(*args, prefix=prefix)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def snapshot(directory):
    """Every file under `directory` with its size and modification time."""
    found = {}
    for root, _, files in os.walk(directory):
        for name in files:
            stat = os.stat(os.path.join(root, name))
            found[os.path.join(root, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


def test_trains_end_to_end_with_default_workdir(tmp_path):
    result = run_cli(f"--config={TINY_CONFIG}", "--config.train.num_steps=20", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step 20/20" in result.stderr and "eval at step 20" in result.stderr
    workdir = tmp_path / "runs" / "tiny_experiment"
    assert {"config.json", "checkpoints", "model.keras"} <= set(os.listdir(workdir))


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("trained")
    result = run_cli(f"--config={TINY_CONFIG}", f"--workdir={workdir}", "--config.train.num_steps=10")
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.mark.parametrize("args, message", [
    (["--config=does/not/exist.py"], "config file 'does/not/exist.py' does not exist"),
    ([f"--config={TINY_CONFIG}", "--config.train.num_stpes=3"], "num_stpes"),
    ([f"--config={TINY_CONFIG}", "--config.trian.batch_size=8"],
     "unknown config key 'trian' in a --config override. Did you mean \"train\" instead of \"trian\"?"),
    ([f"--config={TINY_CONFIG}", "--config.workdir=/tmp/elsewhere"],
     "unknown config key 'workdir' in a --config override. The workdir is a flag of its own: "
     "use --workdir=PATH."),
    ([f"--config={TINY_CONFIG}", "--config.optimizer.beta_1=2.0"],
     "config.optimizer.beta_1=2.0 is not allowed: a number in [0, 1)"),
    ([f"--config={TINY_CONFIG}", "--config.precision.loss_scale=inf"],
     "config.precision.loss_scale='inf' is not allowed"),
    ([f"--config={TINY_CONFIG}", "--config.seed=-1"], "config.seed=-1 is not allowed"),
    ([f"--config={TINY_CONFIG}", "--config.precision.policy=mixed_float17"],
     "config.precision.policy='mixed_float17' is not allowed"),
    ([f"--config={TINY_CONFIG}", "--config.train.accumulation_steps=5"],
     "config.train.accumulation_steps=5 is not allowed: a divisor of train.batch_size=32"),
    ([f"--config={TINY_CONFIG}", "--config.train.num_steps=0"],
     "config.train.num_steps=0 is not allowed: a positive integer"),
    ([f"--config={TINY_CONFIG}", "--config.trainer=no_such_module.Trainer"],
     "config.trainer='no_such_module.Trainer' does not import"),
    ([f"--config={TINY_CONFIG}", "--config.model.width=32"], "does not match this run's model"),
    ([f"--config={TINY_CONFIG}", "--config.precision.float32_layers=dense_typo"],
     "config.precision.float32_layers='dense_typo' fully matches no layer path; paths look like: "),
    ([f"--config={TINY_CONFIG}", "--config.model.per_example_loss=True"],
     "compute_loss must return a scalar mean, (loss_sum, weight) or mixloop.Loss(value, weight, "
     "metrics) of scalars; the loss has shape (None,)"),
    ([f"--config={TINY_CONFIG}", "stray"],
     "unexpected argument 'stray': the command takes only flags (--config=PATH[:VARIANT], "
     "--workdir=DIR, --config.KEY=VALUE)"),
    ([f"--config={TINY_CONFIG}", "--config.model.width=0"],  # A value the experiment's model refuses.
     "build_model() failed: ValueError: Received an invalid value for `units`, expected a "
     f"positive integer. Received: units=0 (at {TESTS_DIR}/tiny_experiment.py:19); check the config "
     "values it reads (set on the command line: model.width=0)"),
])
def test_bad_input_is_one_line_and_leaves_the_workdir(trained_workdir, args, message):
    before = snapshot(trained_workdir)
    result = run_cli(*args, f"--workdir={trained_workdir}")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = error_lines(result)
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert snapshot(trained_workdir) == before


@pytest.fixture
def trained_copy(trained_workdir, tmp_path):
    """A copy of the trained workdir, for a test to damage."""
    return shutil.copytree(trained_workdir, tmp_path / "run")


def _lock_folder(run):
    (run / ".lock").mkdir()
    (run / ".lock" / "notes.txt").write_text("kept\n")
    return run


def _garbled_config(run):
    (run / "config.json").write_text("{garbled")
    return run


@pytest.mark.parametrize("make_workdir, message", [
    (lambda run: run / "config.json", "the workdir {workdir} is a file, not a folder; choose another "
                                      "--workdir"),
    (lambda run: run / "config.json" / "next", "the workdir {workdir} is under {run}/config.json, "
                                               "which is a file, not a folder; choose another --workdir"),
    (_lock_folder, "{run}/.lock is a folder, where mixloop keeps the workdir's lock file; move it "
                   "away, or choose another --workdir"),
    (_garbled_config, "{run}/config.json is not valid JSON (Expecting property name enclosed in "
                      "double quotes: line 1 column 2 (char 1)); it records the config of the run in "
                      "this workdir: repair or move it, or choose another --workdir"),
], ids=["a regular file", "under a file", ".lock a folder", "config.json not JSON"])
def test_an_unusable_workdir_is_one_line_and_loses_nothing(trained_copy, make_workdir, message):
    workdir = make_workdir(trained_copy)
    before = snapshot(trained_copy)
    result = run_cli(f"--config={TINY_CONFIG}", f"--workdir={workdir}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == ["error: " + message.format(workdir=workdir, run=trained_copy)]
    assert snapshot(trained_copy) == before


def _without_root_file_access():
    """A prefix that runs a command as root without its power to bypass file permissions (what a
    chmod means to everyone else), or None when that cannot be had."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--")
    if shutil.which("setpriv") and subprocess.run([*prefix, "true"]).returncode == 0:
        return prefix
    return None


def _chmod_folders(directory, mode):
    for folder, _, _ in os.walk(directory):
        os.chmod(folder, mode)


def test_a_read_only_workdir_is_one_line_and_loses_nothing(trained_copy):
    prefix = _without_root_file_access()
    if prefix is None:
        pytest.skip("runs as root and setpriv cannot drop the file-permission capabilities")
    _chmod_folders(trained_copy, 0o555)
    before = snapshot(trained_copy)
    try:
        result = run_cli(f"--config={TINY_CONFIG}", f"--workdir={trained_copy}",
                         "--config.train.num_steps=20", prefix=prefix)
    finally:
        _chmod_folders(trained_copy, 0o755)

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [f"error: cannot write to the workdir {trained_copy}: Permission "
                                   f"denied ({trained_copy}/.lock); choose a --workdir you can write to"]
    assert snapshot(trained_copy) == before


def _catches(pid, signal_number):
    """Whether process `pid` has a handler installed for `signal_number` (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signal_number - 1) & 1)


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_startup_is_one_line_and_writes_nothing(tmp_path, signal_number):
    """SIGINT while TensorFlow imports (right after `mixloop` armed its handlers, which it does
    before importing TensorFlow), SIGTERM while the experiment builds its model."""
    workdir = tmp_path / "run"
    config = TINY_CONFIG if signal_number == signal.SIGINT else slow_start_experiment.__file__
    command, env = cli_command(f"--config={config}", f"--workdir={workdir}")
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        if signal_number == signal.SIGINT:  # Python alone catches only SIGINT.
            while process.poll() is None and not _catches(process.pid, signal.SIGTERM):
                time.sleep(0.01)
        else:
            while (line := process.stderr.readline()) and slow_start_experiment.BUILDING not in line:
                pass
        process.send_signal(signal_number)
        stderr = process.communicate(timeout=60)[1]
    finally:
        process.kill()

    assert process.returncode == 128 + signal_number
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: interrupted by {signal.Signals(signal_number).name} before training started; "
        "nothing was written"]
    assert not workdir.exists()


def test_deterministic_with_xla_on_a_max_pool_model_is_one_line_naming_jit_compile(tmp_path):
    digits = os.path.join(TESTS_DIR, "..", "experiments", "digits.py")
    result = run_cli(f"--config={digits}:quick", f"--workdir={tmp_path}", "--config.deterministic=True",
                     cwd=os.path.join(TESTS_DIR, ".."))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: the train step failed near step 1: GPU MaxPool gradient ops do not yet "
                      "have a deterministic XLA implementation. (the step is compiled with XLA; "
                      "--config.jit_compile=False runs it without)"]
    assert "Traceback" not in result.stderr


def test_a_loaded_teacher_is_named_in_the_placement_line_with_why_it_computes_in_float32(tmp_path):
    import keras

    inputs = keras.Input((8,))  # Built under float32: the .keras file saves each layer's policy.
    teacher = keras.Model(inputs, keras.layers.Dense(4, name="scores")(inputs), name="teacher")
    teacher.save(tmp_path / "teacher.keras")
    config = os.path.join(TESTS_DIR, "loaded_model_experiment.py")
    result = run_cli(f"--config={config}", f"--workdir={tmp_path / 'run'}",
                     f"--config.model.teacher_path={tmp_path / 'teacher.keras'}")
    assert result.returncode == 0, result.stderr[-3000:]
    [placement] = [line.split("] ", 1)[1] for line in result.stderr.splitlines()
                   if "Layers computing in float32" in line]
    assert placement == ("Layers computing in float32, the rest in float16: 1 by named logits "
                         "(logits); 1 by its own dtype policy (set in its code, or saved with a "
                         "loaded model) (teacher/scores)")


def test_an_export_without_get_config_is_one_whole_line_saying_what_to_add(tmp_path):
    config = os.path.join(TESTS_DIR, "loaded_model_experiment.py")
    result = run_cli(f"--config={config}:subclassed", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    [warning] = [line.split("] ", 1)[1] for line in result.stderr.splitlines()
                 if "Could not export" in line]
    assert warning == (
        "Could not export the model (the checkpoints hold the trained weights): "
        "NotImplementedError: Object TwoLayers was created by passing non-serializable argument "
        "values in `__init__()`, and therefore the object must override `get_config()` in order "
        "to be serializable. Please implement `get_config()`. Add to TwoLayers a get_config() that "
        "returns its __init__ arguments, e.g. `return {**super().get_config(), \"width\": "
        "self.width}`, and register it with @keras.saving.register_keras_serializable() (as "
        "gan_digits' GAN).")
    assert not (tmp_path / "model.keras").exists()
