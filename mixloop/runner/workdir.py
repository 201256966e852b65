"""Workdir safety: one run per workdir (a lock file with the owner's pid), the config history, and
one-line refusals of a workdir that cannot be one (a file, unwritable, a folder where a file belongs,
a file where a folder belongs)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
from typing import Any, Optional, Union

import ml_collections
import tensorflow as tf
from absl import logging

from mixloop import files
from mixloop.errors import UserError

LOCK_NAME = ".lock"


# What a run writes in its workdir besides the lock and config.json: name -> (a folder?, what it holds).
LAYOUT = {
    "checkpoints": (True, "the run's checkpoints"),
    "train": (True, "the train TensorBoard summaries"),
    "eval": (True, "the eval TensorBoard summaries"),
    "precision": (True, "the precision probe's reports"),
    "model.keras": (False, "the exported model"),
}


def check_layout(directory: str) -> None:
    """Refuses a workdir where a file stands in the place of a folder of `LAYOUT`, or a folder in
    the place of a file, before anything is written there (reads only: the doctor calls it too).

    Raises:
      UserError: naming the path, what belongs there and the way out.
    """
    for name, (is_folder, holds) in LAYOUT.items():
        path = os.path.join(directory, name)
        if os.path.exists(path) and os.path.isdir(path) != is_folder:
            kind, wanted = ("a file", "a folder") if is_folder else ("a folder", "a file")
            raise UserError(f"{path} is {kind}, where mixloop keeps {holds} ({wanted}); move it "
                            "away, or choose another --workdir")


def check_writable(directory: str) -> None:
    """Refuses a workdir whose folders of `LAYOUT` are there but cannot be written (a run's train
    and eval summaries, its checkpoints), before anything is written: a temporary file is made in
    each and removed.

    Raises:
      UserError: naming the folder and the reason.
    """
    for name, (is_folder, holds) in LAYOUT.items():
        path = os.path.join(directory, name)
        if not (is_folder and os.path.isdir(path)):
            continue
        try:
            tempfile.TemporaryFile(dir=path).close()
        except OSError as error:
            advice = (making_room(path) if error.errno == errno.ENOSPC
                      else "make it writable, or choose another --workdir")
            raise UserError(f"cannot write to {path}, where mixloop keeps {holds}: "
                            f"{error.strerror}; {advice}") from None


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():  # A lock of our own pid was left by an earlier life (a restarted container).
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # Alive, owned by someone else.
        return True
    return True


class WorkdirLock:
    """Holds `directory/.lock` (pid and host of the owner) while a run writes into `directory`.

    A lock left by a process that no longer runs on this host is stale and taken over with a warning;
    a live owner, or one on another host, makes the second run refuse.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)

    def __enter__(self) -> "WorkdirLock":
        """Takes the lock.

        Raises:
          UserError: when another run holds it, or the folder cannot be created or written.
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
            for _ in range(2):
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    self._clear_stale_lock()
                    continue
                self._write_owner(fd)
                remove_scratch_folders(self.directory)
                return self
        except OSError as error:
            raise unusable_workdir(self.directory, error) from None
        raise UserError(f"could not take the lock {self.path}; another run is starting there")

    def _write_owner(self, fd: int) -> None:
        """Writes this process's pid and host into the lock just created as `fd`; a lock it could
        not write (a full disk) is removed, so the next run does not meet a stale one."""
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise

    def __exit__(self, *exc_info) -> None:
        """Releases the lock if it is still this process's: a lock someone removed (a workdir
        deleted and started again under a run still saving) is not this run's to remove, and its
        absence must not turn a finished run into a traceback."""
        try:
            with open(self.path) as f:
                owner = json.load(f)
            if int(owner["pid"]) == os.getpid() and owner["host"] == socket.gethostname():
                os.remove(self.path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # Gone or rewritten by another run: nothing of ours to release.

    def _clear_stale_lock(self) -> None:
        if os.path.isdir(self.path):
            raise UserError(f"{self.path} is a folder, where mixloop keeps the workdir's lock file; "
                            "move it away, or choose another --workdir")
        try:
            with open(self.path) as f:
                owner = json.load(f)
            pid, host = int(owner["pid"]), str(owner["host"])
        except (OSError, ValueError, KeyError, TypeError):
            owner, pid, host = None, -1, socket.gethostname()  # Half-written: its writer died.
        if host != socket.gethostname() or (owner is not None and _process_alive(pid)):
            raise UserError(
                f"workdir {self.directory} is in use by process {pid} on {host} (lock {self.path}); "
                "stop that run, or delete the lock if it is gone, or choose another --workdir"
            )
        logging.warning("Removing the stale lock %s of process %d, which no longer runs", self.path, pid)
        os.remove(self.path)


class UnusableWorkdir(UserError):
    """The workdir cannot be written (a full disk, no free inodes, no permission): nothing the run
    does after can be saved, so what would carry on without a result (a probe) stops too."""


def unusable_workdir(directory: str, error: Union[OSError, tf.errors.OpError],
                     path: Optional[str] = None) -> UserError:
    """The one line for `directory` failing as a workdir with `error`, Python's or TensorFlow's
    (writing `path`: TensorFlow's errors carry it only in their text): a file, under a file, full
    (no space, or no free inodes), or not writable (permissions, a read-only file system)."""
    existing = nearest_existing(directory)
    if os.path.lexists(existing) and not os.path.isdir(existing):
        where = "is" if existing == os.path.normpath(directory) else f"is under {existing}, which is"
        return UserError(f"the workdir {directory} {where} a file, not a folder; "
                         "choose another --workdir")
    path = getattr(error, "filename", None) if path is None else path
    where = "" if path in (None, directory) else f" ({path})"
    full = (isinstance(error, tf.errors.ResourceExhaustedError)
            or getattr(error, "errno", None) == errno.ENOSPC)
    advice = making_room(existing) if full else "choose a --workdir you can write to"
    return UnusableWorkdir(f"cannot write to the workdir {directory}: "
                           f"{error_reason(error)}{where}; {advice}")


def error_reason(error: Union[OSError, tf.errors.OpError]) -> str:
    """Why writing a file failed, in the system's words ("No space left on device"): an OSError's
    own, or what follows the path in the first line of TensorFlow's ("<path>; <reason>")."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    reason = error.message.splitlines()[0].rpartition("; ")[2] if error.message else ""
    return re.sub(r" \[Op:\w+\].*", "", reason)[:200] or type(error).__name__


def making_room(directory: str, place: str = "--workdir") -> str:
    """How to make room on the full file system of the existing `directory`: space, or files when
    it has no free inode left (where `df -h` still shows space); else another `place`."""
    try:
        no_inodes = os.statvfs(directory).f_favail == 0
    except OSError:
        no_inodes = False
    return (f"its file system has no free inodes (df -i): remove some files or choose another "
            f"{place}" if no_inodes else f"free some space or choose another {place}")


# The prefixes of the probes' temporary folders in a workdir (`scratch_folder`): the compile-mode
# probe's saved state, the precision probe's data position, the memory probes' runs.
SCRATCH_PREFIXES = (".compile-probe-", ".precision-probe-", ".memory-probe-")


def scratch_folder(directory: str, prefix: str) -> "tempfile.TemporaryDirectory[str]":
    """A temporary folder inside the workdir `directory` (its lock is held there, and a model's
    state can be large where /tmp is small), or in the system's when it does not exist yet;
    removed when its `with` block ends, or by the next run's start (`remove_scratch_folders`)
    when a SIGKILL ended the block.

    Raises:
      UserError: when it cannot be made (a full disk, no free inodes), naming the workdir.
    """
    try:
        return tempfile.TemporaryDirectory(prefix=prefix,
                                           dir=directory if os.path.isdir(directory) else None)
    except OSError as error:
        raise unusable_workdir(directory, error) from None


def remove_scratch_folders(directory: str) -> None:
    """Removes the probes' temporary folders a killed run left in `directory` (a copy of the whole
    state, the model's size): called with the workdir's lock taken, so no run is using them."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(SCRATCH_PREFIXES) and os.path.isdir(path) and not os.path.islink(path):
            logging.info("Removing %s, a probe's temporary folder an interrupted run left", path)
            shutil.rmtree(path, ignore_errors=True)


def nearest_existing(path: str) -> str:
    """`path` if it exists, else the nearest of its parents that does (`path` normalized)."""
    existing = os.path.normpath(path)
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    return existing


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}."))
    return flat


def config_changes(old: dict, new: dict) -> list[str]:
    """'key: old -> new' for every leaf that differs between two nested config dicts."""
    before, after = _flatten(old), _flatten(new)
    return [f"{key}: {before.get(key, '(absent)')!r} -> {after.get(key, '(absent)')!r}"
            for key in sorted(set(before) | set(after)) if before.get(key) != after.get(key)]


# config.json's record of what the `auto` settings chose (`record_resolved`); not part of the config.
RESOLVED = "resolved"


def write_config(directory: str, config: ml_collections.ConfigDict, step: int) -> None:
    """Writes `config.json`; a different earlier one is kept as `config-step-<step>.json`.

    An unchanged config leaves the file as it is, with its `resolved` record; a changed one carries
    the record over, since what the earlier probes chose still holds for the weights resumed. The
    new file is written whole, the earlier one copied to its new name, then the new one renamed
    into place: a full disk leaves `config.json` as it was.

    Raises:
      UnusableWorkdir: when the workdir cannot be written (a full disk, no free inodes).
    """
    path = os.path.join(directory, "config.json")
    new = json.loads(config.to_json_best_effort())
    kept = None
    if os.path.exists(path):
        old = _read_config(path)
        resolved = old.pop(RESOLVED, None)
        changes = config_changes(old, new)
        if not changes:
            return
        logging.warning("Resuming at step %d with a changed config: %s", step, "; ".join(changes))
        kept, n = os.path.join(directory, f"config-step-{step}.json"), 1
        while os.path.lexists(kept):  # Changed twice at one step: keep both.
            n += 1
            kept = os.path.join(directory, f"config-step-{step}-{n}.json")
        if resolved:
            new[RESOLVED] = resolved
    _write_json(path, new, keep_as=kept)


def recorded_changes(directory: str, config: ml_collections.ConfigDict, keys: Any) -> list[str]:
    """"key: 'old' -> 'new'" for each of the dotted `keys` whose value in `config` differs from the
    one config.json records (the run that wrote this workdir's checkpoints); [] without config.json.

    Raises:
      UserError: for a config.json that cannot be read (`_read_config`).
    """
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return []
    recorded = _flatten(_read_config(path))
    current = _flatten(json.loads(config.to_json_best_effort()))
    return [f"{key}: {recorded[key]!r} -> {current.get(key)!r}" for key in keys
            if key in recorded and recorded[key] != current.get(key)]


def read_resolved(directory: str) -> dict[str, Any]:
    """The `resolved` record of `config.json` ({} when there is none).

    Raises:
      UserError: when config.json or its record is not a JSON object (`_resolved_in`).
    """
    path = os.path.join(directory, "config.json")
    return _resolved_in(_read_config(path), path) if os.path.exists(path) else {}


def record_resolved(directory: str, resolved: dict[str, Any]) -> None:
    """Adds `resolved` (config key -> the value an `auto` setting chose, e.g.
    {"precision.float32_layers": "hot|squash"}) to `config.json`'s record, which `write_config`
    wrote: the config history says what ran, not only what was asked for."""
    path = os.path.join(directory, "config.json")
    config = _read_config(path)
    config[RESOLVED] = {**_resolved_in(config, path), **resolved}
    _write_json(path, config)


def refuse_recorded(directory: str, key: str, value: Any, allowed: str) -> UserError:
    """The one line refusing the value config.json's `resolved` record holds for `key` (hand-edited
    to one no run writes), naming what is allowed and the way out."""
    return UserError(f"{os.path.join(directory, 'config.json')} records {RESOLVED}.{key}="
                     f"{json.dumps(value)}, which is not {allowed}; repair it, or delete the "
                     f"key from the {RESOLVED!r} record to choose it again")


def _resolved_in(config: dict[str, Any], path: str) -> dict[str, Any]:
    """The `resolved` record of the config read from `path` ({} when there is none).

    Raises:
      UserError: when it is not a JSON object (hand-edited): rather than guess or overwrite it.
    """
    resolved = config.get(RESOLVED, {})
    if not isinstance(resolved, dict):
        raise UserError(f"{path}: its {RESOLVED!r} record is {_json_kind(resolved)}, not a JSON "
                        "object of the values the 'auto' settings chose; repair it, or delete "
                        "the record to choose them again")
    return resolved


def _json_kind(value: Any) -> str:
    """'an array', 'a string', ...: what a JSON value is, in words."""
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            dict: "an object"}.get(type(value), "a number")


def _write_json(path: str, value: Any, keep_as: Optional[str] = None) -> None:
    """`files.write_json`, whole or not at all (with `keep_as`, the file it replaces copied first).

    Raises:
      UnusableWorkdir: when a file cannot be written (the file it replaces is left as it was, and
        no partial file stays).
    """
    try:
        files.write_json(path, value, sort_keys=True, keep_as=keep_as)
    except OSError as error:
        raise unusable_workdir(os.path.dirname(path), error, path) from None


def _read_config(path: str) -> dict[str, Any]:
    """The earlier run's config in `path`.

    Raises:
      UserError: when it is a folder, not JSON or JSON other than an object; the run refuses rather
        than replace the record.
    """
    advice = ("it records the config of the run in this workdir: repair or move it, or choose "
              "another --workdir")
    try:
        with open(path) as f:
            config = json.load(f)
    except IsADirectoryError:
        raise UserError(f"{path} is a folder, not a config file; {advice}") from None
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError.
        raise UserError(f"{path} is not valid JSON ({error}); {advice}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds {_json_kind(config)}, not a JSON object of config keys; "
                        f"{advice}")
    return config
