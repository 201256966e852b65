"""Ctrl-C or SIGTERM while `python -m mixloop.train` starts, or at any time in `python -m
mixloop.diagnose` or `python -m mixloop.benchmark`: one `error:` line and exit status 128 + the
signal's number (130 for SIGINT, 143 for SIGTERM, as a shell reports a killed command), not a
traceback from the middle of TensorFlow.

The handlers are armed when one of these commands first imports the `mixloop` package, before
TensorFlow (seconds of the startup). The training loop disarms them as it takes over the signals
with its own (checkpoint, then a clean exit), before it writes anything into the workdir; every
command disarms them when its work is done. The tools write their files (--output) last, so an
interrupted one has written nothing. A stop
during a probe at the start of a run (the precision placement, the compile mode) ends the probe at
its next boundary (`ProbeStopped`); in `python -m mixloop.train`, one during the compile-mode
probe's compilation ends the process at once, nothing saved (`ProbeAbandoned`).
"""

import contextlib
import os
import signal
import sys
from typing import Any, Callable, Iterator, NoReturn, Optional

# The commands whose signals end them in one line, and when a signal comes for each.
COMMANDS = {"mixloop.train": "before training started",
            "mixloop.diagnose": "before the diagnosis finished",
            "mixloop.benchmark": "before the benchmark finished"}
_DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
_in_a_command = False  # Whether this process runs one of COMMANDS (set when they are armed).


def starting_command() -> Optional[str]:
    """The command of `COMMANDS` this process is locating its module for (`python -m <command>`),
    or None: while Python locates it, `sys.argv[0]` is "-m", and the original command line's first
    -m names the module."""
    if sys.argv[:1] != ["-m"]:
        return None
    for index, arg in enumerate(sys.orig_argv):
        if arg.startswith("-m"):  # -mNAME or -m NAME.
            module = arg[2:] or next(iter(sys.orig_argv[index + 1:]), "")
            return module if module in COMMANDS else None
    return None


def exit_quietly_while_starting() -> None:
    """Arms the one-line exit on SIGINT and SIGTERM when this process is starting a command."""
    global _in_a_command
    command = starting_command()
    if command is not None:
        _in_a_command = True
        handler = _QuietExit(COMMANDS[command])
        for signal_number in _DEFAULT_HANDLERS:
            signal.signal(signal_number, handler)


def running_a_command() -> bool:
    """Whether this process is one of `COMMANDS`, which may end itself (not a script or a notebook
    that imported mixloop)."""
    return _in_a_command


def disarmed(signal_number: int, handler: Any) -> Any:
    """`handler` for `signal_number`, or Python's own handler where it is this module's: what a
    handler taking over from the startup's puts back when it is done."""
    return _DEFAULT_HANDLERS[signal_number] if isinstance(handler, _QuietExit) else handler


def disarm() -> None:
    """Python's own handlers again where these were armed: once the command's work is done, or
    the training loop takes over."""
    for signal_number, default in _DEFAULT_HANDLERS.items():
        if isinstance(signal.getsignal(signal_number), _QuietExit):
            signal.signal(signal_number, default)


class _QuietExit:
    """The handler: one line naming the signal and `when` it came, then the exit.

    While the command starts (imports, flags, the trainer's build) the process ends at once: the
    handler runs wherever the main thread happens to be, and code there may swallow a raised
    SystemExit (Python ignores one raised in a weakref callback, such as importlib's module-lock
    callbacks during TensorFlow's import: the startup went on) or turn it into another (pybind11
    reports any exception in a module's initialisation as an ImportError): exit status 0 or 1, or
    a traceback. Ending there skips nothing: nothing was written yet. A tool's work, which has
    temporary folders and child processes to clean up, unwinds instead (`unwind_from_here`).
    """

    def __init__(self, when: str):
        self.when = when
        self.unwinds = False

    def __call__(self, signal_number: int, frame) -> None:
        # Straight to the descriptor: the signal can come while this thread is inside a write to
        # sys.stderr, whose buffer then refuses a second writer ("reentrant call").
        os.write(2, f"error: interrupted by {signal.Signals(signal_number).name} {self.when}; "
                    "nothing was written\n".encode())
        if self.unwinds:
            raise SystemExit(128 + signal_number)
        _flush_quietly(sys.stdout)  # What the command printed so far, as an exit would.
        os._exit(128 + signal_number)


def unwind_from_here() -> None:
    """From here a signal raises SystemExit, so that the work's cleanup runs (a tool's temporary
    folders, its child processes) rather than ending the process at once. Called once the
    tool's trainer is built: the imports, where a raised SystemExit can be lost, are done."""
    for signal_number in _DEFAULT_HANDLERS:
        handler = signal.getsignal(signal_number)
        if isinstance(handler, _QuietExit):
            handler.unwinds = True


@contextlib.contextmanager
def unwinding() -> Iterator[None]:
    """`unwind_from_here` for the `with` block only (the memory plan's probes: a child process and
    a folder to clean up); afterwards a signal ends the starting command at once again."""
    handlers = [handler for handler in map(signal.getsignal, _DEFAULT_HANDLERS)
                if isinstance(handler, _QuietExit)]
    before = [handler.unwinds for handler in handlers]
    for handler in handlers:
        handler.unwinds = True
    try:
        yield
    finally:
        for handler, unwinds in zip(handlers, before):
            handler.unwinds = unwinds


def _flush_quietly(stream) -> None:
    """Flushes `stream` unless the signal interrupted a write to it (its buffer is taken then)."""
    try:
        stream.flush()
    except (RuntimeError, OSError, ValueError):
        pass


class ProbeStopped(Exception):
    """A stop (SIGTERM, Ctrl-C) came during a probe at the start (the precision placement, the
    compile mode), which gave up at its next boundary: state put back, nothing recorded."""


def check_stop(stop_requested: Callable[[], bool]) -> None:
    """Where a probe may give up: raises `ProbeStopped` once `stop_requested()`."""
    if stop_requested():
        raise ProbeStopped()


class ProbeAbandoned(Exception):
    """A stop came while the compile-mode probe of a command compiled a loop in a thread of its own
    (seconds in C++, where no signal handler runs), which goes on: the command ends at once
    (`end_process`), saving nothing, as the probe started from the latest checkpoint or from the
    run's seed and nothing it did is kept."""


def end_process(status: int) -> NoReturn:
    """Ends this command with `status` at once, its output flushed: a thread still compiling in
    C++ would hold up an ordinary exit, and could crash TensorFlow's teardown."""
    _flush_quietly(sys.stdout)
    _flush_quietly(sys.stderr)
    os._exit(status)
