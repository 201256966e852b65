"""Signals while a command starts and probes at a run's start (mixloop/interrupts.py); whole commands
interrupted are in tests/package/test_cli.py and tests/tools/test_tool_commands.py."""

import signal
import sys

import pytest

from mixloop import interrupts


def test_a_probe_gives_up_only_once_a_stop_is_requested():
    interrupts.check_stop(lambda: False)
    with pytest.raises(interrupts.ProbeStopped):
        interrupts.check_stop(lambda: True)


def test_only_a_python_m_mixloop_command_is_a_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["-m"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "mixloop.train", "--config=x"])
    assert interrupts.starting_command() == "mixloop.train"
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-mmixloop.diagnose"])
    assert interrupts.starting_command() == "mixloop.diagnose"
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "pytest"])
    assert interrupts.starting_command() is None
    monkeypatch.setattr(sys, "argv", ["script.py"])
    assert interrupts.starting_command() is None


def test_a_handler_taking_over_puts_pythons_own_back_not_the_startups():
    quiet = interrupts._QuietExit("before training started")
    assert interrupts.disarmed(signal.SIGINT, quiet) is signal.default_int_handler
    assert interrupts.disarmed(signal.SIGTERM, quiet) is signal.SIG_DFL
    own = lambda *args: None  # noqa: E731
    assert interrupts.disarmed(signal.SIGTERM, own) is own
