"""`python -m mixloop.train` end to end, and its one-line refusals of bad input."""

import cli_runs
import json
import os
import shutil
import signal
import time

import hooks_experiment
import pytest
import slow_start_experiment

from cli_runs import (FIXTURES_DIR, TINY_CONFIG, checkpoint_steps, error_lines, interrupted, run,
                      snapshot, start, without_root_file_access)

HOOKS_CONFIG = hooks_experiment.__file__
FAULTY_CONFIG = os.path.join(FIXTURES_DIR, "faulty_experiment.py")
# The line of hooks_experiment.py whose RuntimeError a failing action raises.
ACTION_RAISES_AT = next(number for number, line in enumerate(open(HOOKS_CONFIG), 1)
                        if "raise RuntimeError" in line)
# The line of hooks_experiment.py where its Python-loop loss reads the batch size.
LOSS_LOOPS_AT = next(number for number, line in enumerate(open(HOOKS_CONFIG), 1)
                     if "for row in range(labels.shape[0])" in line)
EMPTY_TRAIN = ("the train dataset is empty: build_datasets() returned one with no batches (batched "
               "with drop_remainder=True, fewer than config.train.batch_size={} examples make none)")
CONFIG_ADVICE = ("the experiment's ml_collections.ConfigDict (start from "
                 "mixloop.config.base_config())")

pytestmark = pytest.mark.slow


def run_cli(*args, **options):
    return run("mixloop.train", *args, **options)


def test_trains_end_to_end_with_default_workdir(tmp_path):
    result = run_cli(f"--config={TINY_CONFIG}", "--config.train.num_steps=20", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "step 20/20" in result.stderr and "eval at step 20" in result.stderr
    workdir = tmp_path / "runs" / "tiny_experiment"
    assert {"config.json", "checkpoints", "model.keras"} <= set(os.listdir(workdir))


def test_a_loss_looping_over_its_batch_in_python_trains(tmp_path):
    """compute_loss reads its micro-batch size as a Python int (mixed_float16's probe included)."""
    result = run_cli(f"--config={HOOKS_CONFIG}", "--config.model.python_loop_loss=True",
                     "--config.train.num_steps=4", f"--workdir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "step 4/4" in result.stderr


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
     "metrics) of scalars; the loss has shape (16,)"),  # A micro-batch of 32 / 2.
    ([f"--config={TINY_CONFIG}", "stray"],
     "unexpected argument 'stray': the command takes only flags (--config=PATH[:VARIANT], "
     "--workdir=DIR, --config.KEY=VALUE)"),
    ([f"--config={TINY_CONFIG}", "--config.model.width=0"],  # A value the experiment's model refuses.
     "build_model() failed: ValueError: Received an invalid value for `units`, expected a "
     f"positive integer. Received: units=0 (at {FIXTURES_DIR}/tiny_experiment.py:19); check the config "
     "values it reads (set on the command line: model.width=0)"),
    ([f"--config={TINY_CONFIG}", "--config.precision.policy=float32", "--config.model.width=0",
      "--config.train.log_every_steps=5"],  # Only the override the failing code read is named.
     f"(at {FIXTURES_DIR}/tiny_experiment.py:19); check the config values it reads (set on the command "
     "line: model.width=0)"),
])
def test_bad_input_is_one_line_and_leaves_the_workdir(trained_workdir, args, message):
    before = snapshot(trained_workdir)
    result = run_cli(*args, f"--workdir={trained_workdir}")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = error_lines(result)
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert snapshot(trained_workdir) == before


@pytest.fixture(scope="module")
def bad_configs(tmp_path_factory):
    """Config files that make no config: no get_config, a get_config returning None, a folder."""
    folder = tmp_path_factory.mktemp("configs")
    (folder / "no_get_config.py").write_text(
        "from mixloop.config import base_config\n\n\ndef make_config():\n    return base_config()\n")
    (folder / "returns_none.py").write_text("def get_config(arg=None):\n    config = 1\n")
    (folder / "a_folder").mkdir()
    return folder


