"""The Keras private names mixloop relies on, in one place, each pinned by tests/engine/test_keras_adapter.py.

Keras 3 has no public call for these. When Keras changes one, its test fails loudly and names it,
instead of a layer silently computing in the wrong dtype or gradients being summed twice.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow import nn as tensorflow_backend_nn


def sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers `layer` tracks directly."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def output_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers that produce a functional or sequential model's outputs (none for the rest)."""
    outputs = getattr(layer, "outputs", None) if isinstance(layer, keras.Model) else None
    return [tensor._keras_history.operation for tensor in keras.tree.flatten(outputs or [])]


def name_counters():
    """Keras's per-thread counters behind the numbers of unnamed layers."""
    return global_state.get_global_attribute("object_name_uids")


def set_name_counters(counters) -> None:
    """Replaces those counters (None: Keras starts new ones)."""
    global_state.set_global_attribute("object_name_uids", counters)


def thread_state() -> dict:
    """Keras's global state as this thread sees it (Keras keeps it per thread: the global dtype
    policy, the unseeded random ops' seed generator, the name counters, its scopes)."""
    return dict(vars(global_state.GLOBAL_STATE_TRACKER))


def adopt_thread_state(state: dict) -> None:
    """Makes this thread see Keras's global state `state` (`thread_state()` of another thread)."""
    for name, value in state.items():
        setattr(global_state.GLOBAL_STATE_TRACKER, name, value)


def leave_gradients_summed(optimizer: keras.optimizers.Optimizer) -> None:
    """Makes `optimizer.apply` under several replicas use the gradients as given.

    The train step all-reduces the gradients itself, once for every objective, before checking and
    clipping them; Keras's TensorFlow optimizer would otherwise sum the already summed gradients
    over the replicas a second time.
    """
    optimizer._all_reduce_sum_gradients = list


def store_as(variable: keras.Variable, dtype: str) -> None:
    """Re-creates `variable`'s storage in `dtype`, with its value cast (a Keras variable's dtype
    is fixed at creation; the layer keeps the same variable object, so its tracking, paths and
    autocasting see the new dtype). Call it before an optimizer or a checkpoint holds the
    variable: they would keep the old storage."""
    value = keras.ops.cast(variable.value, dtype)
    variable._dtype = dtype
    variable._value = None
    variable._initialize(value)


def own_trainable_variables(layer: keras.layers.Layer) -> list[keras.Variable]:
    """The trainable variables `layer` created itself (not its sublayers')."""
    return [v for v in layer._trainable_variables if v.trainable]


def reading_variables_as(dtype: str):
    """A context in which reading a layer's floating variable gives it cast to `dtype`: what Keras
    enters around a mixed-precision layer's call (its `AutocastScope`), here for a layer computing
    in float32 whose weights are stored in bfloat16."""
    return keras.src.backend.AutocastScope(dtype)


def replace_backend_gelu(gelu: Callable[[Any, bool], Any]) -> Callable[[Any, bool], Any]:
    """Makes `gelu(x, approximate)` the GELU of Keras's TensorFlow backend, which `keras.ops.gelu`,
    `keras.activations.gelu` and every `activation="gelu"` look up at each call; returns the one
    it replaced."""
    previous, tensorflow_backend_nn.gelu = tensorflow_backend_nn.gelu, gelu
    return previous
