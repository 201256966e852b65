"""The model's side of a lighter run: trainable weights stored in bfloat16, activations recomputed.

`precision.master_weights="bfloat16"` stores the trainable weights in bfloat16 (2 bytes instead of
4): a layer computing in bfloat16 reads them as it read their autocast copies, one computing in
float32 reads them cast up, the gradients still reach the optimizer in float32, and the optimizer
rounds each new weight to bfloat16 stochastically (engine/compact_optimizer.py), so that updates
smaller than bfloat16's spacing still move a weight in expectation (Zamirai et al. 2020). FP8
layers and the variables Keras overwrites (their scales) keep float32.

`train.recompute` names layers whose activations the backward pass recomputes instead of keeping
(`tf.recompute_grad`): memory for one more forward of those layers.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Collection, Optional

import keras
import tensorflow as tf

from mixloop.engine import keras_adapter
from mixloop.engine.layer_precision import matching_paths, named_layers

BFLOAT16 = "bfloat16"


def store_weights_in_bfloat16(model: keras.Model, trained: Optional[Collection] = None) -> int:
    """Stores `model`'s float32 trainable variables in bfloat16 (those an optimizer trains, when
    `trained`, the objectives' variables, is given); returns how many values moved.

    A layer computing in bfloat16 reads them as it read their autocast copies; a layer computing in
    float32 (the float32 placement) reads them cast up to float32, so it still computes in float32.
    FP8 layers and variables Keras overwrites (their scales) keep float32, and so does a variable
    no optimizer trains (a momentum target network, a buffer `after_update` writes): its updates
    are not rounded stochastically, and bfloat16 would round its small moves away. Call it after the
    float32 and FP8 placements and the objectives, and before the optimizers are built.
    """
    moved = 0
    for layer, stored in bfloat16_storable(model, trained).items():
        for variable in stored:
            keras_adapter.store_as(variable, BFLOAT16)
            moved += math.prod(variable.shape)
        if layer.compute_dtype != BFLOAT16:
            object.__setattr__(layer, "call", _reading_weights_as(layer.call, layer.compute_dtype))
    return moved


def bfloat16_storable(model: keras.Model, trained: Optional[Collection] = None
                      ) -> dict[keras.layers.Layer, list]:
    """Per layer, the variables `store_weights_in_bfloat16` stores in bfloat16: its own float32
    trainable ones (of `trained`, when given), outside FP8 layers, but for those Keras overwrites
    (their scales)."""
    trained_ids = None if trained is None else {id(v) for v in trained}
    found = {}
    for layer in named_layers(model).values():
        stored = [v for v in keras_adapter.own_trainable_variables(layer)
                  if v.dtype == "float32" and not v.overwrite_with_gradient
                  and (trained_ids is None or id(v) in trained_ids)]
        if stored and layer.quantization_mode is None:
            found[layer] = stored
    return found


def _reading_weights_as(call: Callable, dtype: str) -> Callable:
    """`call`, reading the layer's floating variables cast to `dtype`."""

    @functools.wraps(call)
    def call_reading_weights_as(*args, **kwargs):
        with keras_adapter.reading_variables_as(dtype):
            return call(*args, **kwargs)

    return call_reading_weights_as


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
        object.__setattr__(layer, "call", _recomputed(layer.call, layer.non_trainable_variables,
                                                      layer.compute_dtype))
    return paths


def _recomputed(call: Callable, state: list, compute_dtype: str) -> Callable:
    """`call` under `tf.recompute_grad`, recomputed from the `state` it started from, its variables
    read in `compute_dtype`.

    The recomputation first puts back the layer's non-trainable variables as the forward found
    them, so that it draws the forward's dropout masks (Keras seed states) and moves BatchNorm's
    statistics as the forward did, not a second time: without it, a Dropout layer's gradient came
    from another mask than its loss. It reads the layer's variables in its compute dtype, as
    Keras's `__call__` has them read around the forward's `call` (its autocast scope): the backward
    pass recomputes outside that scope, where a 16-bit layer's float32 weights would come out as
    float32 activations the 16-bit gradient ops refuse. The keyword arguments (`training`, masks)
    are bound outside: TensorFlow's custom gradients take only positional tensors in a graph,
    which is why Keras's own `RematScope` fails there.
    """

    @functools.wraps(call)
    def recomputed_call(*args, **kwargs):
        start = [tf.identity(variable.value) for variable in state]

        def from_start(*inputs):
            for variable, value in zip(state, start):
                variable.assign(value)
            with keras_adapter.reading_variables_as(compute_dtype):
                return call(*inputs, **kwargs)

        return tf.recompute_grad(from_start)(*args)

    return recomputed_call
