"""Which layers train in FP8 (`precision.float8_layers`), quantized by Keras's own float8 layers.

Keras 3 trains a Dense or EinsumDense layer in FP8 once `layer.quantize("float8")` made it a
quantize-dequantize (QDQ) layer: its inputs and kernel pass through float8_e4m3fn and its output
gradient through float8_e5m2, each with a scale and an amax history that the optimizer overwrites
with their "gradients" (`overwrite_with_gradient`). Its dtype policy becomes
`float8_from_<its policy>`: the dequantized values compute in the dtype the layer computed in.

The selection runs after the float32 placement (layer_precision), so that `auto` sees it on the
model: it takes each Dense and EinsumDense still computing in the run's compute dtype, which leaves
out those the placement keeps in float32, and it leaves out the output layers (the model's outputs
and any layer named `logits`, under every policy), whose values the loss reads. A regex quantizes
what it names: one that the placement kept in float32 trains in float8 over float32
(`float8_from_float32`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras

from mixloop.errors import ConfigError
from mixloop.engine import keras_adapter
from mixloop.engine.layer_precision import (LOGITS_LAYER_NAME, matching_paths, named_layers,
                                            shown_paths)
from mixloop.engine.policy import Policy

SETTING = "config.precision.float8_layers"
# Keras's `quantize` refuses their subclasses (`type_check`), so the types are matched exactly.
FLOAT8_TYPES: tuple[type, ...] = (keras.layers.Dense, keras.layers.EinsumDense)
FLOAT8 = "float8"  # Keras's quantization mode.


AUTO = "auto"  # precision.float8_layers="auto": every Dense and EinsumDense that can train in FP8.


def quantize_selected(model: keras.Model, policy: Policy, setting: str) -> list[str]:
    """Quantizes the layers `setting` selects to float8; returns their paths, in model order.

    Call it after the float32 placement, under the run's `policy`. `setting` is "" (nothing),
    `auto` (see the module docstring) or a regex over layer paths, fully matched. Layers float8
    already (the research code quantized them) are left as they are and not returned.

    Raises:
      ConfigError: when the regex matches no layer path, or matches a layer Keras cannot train in
        float8 (a type other than Dense and EinsumDense, or one quantized otherwise): naming only
        some of a block's layers would leave the rest silently in 16 bits.
    """
    if not setting:
        return []
    layers = named_layers(model)
    paths = auto_paths(model, policy) if setting == AUTO else _regex_paths(setting, layers)
    quantize(model, paths)
    return paths


def quantize(model: keras.Model, paths: Sequence[str]) -> None:
    """Quantizes the layers at `paths` (as `quantize_selected` returned them for another build of
    the same model, e.g. the export's) to float8 with Keras's `layer.quantize`."""
    layers = named_layers(model)
    for path in paths:
        layers[path].quantize(FLOAT8)


def without_float8_state(model: keras.Model, paths: Sequence[str]) -> list:
    """`model.get_weights()` less the scales and amax histories of the layers at `paths`: the
    weights of the same model built without quantizing them, in its order (Keras adds a layer's
    float8 variables after its own)."""
    layers = named_layers(model)
    float8_state = {id(v) for path in paths for v in layers[path].weights if v.overwrite_with_gradient}
    return [v.numpy() for v in model.weights if id(v) not in float8_state]


def describe(model: keras.Model, setting: str, max_paths: int = 6) -> Optional[str]:
    """One log line: which layers train in FP8, grouped by dtype policy; None when `setting` is
    off and no layer is float8 (a run without FP8 says nothing about it)."""
    groups: dict[str, list[str]] = {}
    layers = named_layers(model)
    for path in float8_paths(model):
        groups.setdefault(layers[path].dtype_policy.name, []).append(path)
    if not groups:
        return (f"No layer trains in FP8: {SETTING}={setting!r} selected none (only Dense and "
                "EinsumDense layers outside the output layers and the float32 placement)"
                if setting else None)
    parts = [f"{len(paths)} as {name} ({shown_paths(paths, max_paths)})"
             for name, paths in groups.items()]
    return "Layers training in FP8 (Keras's float8 QDQ): " + "; ".join(parts)


def float8_paths(model: keras.Model) -> list[str]:
    """The paths of the model's layers that train in FP8 (quantized by the config or by the
    research code), in model order."""
    return [path for path, layer in named_layers(model).items() if layer.quantization_mode == FLOAT8]


def can_train_in_float8(layer: keras.layers.Layer) -> bool:
    """Whether Keras's `quantize("float8")` takes `layer` (it refuses subclasses), or took it."""
    return _refusal(layer) is None


def auto_paths(model: keras.Model, policy: Policy) -> list[str]:
    """`auto`: the unquantized Dense and EinsumDense layers computing in the policy's compute dtype,
    except the output layers."""
    outputs = {id(layer) for layer in _output_layers(model)}
    return [path for path, layer in named_layers(model).items()
            if type(layer) in FLOAT8_TYPES and layer.quantization_mode is None
            and layer.compute_dtype == policy.compute_dtype.name
            and id(layer) not in outputs and layer.name != LOGITS_LAYER_NAME]


def _output_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers producing `layer`'s outputs, and inside a nested model producing them, theirs."""
    found = []
    for output in keras_adapter.output_layers(layer):
        found += [output] + _output_layers(output)
    return found


def _regex_paths(pattern: str, layers: dict[str, keras.layers.Layer]) -> list[str]:
    """The paths `pattern` fully matches, not yet float8; refuses what cannot train in float8."""
    matched = matching_paths(pattern, list(layers), setting=SETTING)
    for path in matched:
        refusal = _refusal(layers[path])
        if refusal:
            eligible = [p for p, layer in layers.items() if can_train_in_float8(layer)]
            raise ConfigError(
                f"{SETTING}={pattern!r} matches {path}, {refusal}; Keras trains only Dense and "
                f"EinsumDense layers in float8, here: {shown_paths(eligible, 5) or 'none'}")
    return [path for path in matched if layers[path].quantization_mode is None]


def _refusal(layer: keras.layers.Layer) -> Optional[str]:
    """Why Keras cannot train `layer` in float8, or None when it can (or does already)."""
    if type(layer) not in FLOAT8_TYPES:
        return f"a {type(layer).__name__}"
    if layer.quantization_mode not in (None, FLOAT8):
        return f"quantized as {layer.quantization_mode} already"
    return None
