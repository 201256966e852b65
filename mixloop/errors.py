"""The errors a user can fix and the one line each becomes: `UserError` (the command line prints it
and exits with 2, no traceback), `ConfigError`, where in the experiment's own code an exception was
raised, and what a TensorFlow op error says in one line. Every floor of mixloop may import this."""

from __future__ import annotations

import os
import re
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


class ConfigError(UserError, ValueError):
    """A config key or value the framework cannot run with."""


def user_frames(error: BaseException) -> list[tuple[types.FrameType, int]]:
    """The frames of `error`'s traceback that run the experiment's own code (not mixloop, Python,
    an installed package, or code TensorFlow generated), outermost first, each with its line."""
    return [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__)
            if is_user_code(frame)]


def described(error: BaseException) -> str:
    """'ValueError: <its message on one line> (at <file>:<line>)', the line the experiment's own
    code raised it from, when that is on its traceback (or, for an error raised while TensorFlow
    traced the experiment's code, in the call stack autograph wrote into its message)."""
    message, traced_at = _untraced(str(error), type(error).__name__)
    frames = user_frames(error)
    where = f"{frames[-1][0].f_code.co_filename}:{frames[-1][1]}" if frames else traced_at
    return f"{type(error).__name__}: {' '.join(message.split())}" + (f" (at {where})" if where else "")


def message_of(error: BaseException) -> str:
    """`error`'s own message: for an error raised while AutoGraph traced the experiment's code (a
    hook such as `compute_loss`), without the traced call stack it wrapped the message in."""
    return _untraced(str(error), type(error).__name__)[0]


def _untraced(message: str, type_name: str) -> tuple[str, str]:
    """(the original message, '<file>:<line>' of the experiment's innermost traced frame or '')
    of an error autograph re-raised as 'in user code: <the traced call stack> <Type>: <message>';
    `message` and '' for any other."""
    if not message.startswith("in user code:"):
        return message, ""
    original = message.strip().splitlines()[-1].strip()
    places = [f"{file}:{line}" for file, line, _ in _traced_user_frames(message)]
    return original.removeprefix(f"{type_name}: "), places[-1] if places else ""


def traced_hooks(error: BaseException, owner: type) -> list[str]:
    """The names of the methods of `owner` (the Trainer) written in the experiment's code that
    were being traced when `error` was raised (`compute_loss` calling `mixloop.forward` wrongly),
    outermost first: in autograph's converted code on the traceback (`tf__compute_loss`, its
    `self` an `owner`) and in the experiment's files on the call stack its message holds."""
    converted = {frame.f_code.co_name.removeprefix("tf__")
                 for frame, _ in traceback.walk_tb(error.__traceback__)
                 if "__autograph_generated_file" in frame.f_code.co_filename
                 and isinstance(frame.f_locals.get("self"), owner)}
    return [name for _, _, name in _traced_user_frames(str(error)) if name in converted]


def _traced_user_frames(message: str) -> list[tuple[str, str, str]]:
    """(file, line, function) of the experiment's frames on the traced call stack of an error
    autograph re-raised ('in user code: ...'), outermost first."""
    if not message.startswith("in user code:"):
        return []
    return [frame for frame in _TRACED_FRAME.findall(message) if _is_user_file(frame[0])]


_TRACED_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def is_user_code(frame: types.FrameType) -> bool:
    return _is_user_file(frame.f_code.co_filename)


def _is_user_file(filename: str) -> bool:
    """Whether `filename` holds the experiment's code: not mixloop, Python, an installed package,
    or code TensorFlow generated."""
    return not (filename.startswith(_LIBRARY_FOLDERS) or filename.startswith("<")
                or "__autograph_generated_file" in filename)


def op_error_summary(error: Exception) -> str:
    """The line of a TensorFlow op error (`tf.errors.OpError`) that says what went wrong, without
    the trace around it.

    That is the last line outside the traces: the shapes or values an op refused (`Matrix
    size-incompatible: In[0]: [32,9], In[1]: [8,16]`), or a Python exception raised in the data
    pipeline (`ValueError: ...`, the last line of its traceback), without tf.data's prefix naming
    the transformation.
    """
    noise = ("Graph execution error", "Detected at node", 'File "', "[[", "Stack trace",
             "tf2xla conversion failed")
    # XLA follows its own line with where the op was made: the graph's Python stack, not the cause.
    lines = [line.strip() for line in error.message.split("The op is created at:")[0].splitlines()]
    useful = [line for line in lines if line and not line.startswith(noise)]
    summary = (useful[-1] if useful else lines[0]).split("\t")[0].strip()
    summary = re.sub(r"^Error in user-defined function passed to .*? with iterator: \S+: ", "",
                     summary)
    summary = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", summary)  # A function called eagerly.
    summary = re.sub(r"\s+Label values:.*", "", summary)  # Every label of the batch.
    summary = re.sub(r"^Detected unsupported operations when trying to compile graph \S+ on \S+: ",
                     f"{XLA_CANNOT_COMPILE} ", summary)
    summary = re.sub(r"\s*compatible with node\s*\{\{node [^}]*\}\}\)\{\{node [^}]*\}\}", ")", summary)
    if re.search(_INDEX_OUT_OF_RANGE, summary):
        summary += " (an integer input, such as a label, outside its valid range)"
    return summary


# How op_error_summary begins the line of an op XLA has no kernel for.
XLA_CANNOT_COMPILE = "XLA cannot compile"

# How TensorFlow's kernels without XLA say an index is out of range: gather (an embedding, a
# label's row), the segment sums of a gather's gradient, the sparse cross-entropy.
_INDEX_OUT_OF_RANGE = r" is not in \[| is out of range \[|outside the valid range of \["

EMPTY_EVAL_DATA = "the eval dataset is empty: build_datasets() returned one with no batches"


def empty_train_data(batch_size: int) -> str:
    """The one line for a train set with no batch."""
    return (f"the train dataset is empty: build_datasets() returned one with no batches (batched "
            f"with drop_remainder=True, fewer than config.train.batch_size={batch_size} examples "
            "make none)")