@pytest.mark.parametrize("args, message", [
    ([f"--config={TINY_CONFIG}", "--config.train.batch_size=1024"], EMPTY_TRAIN.format(1024)),
    ([f"--config={TINY_CONFIG}", "--config.train.batch_size=1024",
      "--config.train.repeat_dataset=False"], EMPTY_TRAIN.format(1024)),
    ([f"--config={HOOKS_CONFIG}", "--config.model.objectives=frozen"],
     "objective 'model' has no trainable variables: its layer 'dropout' holds none that train (it "
     "has no weights, is frozen with trainable=False, or is not built yet); give it a built layer "
     "whose weights train"),
    ([f"--config={HOOKS_CONFIG}", "--config.model.objectives=shared"],
     "objectives 'a' and 'b' both train logits/kernel: a variable belongs to one objective (two "
     "would each apply their own optimizer's update to it every step); give them layers that share "
     "no weights, or make one objective whose loss adds both"),
    ([f"--config={HOOKS_CONFIG}", "--config.model.python_loop_loss=True",
      "--config.model.unknown_label_batch=True"],
     "compute_loss failed on a batch whose batch dimension is unknown (element [1] of shape "
     "(None,)): TypeError: 'NoneType' object cannot be interpreted as an integer (at "
     f"{HOOKS_CONFIG}:{LOSS_LOOPS_AT}); give every element of the train data a static batch "
     "dimension (batch with drop_remainder=True; after a map, set_shape), or read the batch size "
     "as tf.shape(x)[0]"),
    (["--config={configs}/no_get_config.py"],
     f"config file '{{configs}}/no_get_config.py' defines no get_config(); define "
     f"get_config(arg=None) returning {CONFIG_ADVICE}"),
    (["--config={configs}/returns_none.py"],
     f"get_config() in config file '{{configs}}/returns_none.py' returned None (a missing "
     f"return?); return {CONFIG_ADVICE}"),
    (["--config={configs}/a_folder", "--config.train.num_steps=3"],
     "config file '{configs}/a_folder' is a folder; --config=PATH[:VARIANT] names a Python file "
     "that defines get_config(arg=None), such as experiments/digits.py"),
    ([f"--config={HOOKS_CONFIG}:own_dict"],
     "config.checkpoint is missing: the config must hold every framework key; start get_config() "
     "from mixloop.config.base_config() and change what the experiment needs"),
], ids=["empty train set", "empty train set not repeated", "objective without variables",
        "one layer in two objectives", "a loss looping over an unknown batch", "no get_config", "get_config returns None",
        "config a folder", "a plain dict of its own"])
