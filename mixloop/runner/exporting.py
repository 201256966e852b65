"""The float32 `.keras` export at a run's end, and loading it: which of its classes need code from
outside Keras, and how to say so.

Keras rebuilds its own classes, and keras-hub's, from the file alone. Any other class (a research
layer, a subclassed model) must be registered with `@keras.saving.register_keras_serializable` and
its module imported before `keras.models.load_model`: Keras never imports code named by a file it
reads. The export's log line states the exact loading code; a class that no loader could rebuild is
a warning when the export is written, not a surprise at inference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import zipfile
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import keras
from absl import logging

from mixloop.engine import float8_layers, layer_precision
from mixloop.engine.policy import Policy
from mixloop.errors import UserError

# The packages whose classes Keras finds (importing them if need be) while loading.
_KERAS_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp")


def export(build_model: Callable[[], keras.Model], model: keras.Model, float8_paths: Sequence[str],
           weights_for_export: Callable[[], ContextManager[Any]], workdir: str) -> Optional[str]:
    """Saves `model`'s weights (as `weights_for_export()` makes them: the EMA weights when on) in
    a float32 model `build_model()` makes, as `workdir/model.keras` for inference; returns the
    path, or None (with a warning naming the reason) when Keras cannot save one of its layers, e.g.
    one without a `get_config`. The layers at `float8_paths` (trained in FP8) are saved as the
    plain layers `build_model` makes, with their trained weights: FP8 is how the run trains, and
    Keras cannot reload a float8 MultiHeadAttention.

    Logs the code that loads it (`loading_code`: plain `keras.models.load_model` for a model of
    Keras and keras-hub classes, after importing the modules of any others), and warns about a class
    no loader could rebuild.

    Raises:
      UserError: when `model.keras` cannot be replaced (a folder); nothing half-written stays.
    """
    with layer_precision.building_under(Policy.from_string("float32")):
        export_model = build_model()
    with weights_for_export():
        export_model.set_weights(float8_layers.without_float8_state(model, float8_paths))
    path = os.path.join(workdir, "model.keras")
    partial = os.path.join(workdir, "model-partial.keras")  # Keras needs the suffix.
    try:
        export_model.save(partial)  # Then renamed: a failed save leaves no broken model.keras.
    except (NotImplementedError, TypeError, ValueError) as error:  # A layer Keras cannot save.
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        logging.warning("Could not export the model (the checkpoints hold the trained weights): "
                        "%s", _export_failure(error))
        return None
    try:
        os.replace(partial, path)
    except OSError as error:  # A folder model.keras made during the run (checked at the start).
        os.remove(partial)
        raise UserError(f"could not export the model to {path}: {error.strerror}; move it away "
                        "and run the same command to export the trained weights (the "
                        "checkpoints hold them)") from None
    classes = custom_classes(path)
    logging.info("Exported the float32 model to %s; load it with: %s", path,
                 loading_code(path, classes))
    for problem in loading_problems(classes):
        logging.warning("The exported model will not load: %s", problem)
    return path


def _export_failure(error: Exception) -> str:
    """One line for an export Keras refused: the first paragraph of its message (Keras's run over
    many lines and go on with example code), and for a class Keras cannot rebuild without a
    `get_config`, what to add."""
    summary = " ".join(str(error).strip().split("\n\n")[0].split())
    unsaveable = re.search(r"Object (\w+) was created by passing", summary)
    if unsaveable:
        name = unsaveable[1]
        summary += (f" Add to {name} a get_config() that returns its __init__ arguments, e.g. "
                    f"`return {{**super().get_config(), \"width\": self.width}}`, and register it "
                    f"with @keras.saving.register_keras_serializable() (as gan_digits' GAN).")
    return f"{type(error).__name__}: {summary}"


@dataclasses.dataclass(frozen=True)
class CustomClass:
    """A class or function a saved model names from outside Keras."""

    name: str
    module: str
    registered: bool  # Whether `register_keras_serializable` gave it a registered name.


def custom_classes(path: str) -> list[CustomClass]:
    """The classes and functions outside Keras's packages that the model saved at `path` names,
    in the order they first appear."""
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    found: dict[tuple[str, str], CustomClass] = {}
    for entry in _serialized_objects(config):
        module = entry["module"] or "__main__"  # Keras writes None for a class of a script.
        if module.split(".")[0] in _KERAS_PACKAGES or module == "builtins":
            continue
        registered_name = entry.get("registered_name") or ""
        name = entry["config"] if entry["class_name"] == "function" else entry["class_name"]
        found.setdefault((module, str(name)), CustomClass(str(name), module, ">" in registered_name))
    return list(found.values())


def _serialized_objects(config: Any) -> Iterator[dict]:
    """Every `{"module": ..., "class_name": ...}` entry of a Keras config, depth first."""
    if isinstance(config, dict):
        if "module" in config and "class_name" in config:
            yield config
        for value in config.values():
            yield from _serialized_objects(value)
    elif isinstance(config, list):
        for value in config:
            yield from _serialized_objects(value)


def loading_code(path: str, classes: list[CustomClass]) -> str:
    """The Python that loads the model at `path`: the imports its `classes` need, then
    `keras.models.load_model`."""
    modules = sorted({c.module for c in classes} - {"__main__"})  # See `loading_problems`.
    return "; ".join(["import keras", *(f"import {module}" for module in modules),
                      f"model = keras.models.load_model({path!r})"])


def loading_problems(classes: list[CustomClass]) -> list[str]:
    """Why some of `classes` cannot be rebuilt by any loader, one sentence per class, with the fix."""
    problems = []
    for c in classes:
        if not c.registered:
            problems.append(
                f"{c.name} (from {c.module}) is not registered, so keras.models.load_model cannot "
                "rebuild it even with its module imported: decorate it with "
                "@keras.saving.register_keras_serializable(package=...) and give it a get_config() "
                "returning its constructor's arguments")
        elif c.module == "__main__":
            problems.append(f"{c.name} is defined in __main__ (a script or notebook), which a loader "
                            "cannot import: move it into a module")
    return problems
