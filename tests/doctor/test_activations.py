"""Activations by layer (mixloop/doctor/activations.py): what a traced forward's layers create per
example, what recomputing them costs, and the greedy choice the memory plan makes from them."""

import keras
import pytest
import tensorflow as tf

from mixloop.doctor import activations
from mixloop.doctor.activations import LayerActivations


def _model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(5, activation="gelu", name="wide")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, use_bias=False, name="out")(hidden))


def test_a_layer_counts_what_its_call_creates_inside_per_example_and_its_multiply_adds():
    model = _model()
    found = {layer.path: layer for layer in activations.by_layer(
        model, lambda x: model(x, training=True), tf.TensorSpec([4, 3]), 4)}
    wide = found["wide"]
    # The product and the bias sum (5 float32 values each) and GELU's temporaries, its output left
    # out; every count a whole number of 5-value float32 rows.
    assert wide.bytes_per_example >= 2 * 5 * 4 and wide.bytes_per_example % (5 * 4) == 0
    # 15 multiply-adds of the 3x5 product, plus one per element made.
    assert wide.cost_per_example == 15 + wide.bytes_per_example / 4 + 5
    # "out" makes nothing beside its output (a product without bias): no candidate.
    assert "out" not in found
    assert "call" not in model.get_layer("wide").__dict__  # The recording taken off.


def test_the_choice_is_cheapest_per_byte_first_and_never_a_layer_with_one_inside_it():
    candidates = [LayerActivations("block", 10.0, 100.0), LayerActivations("block/norm", 4.0, 1.0),
                  LayerActivations("mlp", 6.0, 30.0)]
    assert [c.path for c in activations.chosen(candidates, 3.0)] == ["block/norm"]
    # block/norm (0.25 per byte), mlp (5), then block (10) holds block/norm: left out.
    assert [c.path for c in activations.chosen(candidates, 20.0)] == ["block/norm", "mlp"]
    assert activations.pattern([candidates[1], LayerActivations("a.b", 1, 1)]) == r"block/norm|a\.b"


@pytest.mark.parametrize("equation, shapes, multiply_adds", [
    ("abc,cd->abd", ([2, 3, 4], [4, 5]), 2 * 3 * 4 * 5),
    ("aecd,abcd->acbe", ([2, 7, 3, 4], [2, 6, 3, 4]), 2 * 7 * 3 * 4 * 6)])
def test_einsum_multiply_adds_multiply_every_index_size(equation, shapes, multiply_adds):
    graph = tf.function(lambda a, b: tf.einsum(equation, a, b)).get_concrete_function(
        *(tf.TensorSpec(shape) for shape in shapes)).graph
    (einsum,) = [op for op in graph.get_operations() if op.type == "Einsum"]
    assert activations._multiply_adds(einsum) == multiply_adds
