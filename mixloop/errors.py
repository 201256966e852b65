"""The error the command line turns into one line and a non-zero exit, without a traceback, and
where in the experiment's own code an exception was raised (for that line to name)."""

from __future__ import annotations

import os
import sysconfig
import traceback
import types

# Where code that is not the experiment's lives: mixloop, Python's library, installed packages.
_LIBRARY_FOLDERS = tuple(os.path.join(folder, "") for folder in {
    os.path.dirname(os.path.abspath(__file__)),
    *(sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib"))})


class UserError(Exception):
    """A problem with the user's input (config, workdir, data) that the user can fix; one-line message."""

    exit_code = 2  # What the command line exits with.


def user_frames(error: BaseException) -> list[tuple[types.FrameType, int]]:
    """The frames of `error`'s traceback that run the experiment's own code (not mixloop, Python,
    an installed package, or code TensorFlow generated), outermost first, each with its line."""
    return [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__)
            if is_user_code(frame)]


def described(error: BaseException) -> str:
    """'ValueError: <its message on one line> (at <file>:<line>)', the line the experiment's own
    code raised it from, when that is on its traceback."""
    frames = user_frames(error)
    where = f" (at {frames[-1][0].f_code.co_filename}:{frames[-1][1]})" if frames else ""
    return f"{type(error).__name__}: {' '.join(str(error).split())}{where}"


def is_user_code(frame: types.FrameType) -> bool:
    filename = frame.f_code.co_filename
    return not (filename.startswith(_LIBRARY_FOLDERS) or filename.startswith("<")
                or "__autograph_generated_file" in filename)
