"""Per-layer precision, read from the traced train step: which ops run in 16 bits and which in float32."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import mixloop
from mixloop.layer_precision import global_dtype_policy, keep_float32_layers
from mixloop.policy import Policy
from mixloop.step import TrainStep

NUM_TOKENS, SEQ_LEN, WIDTH, NUM_CLASSES, BATCH_SIZE = 32, 6, 8, 3, 4
COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
MATRIX_OPS = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D", "Conv2DBackpropFilter")


def transformer():
    tokens = keras.Input((SEQ_LEN,), dtype="int32")
    x = keras.layers.Embedding(NUM_TOKENS, WIDTH, name="embed")(tokens)
    x = keras.layers.Dense(WIDTH, activation="relu", name="body")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    # dropout > 0 makes Keras use its explicit Softmax sublayer; dropout = 0 its fused
    # ops.dot_product_attention path, which carries out the softmax itself.
    x = keras.layers.MultiHeadAttention(2, WIDTH // 2, dropout=0.1, name="attention_softmax")(x, x)
    x = keras.layers.MultiHeadAttention(2, WIDTH // 2, dropout=0.0, name="attention_fused")(x, x)
    x = keras.layers.Dense(WIDTH, name="pre_norm_proj")(x)  # a name a user regex may catch
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(NUM_CLASSES, name="logits")(x))


def convnet():
    # A Sequential model whose output layer is not called "logits": kept in float32 as the output.
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(4, 3, activation="relu", name="conv_body"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(NUM_CLASSES, name="classifier"),
    ])


def token_batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.integers(0, NUM_TOKENS, (BATCH_SIZE, SEQ_LEN)), tf.int32),
            tf.constant(rng.integers(0, NUM_CLASSES, BATCH_SIZE), tf.int32))


def image_batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(BATCH_SIZE, 6, 6, 2)), tf.float32),
            tf.constant(rng.integers(0, NUM_CLASSES, BATCH_SIZE), tf.int32))


def cross_entropy(logits, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch[1], logits, from_logits=True))


def make_step(build_fn, policy_name, float32_layers="", optimizer=None, loss_fn=cross_entropy):
    policy = Policy.from_string(policy_name)
    model = mixloop.build_model(build_fn, policy, float32_layers=float32_layers)
    return TrainStep(model=model, optimizer=optimizer or keras.optimizers.SGD(0.1), loss_fn=loss_fn,
                     policy=policy)


def traced_ops(step, batch):
    """(op type, op name, data dtype) for every op of the compiled step, including those inside
    conditional branches and loop bodies, which live in the graph's function library."""
    graph_def = step._compiled.get_concrete_function(batch).graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    return [(n.op, n.name, _data_dtype(n)) for n in nodes]


def _data_dtype(node):
    """The dtype an op computes in: its `T` attribute (`Tparams` for gathers); casts have neither."""
    for name in ("T", "Tparams"):
        attr = node.attr.get(name)
        if attr is not None and attr.WhichOneof("value") == "type":
            return tf.as_dtype(attr.type).name
    return None


def ops_in(ops, scope, types=None):
    """The floating ops under layer `scope`'s name scope (Keras appends `_<n>` to repeated names)."""
    pattern = re.compile(rf"(^|/){scope}(_\d+)*/")
    return [(t, name, dtype) for t, name, dtype in ops
            if pattern.search(name) and dtype in COMPUTE_DTYPES.values() and (types is None or t in types)]


def dtypes_of(ops):
    assert ops, "no ops matched: the scope or op types are wrong, so the check would prove nothing"
    return {dtype for _, _, dtype in ops}


