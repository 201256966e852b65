"""Ctrl-C or SIGTERM while `python -m mixloop.train` starts: one `error:` line and exit status
128 + the signal's number (130 for SIGINT, 143 for SIGTERM, as a shell reports a killed command),
not a traceback from the middle of TensorFlow's import.

The handlers are armed when that command first imports the `mixloop` package, before TensorFlow
(seconds of the startup). The training loop disarms them as it takes over the signals with its own
(checkpoint, then a clean exit); the command disarms them too when its work is done.
"""

import signal
import sys

COMMAND = "mixloop.train"
_DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def is_starting_command() -> bool:
    """Whether this process is `python -m mixloop.train` locating its module: while Python does,
    `sys.argv[0]` is "-m", and the original command line's first -m names the module."""
    if sys.argv[:1] != ["-m"]:
        return False
    for index, arg in enumerate(sys.orig_argv):
        if arg.startswith("-m"):  # -mNAME or -m NAME.
            return (arg[2:] or next(iter(sys.orig_argv[index + 1:]), "")) == COMMAND
    return False


def exit_quietly_while_starting() -> None:
    """Arms the one-line exit on SIGINT and SIGTERM when this process is starting the command."""
    if is_starting_command():
        for signal_number in _DEFAULT_HANDLERS:
            signal.signal(signal_number, _exit_before_training)


def disarm() -> None:
    """Python's own handlers again where these were armed: once the command's work is done, a
    signal no longer means "before training started"."""
    for signal_number, default in _DEFAULT_HANDLERS.items():
        if signal.getsignal(signal_number) is _exit_before_training:
            signal.signal(signal_number, default)


def _exit_before_training(signal_number: int, frame) -> None:
    print(f"error: interrupted by {signal.Signals(signal_number).name} before training started; "
          "nothing was written", file=sys.stderr, flush=True)
    raise SystemExit(128 + signal_number)
