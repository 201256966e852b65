"""The model's side of a lighter run: trainable weights stored in bfloat16, activations recomputed.

`precision.master_weights="bfloat16"` stores the trainable weights of every layer computing in
bfloat16 in bfloat16 (2 bytes instead of 4): the forward reads them as it read their autocast
copies, the gradients still reach the optimizer in float32, and the optimizer rounds each new
weight to bfloat16 stochastically (engine/compact_optimizer.py), so that updates smaller than
bfloat16's spacing still move a weight in expectation (Zamirai et al. 2020). Layers computing in
float32 (the float32 placement), FP8 layers and variables Keras overwrites keep float32.

`train.recompute` names layers whose activations the backward pass recomputes instead of keeping
(`tf.recompute_grad`): memory for one more forward of those layers.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import keras
import tensorflow as tf

from mixloop.engine import keras_adapter
from mixloop.engine.layer_precision import matching_paths, named_layers

BFLOAT16 = "bfloat16"


def store_weights_in_bfloat16(model: keras.Model) -> int:
    """Stores the float32 trainable variables of `model`'s layers that compute in bfloat16 in
    bfloat16; returns how many values moved. Call it after the float32 and FP8 placements and
    before the optimizer is built."""
    moved = 0
    for layer in named_layers(model).values():
        if layer.compute_dtype != BFLOAT16 or layer.quantization_mode is not None:
            continue
        for variable in keras_adapter.own_trainable_variables(layer):
            if variable.dtype == "float32" and not variable.overwrite_with_gradient:
                keras_adapter.store_as(variable, BFLOAT16)
                moved += math.prod(variable.shape)
    return moved


def recompute(model: keras.Model, pattern: str) -> list[str]:
    """Makes the layers whose paths `pattern` fully matches recompute their activations in the
    backward pass; returns their paths ("" recomputes none).

    Raises:
      ConfigError: when `pattern` matches no layer path.
    """
    if not pattern:
        return []
    layers = named_layers(model)
    paths = matching_paths(pattern, list(layers), setting="config.train.recompute")
    for path in paths:
        # Keras's `__call__` looks `call` up on the instance (as layer_precision's hand-back uses).
        layer = layers[path]
        object.__setattr__(layer, "call", _recomputed(layer.call, layer.non_trainable_variables))
    return paths


def _recomputed(call: Callable, state: list) -> Callable:
    """`call` under `tf.recompute_grad`, recomputed from the `state` it started from.

    The recomputation first puts back the layer's non-trainable variables as the forward found
    them, so that it draws the forward's dropout masks (Keras seed states) and moves BatchNorm's
    statistics as the forward did, not a second time: without it, a Dropout layer's gradient came
    from another mask than its loss (12.8 off at rate 0.5 in a small test). The keyword arguments
    (`training`, masks) are bound outside: TensorFlow's custom gradients take only positional
    tensors in a graph, which is why Keras's own `RematScope` fails there.
    """

    @functools.wraps(call)
    def recomputed_call(*args, **kwargs):
        start = [tf.identity(variable.value) for variable in state]

        def from_start(*inputs):
            for variable, value in zip(state, start):
                variable.assign(value)
            return call(*inputs, **kwargs)

        return tf.recompute_grad(from_start)(*args)

    return recomputed_call