@pytest.mark.parametrize("policy_name", sorted(COMPUTE_DTYPES))
def test_transformer_body_in_compute_dtype_and_sensitive_layers_in_float32(policy_name):
    compute = COMPUTE_DTYPES[policy_name]
    step = make_step(transformer, policy_name)
    ops = traced_ops(step, token_batch())

    # Forward and backward matrix products of the dense layers, the attention projections and the
    # attention score/value products run in the compute dtype; every op of the body Dense does.
    for scope in ("body", "pre_norm_proj", "attention_softmax", "attention_fused"):
        assert dtypes_of(ops_in(ops, scope, MATRIX_OPS)) == {compute}, scope
    assert dtypes_of(ops_in(ops, "body")) == {compute}
    # Embedding, norm and logits run in float32 forward and backward, and so do both attention
    # softmaxes: the explicit sublayer (kept by type, its scope is `softmax`) and the fused one.
    for scope in ("embed", "norm", "logits", "softmax"):
        assert dtypes_of(ops_in(ops, scope)) == {"float32"}, scope
    assert dtypes_of(ops_in(ops, "attention_softmax", ("Softmax",))) == {"float32"}
    assert dtypes_of(ops_in(ops, "attention_fused", ("Softmax",))) == {"float32"}

    metrics = step(token_batch())
    assert bool(metrics["applied"]) and np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_conv_body_in_compute_dtype(policy_name):
    ops = traced_ops(make_step(convnet, policy_name), image_batch())
    conv_ops = ops_in(ops, "conv_body", MATRIX_OPS)
    assert {t for t, _, _ in conv_ops} == {"Conv2D", "Conv2DBackpropFilter"}
    assert dtypes_of(conv_ops) == {COMPUTE_DTYPES[policy_name]}
    assert dtypes_of(ops_in(ops, "classifier")) == {"float32"}


def test_user_regex_forces_a_layer_and_a_whole_block_to_float32():
    step = make_step(transformer, "mixed_float16", float32_layers=r"pre_norm_proj|attention_fused")
    ops = traced_ops(step, token_batch())
    assert dtypes_of(ops_in(ops, "pre_norm_proj")) == {"float32"}
    # Naming the attention block keeps its projections (its sublayers) in float32 too.
    assert dtypes_of(ops_in(ops, "attention_fused", MATRIX_OPS)) == {"float32"}
    for scope in ("body", "attention_softmax"):
        assert dtypes_of(ops_in(ops, scope, MATRIX_OPS)) == {"float16"}, scope


def test_keep_float32_layers_reports_the_layers_it_switched():
    policy = Policy.from_string("mixed_float16")
    with global_dtype_policy(policy):
        model = transformer()
    paths = keep_float32_layers(model, policy, r".*(norm|logits).*")

    layers = list(model._flatten_layers(include_self=False))
    float32_layers = {layer.name for layer in layers if layer.compute_dtype == "float32"}
    softmax_names = {layer.name for layer in layers if isinstance(layer, keras.layers.Softmax)}
    assert len(softmax_names) == 2
    assert float32_layers == {"embed", "norm", "pre_norm_proj", "logits"} | softmax_names
    assert sorted(paths) == sorted(float32_layers)  # top-level paths equal names; softmaxes have no path
    assert model.get_layer("body").compute_dtype == "float16"


@pytest.mark.parametrize("spec", ["float32", "p=f16,c=f16,o=f16"])
def test_policies_that_are_not_mixed_keep_nothing(spec):
    policy = Policy.from_string(spec)
    with global_dtype_policy(policy):
        model = transformer()
    assert keep_float32_layers(model, policy, ".*") == []
    assert {layer.compute_dtype for layer in model._flatten_layers(include_self=False)} == {policy.compute_dtype.name}


def test_build_model_restores_the_global_policy():
    keras.config.set_dtype_policy("float32")
    seen = []

    def build_fn():
        seen.append(keras.config.dtype_policy().name)
        return convnet()

    mixloop.build_model(build_fn, Policy.from_string("mixed_bfloat16"))
    assert seen == ["mixed_bfloat16"]
    assert keras.config.dtype_policy().name == "float32"


class RecordingSGD(keras.optimizers.SGD):
    """SGD that records, while the step is traced, the dtypes of the gradients it is handed."""

    def apply(self, grads, trainable_variables=None):
        self.grad_dtypes = {tf.as_dtype(g.dtype).name for g in grads}
        return super().apply(grads, trainable_variables)


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_loss_gradients_slots_and_variables_are_float32(policy_name):
    seen_output_dtypes = []

    def loss_fn(logits, batch):
        seen_output_dtypes.append(logits.dtype.name)
        return cross_entropy(logits, batch)

    optimizer = RecordingSGD(0.1, momentum=0.9)
    step = make_step(transformer, policy_name, optimizer=optimizer, loss_fn=loss_fn)
    metrics = step(token_batch())

    assert seen_output_dtypes == ["float32"]
    assert metrics["loss"].dtype == tf.float32 and metrics["grad_norm"].dtype == tf.float32
    assert optimizer.grad_dtypes == {"float32"}
    assert {v.dtype for v in step.model.trainable_variables} == {"float32"}
    slots = [v for v in optimizer.variables if v.path != optimizer.iterations.path]
    assert len(slots) == len(step.model.trainable_variables) + 1  # one momentum each, plus the learning rate
    assert {v.dtype for v in slots} == {"float32"}
