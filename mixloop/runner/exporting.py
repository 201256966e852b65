"""Loading an exported `.keras` model: which of its classes need code from outside Keras, and how to say so.

Keras rebuilds its own classes, and keras-hub's, from the file alone. Any other class (a research
layer, a subclassed model) must be registered with `@keras.saving.register_keras_serializable` and
its module imported before `keras.models.load_model`: Keras never imports code named by a file it
reads. The export's log line states the exact loading code; a class that no loader could rebuild is
a warning when the export is written, not a surprise at inference.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from typing import Any, Iterator

# The packages whose classes Keras finds (importing them if need be) while loading.
_KERAS_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp")


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
