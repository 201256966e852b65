"""Per-layer precision: building a Keras model under a policy, with sensitive layers kept in float32.

Keras 3 gives every layer a `DTypePolicy`; a global policy set while the model is built makes every
layer mixed, and assigning `layer.dtype_policy` afterwards switches a single layer back to float32
compute (its variables are float32 already). We set the per-layer policy after construction rather
than through a `DTypePolicyMap` because the research code builds the model and must not have to thread
a dtype argument through every layer.
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable, Iterator

import keras

from mixloop.policy import Policy

# Layer types whose arithmetic loses too much in 16 bits: reductions over many elements (norms),
# exponentials (softmax, including the one inside MultiHeadAttention) and table lookups whose rows
# are read back as float32 master weights.
FLOAT32_LAYER_TYPES: tuple[type, ...] = (
    keras.layers.LayerNormalization,
    keras.layers.BatchNormalization,
    keras.layers.GroupNormalization,
    keras.layers.UnitNormalization,
    keras.layers.RMSNormalization,
    keras.layers.Softmax,
    keras.layers.Embedding,
)


@contextlib.contextmanager
def global_dtype_policy(policy: Policy) -> Iterator[None]:
    """Sets Keras's global dtype policy to `policy` for the layers built inside the block."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy.keras_name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def build_model(
    build_fn: Callable[[], keras.Model], policy: Policy, float32_layers: str = ""
) -> keras.Model:
    """Calls `build_fn` under `policy`, then keeps the numerically sensitive layers in float32.

    Args:
      build_fn: returns a built Keras model (its variables must exist).
      policy: parameter and compute dtypes for the layers.
      float32_layers: a regex; layers whose path fully matches it also compute in float32.
    """
    with global_dtype_policy(policy):
        model = build_fn()
    keep_float32_layers(model, policy, float32_layers)
    return model


def keep_float32_layers(model: keras.Model, policy: Policy, pattern: str = "") -> list[str]:
    """Switches the sensitive layers of `model` to float32 compute; returns their paths.

    Sensitive layers are those of `FLOAT32_LAYER_TYPES`, the layers that produce the outputs of a
    functional or sequential model (the final logits), any layer named `logits` (for subclassed
    models), and any layer whose path (its name, for sublayers Keras gives no path) fully matches
    `pattern`, together with all of that layer's sublayers. Does nothing unless the policy computes
    in a lower precision than its float32 parameters.
    """
    if not policy.is_mixed or policy.param_dtype.name != "float32":
        return []
    matcher = re.compile(pattern) if pattern else None
    output_layers = _output_layers(model)
    kept = {}
    for layer in model._flatten_layers(include_self=False):
        if matcher is not None and matcher.fullmatch(layer_path(layer)):
            # Keras reads each sublayer's own policy, so switching only a block (e.g. attention)
            # would leave its projections computing in 16 bits.
            kept.update((id(sub), sub) for sub in layer._flatten_layers(include_self=True))
        elif (
            isinstance(layer, FLOAT32_LAYER_TYPES)
            or any(layer is output for output in output_layers)
            or layer.name == "logits"
        ):
            kept[id(layer)] = layer
    for layer in kept.values():
        layer.dtype_policy = "float32"
    return [layer_path(layer) for layer in kept.values()]


def layer_path(layer: keras.layers.Layer) -> str:
    """The layer's path, or its name for sublayers without a `build` (e.g. attention's softmax)."""
    return layer.path or layer.name


def _output_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers that produce a functional or sequential model's outputs (none for subclassed)."""
    try:
        outputs = model.outputs
    except AttributeError:
        return []
    return [tensor._keras_history.operation for tensor in keras.tree.flatten(outputs or [])]
