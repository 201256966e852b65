"""`python -m mixloop.train` end to end, and its one-line refusals of bad input."""

import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_CONFIG = os.path.join(TESTS_DIR, "tiny_experiment.py")

pytestmark = pytest.mark.slow


def run_cli(*args, cwd=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "mixloop.train", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


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
])
def test_bad_input_is_one_line_and_leaves_the_workdir(trained_workdir, args, message):
    before = snapshot(trained_workdir)
    result = run_cli(*args, f"--workdir={trained_workdir}")

    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert snapshot(trained_workdir) == before


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