def test_a_mistake_in_the_experiment_is_one_line_before_anything_is_written(
        tmp_path, bad_configs, args, message):
    workdir = tmp_path / "run"
    result = run_cli(*[arg.format(configs=bad_configs) for arg in args], f"--workdir={workdir}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == ["error: " + message.format(configs=bad_configs)], result.stderr
    assert not workdir.exists()


@pytest.mark.parametrize("args, message, kept", [
    ([f"--config={HOOKS_CONFIG}", "--config.model.action=raise_every"],
     "action sample (every 15 updates) failed at step 30: RuntimeError: no sample at step 30 (at "
     f"{HOOKS_CONFIG}:{ACTION_RAISES_AT}); the last checkpoint ({{workdir}}/checkpoints/ckpt-20) is "
     "kept", [20]),
    ([f"--config={HOOKS_CONFIG}", "--config.model.action=raise_at_eval"],
     "action sample (at eval) failed at step 40: RuntimeError: no sample at step 40 (at "
     f"{HOOKS_CONFIG}:{ACTION_RAISES_AT}); the last checkpoint ({{workdir}}/checkpoints/ckpt-20) is "
     "kept", [20]),
    ([f"--config={FAULTY_CONFIG}", "--config.data.label_offset=1", "--config.jit_compile=False"],
     "the train step failed near step 1: indices[3] = 3 is not in [0, 3) (an integer input, such "
     "as a label, outside its valid range)", []),
    ([f"--config={FAULTY_CONFIG}", "--config.data.eval_label_offset=1"],  # Eval: never XLA.
     "the eval step failed at step 24: indices[3] = 3 is not in [0, 3) (an integer input, such as "
     "a label, outside its valid range); the last checkpoint ({workdir}/checkpoints/ckpt-20) is "
     "kept", [12, 16, 20]),
    ([f"--config={FAULTY_CONFIG}", "--config.data.generator=True", "--config.train.batch_size=64",
      "--config.data.num_examples=48", "--config.data.num_eval=48"],  # Repeated, of unknown length.
     EMPTY_TRAIN.format(64), []),
], ids=["an action raises", "an eval-time action raises", "labels out of range",
        "eval labels out of range", "empty generator, repeated"])
def test_a_failure_mid_run_is_one_line_and_keeps_the_last_checkpoint(tmp_path, args, message, kept):
    workdir = tmp_path / "run"
    result = run_cli(*args, f"--workdir={workdir}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == ["error: " + message.format(workdir=workdir)], result.stderr
    assert checkpoint_steps(workdir) == kept
    assert not (workdir / "model.keras").exists() and not (workdir / ".lock").exists()


def test_one_action_alone_and_a_plain_dict_config_are_taken(tmp_path):
    result = run_cli(f"--config={HOOKS_CONFIG}:dict", "--config.model.action=single",
                     "--config.train.num_steps=20", f"--workdir={tmp_path}")

    assert result.returncode == 0, result.stderr
    assert "The single action ran at step 20" in result.stderr
    assert checkpoint_steps(tmp_path) == [20] and (tmp_path / "model.keras").exists()


def test_a_stop_waits_for_a_running_action_and_says_so(tmp_path):
    returncode, stderr = interrupted(
        "mixloop.train", f"--config={HOOKS_CONFIG}", "--config.model.action=slow",
        "--config.model.action_seconds=2", f"--workdir={tmp_path}", signal_number=signal.SIGTERM,
        after=hooks_experiment.ACTION_STARTED)

    assert returncode == 0, stderr
    assert ("SIGTERM received while action sleep (every 5 updates) runs at step 5: the checkpoint "
            "and the stop wait until it returns (a grace period shorter than the action ends the run "
            "without them)") in stderr
    assert f"Stopped by SIGTERM at step 5; checkpoint saved in {tmp_path}/checkpoints" in stderr
    assert checkpoint_steps(tmp_path) == [5]


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


def _array_config(run):
    (run / "config.json").write_text("[1, 2]")
    return run


def _file_at(name):
    """Puts a file where the workdir's folder `name` is (or would be)."""
    def replace(run):
        shutil.rmtree(run / name, ignore_errors=True)
        (run / name).write_text("a file\n")
        return run
    return replace


def _hand_edited_record(run):
    """config.json as a run with precision.float32_layers=auto writes it, its record naming a layer
    the model does not have."""
    config = json.loads((run / "config.json").read_text())
    config["precision"]["float32_layers"] = "auto"
    config["resolved"] = {"precision.float32_layers": "dense_typo"}
    (run / "config.json").write_text(json.dumps(config))
    return run


def _model_keras_folder(run):
    (run / "model.keras").unlink()
    (run / "model.keras").mkdir()
    return run


def _misplaced(name, holds, wanted="a folder"):
    kind = "a file" if wanted == "a folder" else "a folder"
    return (f"{{run}}/{name} is {kind}, where mixloop keeps {holds} ({wanted}); move it away, or "
            "choose another --workdir")


@pytest.mark.parametrize("make_workdir, message, overrides", [
    (lambda run: run / "config.json", "the workdir {workdir} is a file, not a folder; choose another "
                                      "--workdir", ()),
    (lambda run: run / "config.json" / "next", "the workdir {workdir} is under {run}/config.json, "
                                               "which is a file, not a folder; choose another --workdir",
     ()),
    (_lock_folder, "{run}/.lock is a folder, where mixloop keeps the workdir's lock file; move it "
                   "away, or choose another --workdir", ()),
    (_garbled_config, "{run}/config.json is not valid JSON (Expecting property name enclosed in "
                      "double quotes: line 1 column 2 (char 1)); it records the config of the run in "
                      "this workdir: repair or move it, or choose another --workdir", ()),
    (_array_config, "{run}/config.json holds an array, not a JSON object of config keys; "
                             "it records the config of the run in this workdir: repair or move it, "
                             "or choose another --workdir", ()),
    (_file_at("train"), _misplaced("train", "the train TensorBoard summaries"), ()),
    (_file_at("eval"), _misplaced("eval", "the eval TensorBoard summaries"), ()),
    (_file_at("checkpoints"), _misplaced("checkpoints", "the run's checkpoints"), ()),
    (_file_at("precision"), _misplaced("precision", "the precision probe's reports"), ()),
    (_model_keras_folder, _misplaced("model.keras", "the exported model", wanted="a file"), ()),
    (_hand_edited_record, "{run}/config.json: its resolved record precision.float32_layers="
                          "'dense_typo' fully matches no layer path; paths look like: dense, "
                          "dropout, logits (a regex over the whole path, e.g. '.*softmax.*'); "
                          "repair the record or remove it",
     ("--config.train.num_steps=10", "--config.precision.float32_layers=auto")),
], ids=["a regular file", "under a file", ".lock a folder", "config.json not JSON",
        "config.json an array", "train a file", "eval a file", "checkpoints a file",
        "precision a file", "model.keras a folder", "a record naming no layer"])
def test_an_unusable_workdir_is_one_line_and_loses_nothing(trained_copy, make_workdir, message,
                                                           overrides):
    workdir = make_workdir(trained_copy)
    before = snapshot(trained_copy)
    result = run_cli(f"--config={TINY_CONFIG}", f"--workdir={workdir}", *overrides)

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == ["error: " + message.format(workdir=workdir, run=trained_copy)]
    assert snapshot(trained_copy) == before


def _chmod_folders(directory, mode):
    for folder, _, _ in os.walk(directory):
        os.chmod(folder, mode)


@pytest.mark.parametrize("folder, message", [
    ("", "cannot write to the workdir {run}: Permission denied ({run}/.lock); choose a --workdir "
         "you can write to"),
    ("train", "cannot write to {run}/train, where mixloop keeps the train TensorBoard summaries: "
              "Permission denied; make it writable, or choose another --workdir"),
    ("checkpoints", "cannot write to {run}/checkpoints, where mixloop keeps the run's checkpoints: "
                    "Permission denied; make it writable, or choose another --workdir"),
], ids=["the workdir", "train", "checkpoints"])  # eval/ is checked as train/ is.
def test_a_read_only_workdir_is_one_line_and_loses_nothing(trained_copy, folder, message):
    prefix = without_root_file_access()
    if prefix is None:
        pytest.skip("runs as root and setpriv cannot drop the file-permission capabilities")
    _chmod_folders(trained_copy / folder, 0o555)
    before = snapshot(trained_copy)
    try:
        result = run_cli(f"--config={TINY_CONFIG}", f"--workdir={trained_copy}",
                         "--config.train.num_steps=20", prefix=prefix)
    finally:
        _chmod_folders(trained_copy, 0o755)

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == ["error: " + message.format(run=trained_copy)]
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
    # A fresh interpreter: the SIGINT comes while it imports TensorFlow.
    process = start("mixloop.train", f"--config={config}", f"--workdir={workdir}", fresh=True)
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

    assert process.returncode == 128 + signal_number, stderr[-3000:]
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == [
        f"error: interrupted by {signal.Signals(signal_number).name} before training started; "
        "nothing was written"]
    assert not workdir.exists()


def test_deterministic_with_xla_on_a_max_pool_model_is_one_line_naming_jit_compile(tmp_path):
    digits = os.path.join(cli_runs.REPO, "experiments", "digits.py")
    # float32: no known rule keeps it from XLA (float16 on a CPU takes graph mode).
    result = run_cli(f"--config={digits}:quick", f"--workdir={tmp_path}", "--config.deterministic=True",
                     "--config.precision.policy=float32", cwd=cli_runs.REPO)
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
    config = os.path.join(FIXTURES_DIR, "loaded_model_experiment.py")
    result = run_cli(f"--config={config}", f"--workdir={tmp_path / 'run'}",
                     f"--config.model.teacher_path={tmp_path / 'teacher.keras'}")
    assert result.returncode == 0, result.stderr[-3000:]
    [placement] = [line.split("] ", 1)[1] for line in result.stderr.splitlines()
                   if "Layers computing in float32" in line]
    assert placement == ("Layers computing in float32, the rest in float16: 1 by named logits "
                         "(logits); 1 by its own dtype policy (set in its code, or saved with a "
                         "loaded model) (teacher/scores)")


def test_an_export_without_get_config_is_one_whole_line_saying_what_to_add(tmp_path):
    config = os.path.join(FIXTURES_DIR, "loaded_model_experiment.py")
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


MISUSE_CONFIG = os.path.join(FIXTURES_DIR, "misuse_experiment.py")


def misuse_line(misuse):
    """'(at <misuse_experiment.py>:<line>)': where the penalty for `misuse` calls the helper."""
    lines = open(MISUSE_CONFIG).read().splitlines()
    start = lines.index(f'        if misuse == "{misuse}":')
    return f"(at {MISUSE_CONFIG}:{start + 2})"


HELPER_ADVICE = "; check the config values it reads (set on the command line: model.misuse={})"


@pytest.mark.parametrize("misuse, message", [
    ("policy_string", "TypeError: mixloop.forward: policy='mixed_float16' is a str, not a "
     "mixloop.Policy; pass self.policy (the run's), or mixloop.Policy.from_string(...)"),
    ("no_training", "TypeError: mixloop.forward: training=None; pass training=True (dropout and "
     "BatchNorm as in training, inside compute_loss) or training=False"),
    ("unrelated_input", "ValueError: mixloop.input_gradients: fn's output does not depend on "
     "inputs; fn must run the model on the tensor it is given (lambda x: mixloop.forward(model, "
     "self.policy, x, training=True)), not on another"),
    ("integer_inputs", "TypeError: mixloop.input_gradients: inputs of dtype int32 have no "
     "gradient; pass floating inputs (for integer ids, differentiate with respect to their "
     "embeddings)"),
    ("dict_fn", "TypeError: mixloop.input_gradients: fn returned a dict (keys ['score']); return "
     "the one output to differentiate (lambda x: model(x)['score'])"),
    ("zero_scale", "ValueError: mixloop.input_gradients: scale=0 is not allowed: a positive finite "
     "number (the inner backward's loss scale; 1 for none)"),
    ("variable_zero_scale", "ValueError: mixloop.input_gradients: scale=0.0 is not allowed: a "
     "positive finite number (the inner backward's loss scale; 1 for none)"),
])
def test_a_public_helper_misused_in_a_traced_loss_is_one_line(tmp_path, misuse, message):
    result = run_cli(f"--config={MISUSE_CONFIG}", f"--config.model.misuse={misuse}",
                     f"--workdir={tmp_path}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [f"error: compute_loss() failed: {message} {misuse_line(misuse)}"
                                   + HELPER_ADVICE.format(misuse)], result.stderr
    assert not (tmp_path / ".lock").exists() and not checkpoint_steps(tmp_path)


def test_a_hook_raising_any_error_while_traced_is_one_line_naming_it(tmp_path):
    """Not only TypeError and ValueError: an AttributeError (`.numpy()` on a traced tensor) too."""
    result = run_cli(f"--config={MISUSE_CONFIG}", "--config.model.misuse=numpy", f"--workdir={tmp_path}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = error_lines(result)
    assert line.startswith("error: compute_loss() failed: AttributeError: ") and "numpy" in line
    assert misuse_line("numpy") in line, result.stderr
    assert not (tmp_path / ".lock").exists() and not checkpoint_steps(tmp_path)


@pytest.mark.parametrize("misuse, message", [
    ("raising_after_update", "RuntimeError: the target is not ready (at {file}:{line})"),
    ("after_update_argument", "TypeError: "),
])
def test_an_after_update_that_fails_is_one_line_naming_the_objective(tmp_path, misuse, message):
    result = run_cli(f"--config={MISUSE_CONFIG}", f"--config.model.misuse={misuse}",
                     "--config.trainer=misuse_experiment.AfterUpdateMisuseTrainer",
                     f"--workdir={tmp_path}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = error_lines(result)
    raise_line = open(MISUSE_CONFIG).read().splitlines().index(
        '            raise RuntimeError("the target is not ready")') + 1
    assert line.startswith("error: the after_update of objective 'model' failed: "
                           + message.format(file=MISUSE_CONFIG, line=raise_line)), result.stderr
    assert line.endswith("; it is a function of no arguments that assigns variables (see "
                         "mixloop.Objective)")
    assert not (tmp_path / ".lock").exists() and not checkpoint_steps(tmp_path)


@pytest.mark.parametrize("misuse, returned", [("no_optimizer", "None"), ("optimizer_name", "'adam'")])
def test_a_build_optimizer_returning_no_optimizer_is_one_line(tmp_path, misuse, returned):
    result = run_cli(f"--config={MISUSE_CONFIG}", f"--config.model.misuse={misuse}",
                     f"--workdir={tmp_path}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [
        f"error: objective 'model' has optimizer={returned}, not a Keras optimizer; "
        "build_optimizer() (or the Objective) must return one, e.g. "
        "mixloop.build_optimizer(self.config)"], result.stderr
    assert not (tmp_path / ".lock").exists()


def test_mixloop_build_optimizer_misused_in_build_optimizer_is_one_line(tmp_path):
    result = run_cli(f"--config={MISUSE_CONFIG}", "--config.model.misuse=every_steps_zero",
                     f"--workdir={tmp_path}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = error_lines(result)
    assert line.startswith("error: build_optimizer() failed: ValueError: mixloop.build_optimizer: "
                           "every_steps=0 is not allowed: a positive integer"), line
    assert not (tmp_path / ".lock").exists()


def test_an_output_that_is_not_batch_shaped_under_batch_loss_is_one_line(tmp_path):
    """A batch mean of the logits ([3]) would reach the loss of 2 micro-batches joined ([6])."""
    result = run_cli(f"--config={MISUSE_CONFIG}", "--config.model.misuse=batch_mean",
                     "--config.train.batch_loss=True", f"--workdir={tmp_path}")

    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [
        "error: train.batch_loss: model output mean has shape (3,), whose first dimension is not "
        "the micro-batch size 16; the loss over the whole batch would read it joined over 2 "
        "micro-batches, laid end to end; make every model output batch-shaped ([batch, ...]: take "
        "a statistic over the batch, such as a mean, in compute_loss instead), or set "
        "train.batch_loss=False"], result.stderr
    assert not (tmp_path / ".lock").exists() and not checkpoint_steps(tmp_path)
