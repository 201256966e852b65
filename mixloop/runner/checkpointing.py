"""Checkpoints of a run: what is saved (weights, optimizer, loss scale, counters, data position),
which one a run resumes from, and writing one without leaving half a checkpoint behind.

The files on disk are the truth; the `checkpoint` index file only lists them. A run resumes from
the newest `ckpt-N` that reads in full (every tensor, checksums included): a missing, garbled or
stale index is rebuilt from the files, so the run neither restarts at step 0 nor overwrites
checkpoints it never read, and the manager's rotation (`max_to_keep`) goes on over all of them. A
newer checkpoint that does not read (truncated, flipped bytes) is named in a warning and left on
disk, out of the index, so the rotation never deletes it; only a new save of the same step
replaces it. So is one whose `.index` file was deleted while its data files stayed: a run with no
readable checkpoint left is refused in one line rather than restarted at step 0 over their data. One
that reads but does not fit the model is refused in one line.
"""

from __future__ import annotations

import contextlib
import glob
import logging as python_logging
import os
import re
import shutil
from typing import Any, Iterator, Mapping, Optional

import tensorflow as tf
from absl import logging

from mixloop.errors import UserError

_CHECKPOINT_INDEX = re.compile(r"ckpt-(\d+)\.index")
_CHECKPOINT_DATA = re.compile(r"ckpt-(\d+)\.data-\d+-of-\d+")
_INTERRUPTED_SAVE = re.compile(r"ckpt-\d+_temp")
# What TensorFlow logs when the status of a refused restore is garbage-collected (at exit): a line
# per value of the checkpoint, about a hundred after the one-line error.
_UNRESTORED_VALUE_WARNINGS = (
    "Detecting that an object or model or tf.train.Checkpoint is being deleted with unrestored",
    "Value in checkpoint could not be found in the restored object",
    "An attribute in the restored object could not be found in the checkpoint",
)


def contents(model_variables: list, objectives: Mapping[str, Any], state: Any,
             ema: Mapping[str, Any], extra_state: Mapping[str, Any],
             train_iterator: Optional[Any]) -> dict[str, Any]:
    """What a checkpoint of a run holds, by key: the model's variables, each objective's optimizer
    variables and loss scale, the counters, the EMA averages, the research state and, when it is
    checkpointed, the data position. Variables go in as lists: Keras 3 does not track every
    variable (such as dropout seed states) through the model object."""
    return dict(
        model_variables=list(model_variables),
        objectives={name: {"optimizer_variables": list(objective.optimizer.variables),
                           "loss_scale": objective.loss_scale}
                    for name, objective in objectives.items()},
        state=state,
        ema=ema,
        extra_state=extra_state,
        **({"train_iterator": train_iterator} if train_iterator is not None else {}),
    )


def configured_learning_rates(objectives: Mapping[str, Any]) -> dict[str, tuple[Any, float]]:
    """Per objective with a constant learning rate, its optimizer variable and current value (a
    schedule has no such variable: it is rebuilt from the config and reads the iterations): what a
    restore puts back after reading the checkpoint, so a learning rate changed for the resumed run
    takes effect."""
    found = {}
    for name, objective in objectives.items():
        for variable in objective.optimizer.variables:
            if variable.name == "learning_rate":
                found[name] = (variable, float(variable.numpy()))
    return found


def put_back_learning_rates(configured: Mapping[str, tuple[Any, float]]) -> None:
    """Assigns each of `configured_learning_rates`' values again where the checkpoint changed it."""
    for name, (variable, value) in configured.items():
        if float(variable.numpy()) != value:
            logging.info("Objective %s: learning rate %g from the config (the checkpoint had %g)",
                         name, value, float(variable.numpy()))
            variable.assign(value)


def make_manager(
    workdir: str, max_to_keep: int, **trackables: object
) -> tf.train.CheckpointManager:
    """A `CheckpointManager` over `workdir/checkpoints` saving every trackable passed by keyword,
    whose latest checkpoint is the newest one on disk that reads in full (the index rebuilt to say
    so when it does not).

    Raises:
      UserError: when there are checkpoints but none of them reads.
    """
    directory = os.path.join(workdir, "checkpoints")
    _index_the_files_on_disk(directory)
    checkpoint = tf.train.Checkpoint(**trackables)
    return tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)


