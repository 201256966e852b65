"""The compile-mode cache: what `jit_compile=auto` measured, kept outside the workdir so that the
next run of the same setup on the same machine skips the probe.

The probe compiles and times the train loop three ways, which costs seconds to a minute
(docs/speed.md); the answer depends only on the machine and the setup, so it is measured once. The
cache is one JSON file, `compile_modes.json`, in `$MIXLOOP_CACHE_DIR` (default
`$XDG_CACHE_HOME/mixloop`, else `~/.cache/mixloop`); `MIXLOOP_CACHE_DIR=off` turns it off, and
`jit_compile=auto` then measures every new workdir. An entry is keyed by a hash of what decides a
mode's speed (`setup`): the machine (CPU model and flags, GPU names), TensorFlow's version, the
policy, the batch, its accumulation and the shapes of its elements, the XLA flags and threads, the
config's model section, the experiment's source files and mixloop's engine (the step, the
gradients it takes, its GELU), and a signature of the model (each layer's class and dtype policy,
each variable's path, shape and dtype). A file that cannot be read, parsed or written costs one
warning line, and the run measures as it would without a cache.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import inspect
import json
import os
import pathlib
from typing import Any, Iterator, Optional

import keras
import tensorflow as tf
from absl import logging

from mixloop import files, machine
from mixloop.engine.layer_precision import named_layers

# mixloop's engine: its step, the gradients it takes and its GELU (engine/*.py), part of every key.
ENGINE_FOLDER = pathlib.Path(__file__).resolve().parent.parent / "engine"

CACHE_ENV = "MIXLOOP_CACHE_DIR"
OFF = "off"
FILE_NAME = "compile_modes.json"


def cache_path() -> Optional[str]:
    """The cache file's path, or None when `MIXLOOP_CACHE_DIR=off`."""
    folder = os.environ.get(CACHE_ENV)
    if folder == OFF:
        return None
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "mixloop")
    return os.path.join(folder, FILE_NAME)


def setup(run) -> dict[str, Any]:
    """What a compile mode's speed depends on, as JSON-ready values."""
    config = run.config
    return {
        "machine": _machine(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        # mixloop's clustering flags for "elementwise" (set at import) and the user's own.
        "tf_xla_flags": os.environ.get("TF_XLA_FLAGS", ""),
        "threads": [machine.usable_cores(), os.environ.get("TF_NUM_INTRAOP_THREADS"),
                    os.environ.get("OMP_NUM_THREADS")],
        "replicas": run.strategy.num_replicas_in_sync,
        "precision": config.precision.to_dict(),
        "train": {key: config.train[key] for key in (
            "batch_size", "accumulation_steps", "accumulation_dtype", "batch_loss", "ema_decay",
            "recompute", "steps_per_loop")},
        "optimizer": {key: config.optimizer[key] for key in ("name", "state_dtype")},
        "trainer": [f"{type(run.trainer).__module__}.{type(run.trainer).__qualname__}",
                    _source_hash(type(run.trainer))],
        # mixloop's step: a changed step or gradient may change which mode is fastest.
        "engine": files_hash(sorted(ENGINE_FOLDER.glob("*.py"))),
        "model": json.loads(json.dumps(config.model.to_dict(), default=str)),
        "data": [(str(spec.shape), spec.dtype.name)
                 for spec in tf.nest.flatten(run.train_element_spec)],
        "layers": [(path, type(layer).__name__, layer.dtype_policy.name)
                   for path, layer in named_layers(run.model).items()],
        "variables": [(v.path, list(v.shape), str(v.dtype)) for v in run.model.variables],
    }


def _source_hash(trainer_class: type) -> str:
    """A SHA-256 of the files that define `trainer_class` and its bases (the experiment's code: a
    changed `compute_loss` may change which mode is fastest, or whether XLA compiles it at all)."""
    def source_file(cls):
        try:
            return inspect.getsourcefile(cls)
        except TypeError:  # A builtin.
            return None
    return files_hash([path for path in map(source_file, trainer_class.__mro__) if path])


def files_hash(paths: list) -> str:
    """A SHA-256 of the files' contents, in order; a file that cannot be read (a class defined in a
    notebook) adds nothing."""
    digest = hashlib.sha256()
    for path in paths:
        try:
            with open(path, "rb") as file:
                digest.update(file.read())
        except OSError:
            continue
    return digest.hexdigest()


def _machine() -> dict[str, Any]:
    """The CPU (`cpu`) and the GPUs' names."""
    gpus = [tf.config.experimental.get_device_details(gpu).get("device_name", gpu.name)
            for gpu in tf.config.list_physical_devices("GPU")]
    return {**machine.cpu(), "gpus": gpus}


def key_of(setup_values: dict[str, Any]) -> str:
    """The entry's key: a SHA-256 of `setup_values` as canonical JSON."""
    text = json.dumps(setup_values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def lookup(key: str) -> Optional[dict[str, Any]]:
    """The entry stored under `key` ({"mode", "examples_per_sec", "measured_at"}), or None: no
    cache, no such entry, or a file that cannot be read (one warning line)."""
    entry = _read_all().get(key)
    return entry if isinstance(entry, dict) and "mode" in entry else None


def store(key: str, mode: Any, examples_per_sec: dict[str, float]) -> None:
    """Stores `mode` (and the speeds that chose it) under `key`; a cache that cannot be written is
    one warning line. Written whole to a temporary file and renamed, so a reader never sees half."""
    path = cache_path()
    if path is None:
        return
    try:
        with _locked(path):  # Two runs storing at once: each reads the other's entry, not an old file.
            entries = _read_all()
            entries[key] = {"mode": mode, "examples_per_sec": examples_per_sec,
                            "measured_at": datetime.datetime.now().isoformat(timespec="seconds")}
            files.write_json(path, entries, sort_keys=True)
    except OSError as error:
        logging.warning("Could not write the compile-mode cache %s (%s); the next run of this "
                        "setup measures again (%s=off turns the cache off)", path,
                        error.strerror or error, CACHE_ENV)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Holds an exclusive lock on `path`.lock (made with its folder if need be) for the block."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_all() -> dict[str, Any]:
    """Every entry of the cache file; {} without one, or (one warning line) for one that cannot be
    read or is not a JSON object."""
    path = cache_path()
    if path is None or not os.path.exists(path):
        return {}
    try:
        with open(path) as file:
            entries = json.load(file)
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
        return entries
    except (OSError, ValueError) as error:
        logging.warning("Ignoring the compile-mode cache %s: %s; it is rewritten after the next "
                        "probe (%s=off turns the cache off)", path, error, CACHE_ENV)
        return {}
