"""The commands' shared pieces, in-process: default workdirs, fitting a shortened run, and the
one-line refusals and startup interrupts (their CLI runs are in test_train_cli.py)."""

import io
import logging
import os
import signal
import subprocess
import sys

import pytest
import tiny_experiment

import mixloop
from mixloop import cli, interrupts
from mixloop.errors import UserError
from mixloop.runner import workdir


def test_a_variant_gets_its_own_default_workdir():
    assert cli.default_workdir("experiments/charlm.py") == "runs/charlm"
    assert cli.default_workdir("experiments/charlm.py:quick") == "runs/charlm-quick"


def test_a_run_shortened_below_its_warmup_warms_up_over_a_tenth_with_a_notice(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    config = tiny_experiment.get_config()
    config.optimizer.schedule, config.optimizer.warmup_steps = "cosine", 100
    config.train.num_steps = 8
    trainer = cli.build_trainer(config, str(tmp_path))
    assert trainer.config.optimizer.warmup_steps == 0
    assert "optimizer.warmup_steps=100 does not fit train.num_steps=8: warming up over 0" in caplog.text
    config.train.num_steps, config.optimizer.warmup_steps = 40, 50
    assert cli.build_trainer(config, str(tmp_path / "b")).config.optimizer.warmup_steps == 4


def test_a_config_json_folder_is_refused_and_kept(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(UserError, match=r"config.json is a folder, not a config file; it records "):
        workdir.write_config(str(tmp_path), tiny_experiment.get_config(), step=10)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json"]
    assert (tmp_path / "config.json").is_dir()


def test_an_error_outside_the_experiments_trainer_code_keeps_its_traceback():
    trainer = tiny_experiment.TinyTrainer.__new__(tiny_experiment.TinyTrainer)
    with pytest.raises(NotImplementedError) as in_mixloop:  # A Trainer method, but mixloop's.
        mixloop.Trainer.build_datasets(trainer)
    with pytest.raises(ValueError) as outside_a_trainer:
        int("not a number")
    assert cli._hook_failure(in_mixloop.value, set()) is None
    assert cli._hook_failure(outside_a_trainer.value, set()) is None


@pytest.mark.parametrize("argv, orig_argv, starting", [
    (["-m"], ["python", "-m", "mixloop.train", "--config=c.py"], "mixloop.train"),
    (["-m"], ["python", "-X", "importtime", "-m", "mixloop.train"], "mixloop.train"),
    (["-m"], ["python", "-mmixloop.train"], "mixloop.train"),
    (["-m"], ["python", "-m", "mixloop.benchmark"], "mixloop.benchmark"),
    (["-m"], ["python", "-m", "mixloop.diagnose"], "mixloop.diagnose"),
    (["-m"], ["python", "-m", "mixloop.cli"], None),
    (["-m"], ["python", "-m", "pytest", "-m", "mixloop.train"], None),  # A marker expression.
    (["script.py"], ["python", "script.py", "-m", "mixloop.train"], None),
])
def test_the_quiet_handlers_are_armed_only_for_mixloops_commands(monkeypatch, argv, orig_argv,
                                                                  starting):
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert interrupts.starting_command() == starting


def test_disarming_gives_back_pythons_handlers(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "mixloop.train"])
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        interrupts.exit_quietly_while_starting()
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT) is not before[
            signal.SIGINT]
        interrupts.disarm()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


class _SignallingRaw(io.RawIOBase):
    """A stream whose first write is interrupted by SIGTERM, as a terminal's can be by Ctrl-C."""

    signalled = False

    def writable(self):
        return True

    def write(self, data):
        if not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
        return len(data)


def test_a_signal_during_a_write_to_stderr_is_still_one_line(monkeypatch, capfd):
    """The handler runs inside the interrupted write, while sys.stderr's buffer is taken: it must
    not write through it (RuntimeError: reentrant call, and a traceback)."""
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "mixloop.train"])
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BufferedWriter(_SignallingRaw())))
    monkeypatch.setattr(os, "_exit", _recording_exit)  # Not this test process's end.
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        interrupts.exit_quietly_while_starting()
        with pytest.raises(SystemExit) as exit_:
            print("building the model", file=sys.stderr, flush=True)
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    assert exit_.value.code == 128 + signal.SIGTERM
    assert _recording_exit.codes == [128 + signal.SIGTERM]  # Ended at once, not unwound.
    assert capfd.readouterr().err == (
        "error: interrupted by SIGTERM before training started; nothing was written\n")


def _recording_exit(code):
    """os._exit's stand-in: records `code` and raises SystemExit, so the test process goes on."""
    _recording_exit.codes.append(code)
    raise SystemExit(code)


_recording_exit.codes = []


@pytest.fixture
def quiet_handlers(monkeypatch):
    """The quiet handlers armed as for `python -m mixloop.benchmark`, os._exit recorded, and the
    test process's own handlers back afterwards."""
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "mixloop.benchmark"])
    monkeypatch.setattr(os, "_exit", _recording_exit)
    monkeypatch.setattr(_recording_exit, "codes", [])
    before = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    interrupts.exit_quietly_while_starting()
    yield
    for number, handler in before.items():
        signal.signal(number, handler)


def test_a_tools_work_unwinds_on_a_signal_so_its_cleanup_runs(quiet_handlers, capfd):
    interrupts.unwind_from_here()  # What the tools' main() does first.
    cleaned = []
    with pytest.raises(SystemExit) as exit_:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # A moment for the handler to run.
        finally:
            cleaned.append(True)  # A temporary folder's removal, a child process's kill.
    assert (exit_.value.code, _recording_exit.codes, cleaned) == (128 + signal.SIGTERM, [], [True])
    assert capfd.readouterr().err == (
        "error: interrupted by SIGTERM before the benchmark finished; nothing was written\n")


SWALLOWING_CALLBACK = """
import importlib.util, os, signal, sys, time, weakref
spec = importlib.util.spec_from_file_location("interrupts", sys.argv[1])
interrupts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(interrupts)
sys.argv, sys.orig_argv = ["-m"], ["python", "-m", "mixloop.train"]  # As the command starts.
interrupts.exit_quietly_while_starting()

class Module:
    pass

def callback(reference):  # As importlib's module-lock callbacks during TensorFlow's import.
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.01)  # The handler runs here, inside the callback.

module = Module()
lock = weakref.ref(module, callback)
del module
print("the startup went on", flush=True)
"""


def test_a_signal_inside_a_weakref_callback_still_ends_the_startup(tmp_path):
    """Python ignores an exception raised in a weakref callback: a handler that raised SystemExit
    there printed its line and the startup went on (a CI run's SIGINT during TensorFlow's import,
    then exit status 1)."""
    result = subprocess.run([sys.executable, "-c", SWALLOWING_CALLBACK, interrupts.__file__],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (128 + signal.SIGINT, "")
    assert result.stderr == ("error: interrupted by SIGINT before training started; nothing was "
                             "written\n")


def test_the_training_loop_takes_the_signals_over_with_no_moment_of_pythons_defaults(
        quiet_handlers, monkeypatch):
    """Python's defaults between the startup's handlers and the loop's would let a SIGTERM kill
    the process with no line; after the loop, Python's own handlers are back, not the startup's."""
    from mixloop.runner import controller

    installed = []
    real_signal = signal.signal

    def recording_signal(number, handler):
        installed.append((number, handler))
        return real_signal(number, handler)

    monkeypatch.setattr(signal, "signal", recording_signal)
    with controller._StopRequest() as stop:
        assert installed == [(number, stop._request) for number in (signal.SIGINT, signal.SIGTERM)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