def restore_latest(manager: tf.train.CheckpointManager, directory: str) -> Optional[str]:
    """Restores the newest readable checkpoint in `directory` (the chief's, for every worker);
    returns its path.

    Raises:
      UserError: when the checkpoint holds variables of other shapes or counts than this run's, or
        when there are checkpoints but none of them reads.
    """
    if os.path.normpath(directory) == os.path.normpath(manager.directory):
        path = manager.latest_checkpoint  # Already checked by make_manager.
    else:
        path, _ = _newest_readable(directory)
    if path is None:
        return None
    try:
        manager.checkpoint.restore(path).assert_consumed()
    except (AssertionError, ValueError, tf.errors.OpError) as error:
        tf.get_logger().addFilter(_is_not_an_unrestored_value_warning)
        detail = _shortened(str(error).strip().splitlines()[0])
        raise UserError(
            f"the checkpoint {path} does not match this run's model, objectives (optimizers, loss "
            f"scales), EMA (train.ema_decay on or off), extra_state() or data "
            f"pipeline ({detail}); use a new --workdir or the config that wrote it"
        ) from None
    logging.info("Restored %s", path)
    return path


def _newest_readable(directory: str) -> tuple[Optional[str], list[str]]:
    """The newest checkpoint in `directory` that reads in full (None when there is none), and the
    newer ones that do not, each named in a warning.

    Raises:
      UserError: when there are checkpoints but none of them reads.
    """
    unreadable = []
    lost = _lost_indexes(directory)
    for path in sorted(_checkpoints_on_disk(directory) + lost, key=_step, reverse=True):
        problem = (f"its index file {os.path.basename(path)}.index is missing" if path in lost
                   else _read_problem(path))
        if problem:
            unreadable.append((path, problem))
            continue
        for bad, problem in unreadable:
            logging.warning("Checkpoint %s is unreadable (%s); resuming from %s instead (%s stays "
                            "on disk until a new save of its step replaces it)", bad, problem,
                            path, os.path.basename(bad))
        return path, [bad for bad, _ in unreadable]
    if unreadable:
        newest, problem = unreadable[0]
        raise UserError(f"no checkpoint in {directory} is readable (the newest, {newest}: "
                        f"{problem}); move them away to start again from step 0, or use a new "
                        "--workdir")
    return None, []


def save(manager: tf.train.CheckpointManager, step: int) -> None:
    """Saves the run as checkpoint `step` unless it is the latest already, first removing what
    interrupted saves left (`ckpt-N_temp/` folders).

    Raises:
      UserError: when the disk is full; the partial files of checkpoint `step` are removed, so the
        previous checkpoint stays the one resumed.
    """
    _remove_interrupted_saves(manager.directory)
    previous = manager.latest_checkpoint
    if previous == _prefix(manager.directory, step):
        return
    try:
        manager.save(checkpoint_number=step)
    except (tf.errors.ResourceExhaustedError, OSError) as error:
        _remove_checkpoint(manager.directory, step)
        resume = f"resume from {os.path.basename(previous)}" if previous else "start again"
        # TensorFlow says "<file>; <reason>"; the file's path alone can be longer than a line.
        reason = _first_line(error, limit=None).rpartition("; ")[2][:200]
        raise UserError(f"could not write checkpoint ckpt-{step} in {manager.directory}: {reason}; "
                        f"free space and run the same command to {resume}") from None


def _index_the_files_on_disk(directory: str) -> None:
    """Rewrites the `checkpoint` index of `directory` when it does not list exactly the checkpoints
    on disk that may be read, the newest readable one last: a lost or stale index neither hides
    checkpoints from a resume nor from the manager's rotation."""
    latest, unreadable = _newest_readable(directory)
    index = os.path.join(directory, "checkpoint")
    if latest is None:
        if os.path.exists(index):  # It names nothing: the checkpoints were deleted.
            logging.info("Removing the checkpoint index %s: no checkpoint is left on disk", index)
            os.remove(index)
        return
    listed = [path for path in _checkpoints_on_disk(directory) if path not in unreadable]
    state = _read_index(directory)
    if state is not None and (state.model_checkpoint_path, list(state.all_model_checkpoint_paths)
                              ) == (latest, listed):
        return
    if state is None:
        logging.warning("The checkpoint index %s is missing or unreadable; rebuilt it from the "
                        "checkpoints on disk", index)
    times = [os.path.getmtime(path + ".index") for path in listed]
    with _tensorflow_warnings_off():  # The deprecation of the v1 function, which has no successor.
        tf.compat.v1.train.update_checkpoint_state(
            directory, os.path.basename(latest), [os.path.basename(path) for path in listed],
            all_model_checkpoint_timestamps=times, last_preserved_timestamp=min(times) - 1)


