"""Activations by layer: what each layer's call creates per example in a traced forward pass, and what
recomputing it would cost, for the memory budget's choice of layers to recompute (runner/memory_plan.py).

A layer recomputed in the backward pass (`train.recompute`) keeps its inputs and drops the tensors
its call made inside, making them again in the backward pass. So its saving is counted, per
example, as the bytes of every batch-shaped tensor the ops of its call produce, less its outputs
(which its consumers keep); its cost as the multiply-adds of those ops (matrix products, einsums,
convolutions) plus one per element they produce (the elementwise work). Both come from one trace of
the model's forward on a micro-batch's spec; the saving is an upper bound (a backward pass does not
keep every intermediate), which the planner's probe then measures.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import keras
import tensorflow as tf

from mixloop.engine.layer_precision import named_layers

# Ops that create no activation of their own: reading a variable, identities, shapes, constants
# (a weight's cast is left out by its shape: it has no batch dimension).
_NOT_ACTIVATIONS = {"ReadVariableOp", "Identity", "Shape", "Const", "Placeholder", "NoOp"}


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """One layer's recompute candidate: its path, the bytes per example its call creates inside
    (its outputs left out), and the multiply-adds plus elements per example recomputing it costs."""

    path: str
    bytes_per_example: float
    cost_per_example: float


def by_layer(model: keras.Model, forward: Callable[[Any], Any], inputs_spec: Any,
             batch_size: int) -> list[LayerActivations]:
    """Every layer of `model` (by path, parents too) whose call creates batch-shaped tensors, from
    one trace of `forward` on `inputs_spec` (a micro-batch of `batch_size` examples).

    The layers' `call`s are wrapped for the trace and put back afterwards.
    """
    layers = named_layers(model)
    spans: dict[str, list] = {}
    originals = {}
    for path, layer in layers.items():
        originals[path] = layer.__dict__.get("call")
        object.__setattr__(layer, "call", _recording(layer.call, path, spans))
    try:
        tf.function(forward, autograph=False).get_concrete_function(inputs_spec)
    finally:
        for path, layer in layers.items():
            if originals[path] is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", originals[path])
    found = []
    for path, (operations, outputs) in spans.items():
        made = [t for op in operations if op.type not in _NOT_ACTIVATIONS for t in op.outputs
                if _is_batched(t, batch_size)]
        kept = {t.ref() for t in tf.nest.flatten(outputs) if isinstance(t, tf.Tensor)}
        inside = sum(_bytes(t) for t in made if t.ref() not in kept)
        if inside:
            cost = sum(_multiply_adds(op) for op in operations) + sum(
                t.shape.num_elements() for t in made)
            found.append(LayerActivations(path, inside / batch_size, cost / batch_size))
    return found


def chosen(candidates: list[LayerActivations], needed_bytes_per_example: float
           ) -> list[LayerActivations]:
    """Layers to recompute that save at least `needed_bytes_per_example` (all when none do),
    cheapest per byte saved first, never a layer and one inside it (PyTorch's activation budget
    solves this knapsack exactly; greedy by ratio is within one item of it)."""
    picked: list[LayerActivations] = []
    saved = 0.0
    for candidate in sorted(candidates, key=lambda c: c.cost_per_example / c.bytes_per_example):
        if saved >= needed_bytes_per_example:
            break
        if any(_nested(candidate.path, other.path) for other in picked):
            continue
        picked.append(candidate)
        saved += candidate.bytes_per_example
    return picked


def pattern(layers: list[LayerActivations]) -> str:
    """The `train.recompute` regex that matches exactly `layers`' paths."""
    return "|".join(re.escape(layer.path) for layer in layers)


def _nested(path: str, other: str) -> bool:
    return path == other or path.startswith(other + "/") or other.startswith(path + "/")


def _recording(call: Callable, path: str, spans: dict) -> Callable:
    """`call` noting the graph ops it created and what it returned, under `path` (the first call
    of a layer called more than once)."""

    def recorded(*args, **kwargs):
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        outputs = call(*args, **kwargs)
        if path not in spans:
            spans[path] = (graph.get_operations()[before:], outputs)
        return outputs

    return recorded


def _is_batched(tensor: tf.Tensor, batch_size: int) -> bool:
    return bool(tensor.shape.rank) and tensor.shape[0] == batch_size and tensor.shape.is_fully_defined()


def _bytes(tensor: tf.Tensor) -> int:
    return tensor.shape.num_elements() * tensor.dtype.size


def _multiply_adds(op: tf.Operation) -> int:
    """The multiply-adds of a matrix product, einsum or convolution op; 0 for any other."""
    try:
        if op.type == "MatMul":
            a, b = (t.shape for t in op.inputs)
            return a[0] * a[1] * (b[0] if op.get_attr("transpose_b") else b[1])
        if op.type in ("BatchMatMulV2", "BatchMatMulV3"):
            out = op.outputs[0].shape
            a = op.inputs[0].shape
            return out.num_elements() * (a[-2] if op.get_attr("adj_x") else a[-1])
        if op.type == "Einsum":
            return _einsum_multiply_adds(op.get_attr("equation").decode(), op.inputs)
        if op.type in ("Conv2D", "Conv1D", "Conv3D", "DepthwiseConv2dNative"):
            kernel = op.inputs[1].shape
            return op.outputs[0].shape.num_elements() * math.prod(kernel[:-1]) // (
                kernel[-2] if op.type == "DepthwiseConv2dNative" else 1)
    except (TypeError, ValueError):  # An unknown dimension: counted as elementwise work only.
        return 0
    return 0


def _einsum_multiply_adds(equation: str, inputs: Any) -> int:
    """The product of every index's size (each output element sums over the contracted ones)."""
    operands = equation.split("->")[0].split(",")
    if "..." in equation or len(operands) != len(inputs):
        return 0
    sizes = {}
    for letters, tensor in zip(operands, inputs):
        for letter, size in zip(letters, tensor.shape):
            sizes[letter] = size
    return math.prod(sizes.values())

