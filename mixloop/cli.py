"""What mixloop's commands share: the --config and --workdir flags, building the experiment's
Trainer from them, and turning bad input into one `error:` line and a non-zero exit."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import types
from typing import Any, Callable, Iterator, Optional

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from mixloop import errors, interrupts
from mixloop.config import check_complete, validate
from mixloop.errors import UserError
from mixloop.runner import workdir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file, PATH[:VARIANT].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; defaults to runs/<config name>.")
_CONFIG_ADVICE = ("the experiment's ml_collections.ConfigDict (start from "
                  "mixloop.config.base_config())")


class _ConfigFileParser(flags.ArgumentParser):
    """config_flags' parser of --config=PATH[:VARIANT] (`loader`), with one line naming the file for
    what it cannot make a config of: no such file, a folder, no `get_config`, or `get_config`
    returning something other than a ConfigDict (a plain dict is taken as one)."""

    def __init__(self, loader: flags.ArgumentParser):
        self._loader = loader

    def parse(self, path: str) -> ml_collections.ConfigDict:
        file = path.split(":")[0]
        if os.path.isdir(file):
            raise UserError(f"config file {file!r} is a folder; --config=PATH[:VARIANT] names a Python "
                            "file that defines get_config(arg=None), such as experiments/digits.py")
        if not os.path.isfile(file):
            raise UserError(f"config file {file!r} does not exist")
        try:
            config = self._loader.parse(path)
        except AttributeError as error:
            if error.name == "get_config" and isinstance(error.obj, types.ModuleType):
                raise UserError(f"config file {file!r} defines no get_config(); define "
                                f"get_config(arg=None) returning {_CONFIG_ADVICE}") from None
            raise
        if isinstance(config, dict):
            config = ml_collections.ConfigDict(config)
            config.lock()  # As config_flags locks one: an override of a key it lacks is an error.
        if not isinstance(config, ml_collections.ConfigDict):
            returned = "None (a missing return?)" if config is None else f"a {type(config).__name__}"
            raise UserError(f"get_config() in config file {file!r} returned {returned}; return "
                            f"{_CONFIG_ADVICE}")
        return config


flags.FLAGS["config"].parser = _ConfigFileParser(flags.FLAGS["config"].parser)


def default_workdir(config_path: str) -> str:
    """runs/<config file name without .py>, and -<variant> for PATH:VARIANT (a quick variant must
    not meet the full run's checkpoints)."""
    path, _, variant = config_path.partition(":")
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join("runs", f"{name}-{variant}" if variant else name)


def import_trainer(path: str) -> type:
    """Imports "package.module.ClassName" and returns the class.

    Raises:
      UserError: naming the path when the module or the class cannot be imported.
    """
    module_name, _, class_name = path.rpartition(".")
    try:
        trainer_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as error:
        raise UserError(f"config.trainer={path!r} does not import: {error}") from None
    from mixloop.runner.trainer import Trainer  # Imported here so `--help` stays fast.

    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise UserError(f"config.trainer={path!r} is not a subclass of mixloop.Trainer")
    return trainer_class


def build_trainer(config: ml_collections.ConfigDict, workdir: str):
    """Validates `config` (its warm-up fitted to its length) and builds the Trainer it names,
    working in `workdir`."""
    check_complete(config)  # Before fit_warmup reads config.optimizer.
    fit_warmup(config)
    validate(config)
    return import_trainer(config.trainer)(config, workdir)


def fit_warmup(config: ml_collections.ConfigDict) -> None:
    """A run shortened from the command line below its warm-up gets a warm-up of a tenth of its
    updates, with a notice, rather than an error."""
    optimizer, num_steps = config.optimizer, config.train.num_steps
    if isinstance(num_steps, int) and isinstance(optimizer.warmup_steps, int) and \
            0 < num_steps <= optimizer.warmup_steps:
        logging.warning("optimizer.warmup_steps=%d does not fit train.num_steps=%d: warming up over "
                        "%d updates instead", optimizer.warmup_steps, num_steps, num_steps // 10)
        optimizer.warmup_steps = num_steps // 10


def check_output(path: str, *, folder: bool) -> None:
    """Refuses --output=`path` before a tool's work when what it writes at the end could not go
    there: an existing file (a folder, for a tool that writes a folder of files), a path under a
    file, or a place this process may not write to (tried with a temporary file, removed).

    Raises:
      UserError: naming the path and the way out.
    """
    existing = workdir.nearest_existing(path)
    if existing == os.path.normpath(path) and (not folder or not os.path.isdir(existing)):
        what = "the folder of files it writes" if folder else "the file it writes"
        raise UserError(f"--output={path} exists; name a new place for {what}, or move it away")
    if not os.path.isdir(existing):
        raise UserError(f"--output={path} is under {existing}, which is a file, not a folder; "
                        "choose another --output")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise UserError(f"cannot write --output={path}: {error.strerror} ({existing}); choose a "
                        "place you can write to") from None


def experiment_from_flags() -> tuple[ml_collections.ConfigDict, str]:
    """The parsed config and the workdir. The config file's folder and the current directory join
    the import path, so `config.trainer` may name a module beside the config or under the cwd."""
    config_path = flags.FLAGS["config"].config_filename
    sys.path[:0] = [os.getcwd(), os.path.dirname(os.path.abspath(config_path.split(":")[0]))]
    return _CONFIG.value, _WORKDIR.value or default_workdir(config_path)


def _parse_flags(argv: list[str]) -> list[str]:
    """Parses the flags; a config file that does not load or a bad override is one line and exit
    status 2."""
    try:
        remaining = flags.FLAGS(argv)
        if len(remaining) > 1:
            raise ValueError(f"unexpected argument {' '.join(map(repr, remaining[1:]))}: the command "
                             "takes only flags (--config=PATH[:VARIANT], --workdir=DIR, "
                             "--config.KEY=VALUE)")
        return remaining
    except Exception as error:  # absl and config_flags raise many types; the user needs the text.
        cause = error.args[0] if error.args else error
        if isinstance(error, AttributeError) and isinstance(cause, KeyError):
            # ConfigDict's way of saying an override names a key the config lacks: a field...
            error = _unknown_key(str(cause.args[0]))
        elif isinstance(error, KeyError) and isinstance(cause, str):  # ...or a whole section.
            error = _unknown_key(cause)
        text = str(error)
        if "Traceback (most recent call last)" in text:  # An exception inside get_config().
            text = text.split("Traceback")[0] + text.strip().splitlines()[-1]
        message = " ".join(text.split())
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _unknown_key(detail: str) -> str:
    """ConfigDict's "'key'\nDid you mean ..." as one sentence; the workdir is a flag of its own."""
    key, _, suggestion = detail.partition("\n")
    if key.strip("'\"") == "workdir":
        suggestion = "The workdir is a flag of its own: use --workdir=PATH."
    return f"unknown config key {key} in a --config override. {suggestion}".strip()


@contextlib.contextmanager
def _config_reads() -> Iterator[set[tuple[int, str]]]:
    """Records (id of the ConfigDict, key) for every config value the experiment's own code reads
    (`self.config.model.width`) while the block runs, so that a failure names only the overrides
    that code read."""
    reads: set[tuple[int, str]] = set()
    original = ml_collections.ConfigDict.__getitem__

    def recording(config: ml_collections.ConfigDict, key: str) -> Any:
        value = original(config, key)
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename == _CONFIG_DICT_FILE:
            caller = caller.f_back  # ConfigDict's __getattr__ reads through __getitem__.
        if caller is not None and errors.is_user_code(caller):
            reads.add((id(config), key))
        return value

    ml_collections.ConfigDict.__getitem__ = recording
    try:
        yield reads
    finally:
        ml_collections.ConfigDict.__getitem__ = original


_CONFIG_DICT_FILE = ml_collections.ConfigDict.__getitem__.__code__.co_filename


def _overrides_read(reads: set[tuple[int, str]]) -> str:
    """'model.width=0, ...': the command line's overrides whose value the experiment's code read."""
    config = _CONFIG.value
    read = []
    for key, value in config_flags.get_override_values(flags.FLAGS["config"]).items():
        section, _, field = key.rpartition(".")
        try:
            owner = config[section] if section else config
        except KeyError:
            continue
        if (id(owner), field) in reads:
            read.append(f"{key}={value}")
    return ", ".join(read)


def _hook_failure(error: Exception, reads: set[tuple[int, str]]) -> Optional[UserError]:
    """The one line for `error` raised in a method of the experiment's Trainer subclass (such as
    `build_model` failing on a config value), naming the method, the experiment's own line that
    failed and the command line's overrides that the experiment's code read (`_config_reads`); None
    when no such method is on the traceback (a bug elsewhere keeps its traceback)."""
    from mixloop.runner.trainer import Trainer

    hooks = [frame.f_code.co_name for frame, _ in errors.user_frames(error)
             if isinstance(frame.f_locals.get("self"), Trainer)] or errors.traced_hooks(error, Trainer)
    if not hooks:
        return None
    overrides = _overrides_read(reads)
    return UserError(f"{hooks[0]}() failed: {errors.described(error)}; check the "
                     "config values it reads"
                     + (f" (set on the command line: {overrides})" if overrides else ""))


def _exit_with(error: UserError) -> None:
    print(f"error: {errors.message_of(error)}", file=sys.stderr)
    sys.exit(error.exit_code)


def run(command: Callable[[], None]) -> None:
    """Runs `command` as a program: flags parsed, a `UserError` printed as one line with its exit
    code, and so is any exception raised in the experiment's Trainer methods (`_hook_failure`)."""

    flags.mark_flag_as_required("config")
    app.run(lambda argv: guarded(command), flags_parser=_parse_flags)


def guarded(command: Callable[[], None]) -> None:
    """Runs `command` with a `UserError`, or an exception raised in the experiment's Trainer
    methods, printed as one `error:` line and the process ended with its exit code."""
    reads: set[tuple[int, str]] = set()
    try:
        with _config_reads() as reads:
            command()
    except UserError as error:
        _exit_with(error)
    except Exception as error:  # The experiment's own hook failing is one line; the rest not.
        user_error = _hook_failure(error, reads)
        if user_error is None:
            raise
        _exit_with(user_error)
    finally:
        interrupts.disarm()