def _read_index(directory: str):
    """The index (a `CheckpointState`) of `directory` with absolute paths, or None when it is
    missing or garbled."""
    try:
        with _tensorflow_warnings_off():  # Its warning for a garbled index is said better here.
            return tf.train.get_checkpoint_state(directory)
    except ValueError:  # An index naming no checkpoint.
        return None


@contextlib.contextmanager
def _tensorflow_warnings_off() -> Iterator[None]:
    tf_logger = tf.get_logger()
    level = tf_logger.level
    tf_logger.setLevel(python_logging.ERROR)
    try:
        yield
    finally:
        tf_logger.setLevel(level)


def _checkpoints_on_disk(directory: str) -> list[str]:
    """Prefixes of the checkpoints in `directory` with an index file, oldest (lowest step) first."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = sorted(int(match[1]) for match in map(_CHECKPOINT_INDEX.fullmatch, names) if match)
    return [_prefix(directory, step) for step in steps]


def _lost_indexes(directory: str) -> list[str]:
    """Prefixes of the checkpoints in `directory` whose data files are on disk without their
    `.index` file (deleted by hand), oldest first.

    A save killed between moving its data into place and writing its index leaves the same: the
    newest step, newer than every indexed checkpoint and not yet listed in the `checkpoint` index
    (written after a save completes). That one is no loss and not counted.
    """
    names = os.listdir(directory) if os.path.isdir(directory) else []
    indexed = {int(match[1]) for match in map(_CHECKPOINT_INDEX.fullmatch, names) if match}
    data_only = sorted({int(match[1]) for match in map(_CHECKPOINT_DATA.fullmatch, names) if match}
                       - indexed)
    state = _read_index(directory)
    listed = {os.path.basename(path) for path in state.all_model_checkpoint_paths} if state else set()
    if data_only and data_only[-1] > max(indexed, default=-1) and \
            f"ckpt-{data_only[-1]}" not in listed:
        data_only.pop()  # A killed save's.
    return [_prefix(directory, step) for step in data_only]


def _shortened(text: str, limit: int = 200) -> str:
    """`text`, cut at the last word boundary before `limit` characters (and '...') when longer."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _step(prefix: str) -> int:
    return int(prefix.rpartition("-")[2])


def _read_problem(path: str) -> str:
    """Why the checkpoint `path` does not read in full, or '' when every tensor in it reads and
    passes its checksum. One tensor at a time, so no more than the largest is held at once."""
    try:
        dtypes = tf.train.load_checkpoint(path).get_variable_to_dtype_map()
        for name, dtype in dtypes.items():
            tf.raw_ops.RestoreV2(prefix=path, tensor_names=[name], shape_and_slices=[""],
                                 dtypes=[dtype])
    except tf.errors.OpError as error:
        return _first_line(error)
    return ""


def _first_line(error: Exception, limit: Optional[int] = 200) -> str:
    """The first line of an error without TensorFlow's op wrapping, at most `limit` characters."""
    text = error.message if isinstance(error, tf.errors.OpError) else str(error)
    line = (text.strip().splitlines() or [type(error).__name__])[0]
    line = re.sub(r"^\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]$", "", line)
    return line[:limit]


def _remove_interrupted_saves(directory: str) -> None:
    """Removes the `ckpt-N_temp/` folders of saves cut short (by a kill or a full disk)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if _INTERRUPTED_SAVE.fullmatch(name):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _remove_checkpoint(directory: str, step: int) -> None:
    prefix = _prefix(directory, step)
    for path in glob.glob(glob.escape(prefix) + ".*"):
        os.remove(path)
    shutil.rmtree(prefix + "_temp", ignore_errors=True)


def _prefix(directory: str, step: int) -> str:
    return os.path.join(directory, f"ckpt-{step}")


def _is_not_an_unrestored_value_warning(record: python_logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_UNRESTORED_VALUE_WARNINGS)
